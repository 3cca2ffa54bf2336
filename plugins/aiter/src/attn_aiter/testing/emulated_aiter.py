"""A stand-in `aiter` package (with `aiter.mla`) made of `emulated_ops`, for tests on machines without an
AMD GPU.

    with installed():
        backend = AiterBackend(ctx)  # imports "aiter" and "aiter.mla": gets the emulation

Only the operators attn-aiter calls exist on it; anything else raises AttributeError, so a call the
backend makes beyond them fails loudly instead of passing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import sys
import types
from typing import Iterator, Optional

from attn_aiter.testing import emulated_ops

#: the two documented forms of `aiter.mla.mla_decode_fwd` (emulated_ops.make_mla_decode_fwd)
FORMS = {"current": True, "earlier": False}


def emulated_aiter(form: str = "current") -> tuple[types.ModuleType, types.ModuleType]:
    """(`aiter`, `aiter.mla`) with the emulated operators; `form` picks the `mla_decode_fwd` signature."""
    pkg = types.ModuleType("aiter")
    pkg.__version__ = f"emulated ({form} mla_decode_fwd)"
    pkg.__spec__ = importlib.machinery.ModuleSpec("aiter", None, is_package=True)
    pkg.__path__ = []
    pkg.paged_attention_ragged = emulated_ops.paged_attention_ragged
    pkg.flash_attn_varlen_func = emulated_ops.flash_attn_varlen_func
    mla = types.ModuleType("aiter.mla")
    mla.__spec__ = importlib.machinery.ModuleSpec("aiter.mla", None)
    mla.mla_decode_fwd = emulated_ops.make_mla_decode_fwd(FORMS[form])
    mla.mla_prefill_fwd = emulated_ops.mla_prefill_fwd
    pkg.mla = mla
    return pkg, mla


@contextlib.contextmanager
def installed(form: str = "current") -> Iterator[types.ModuleType]:
    """`sys.modules["aiter"]` / `["aiter.mla"]` are the emulation inside the block (previous entries after)."""
    previous = {name: sys.modules.get(name) for name in ("aiter", "aiter.mla")}
    pkg, mla = emulated_aiter(form)
    sys.modules["aiter"], sys.modules["aiter.mla"] = pkg, mla
    try:
        yield pkg
    finally:
        for name, mod in previous.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def emulated_backend_class(device: str = "cpu", archs: Optional[frozenset[str]] = None) -> type:
    """`AiterBackend` declaring `device` (default the CPU) instead of "cuda": the test-only device shim.
    `archs` narrows the declared archs (e.g. {"mla"}, so that the conformance kit runs every mode and the
    graph path in MLA). Everything else - metadata, operator calls, K/V writes - is the real class's."""
    from attn_aiter.backend import AiterBackend

    caps = AiterBackend.capabilities
    caps = dataclasses.replace(
        caps, devices=frozenset({device}), archs=caps.archs if archs is None else frozenset(archs)
    )
    name = "EmulatedAiter" + ("" if archs is None else "_" + "_".join(sorted(archs)))
    return type(name, (AiterBackend,), {"capabilities": caps, "__module__": __name__})

"""A stand-in `torch_npu` module made of `emulated_ops`, for tests on machines without an NPU.

    with installed("7.0.0"):
        backend = AscendBackend(ctx)  # imports "torch_npu": gets the emulation

Only the operators attn-ascend calls exist on it; anything else raises AttributeError, so a call the
backend makes beyond them fails loudly instead of passing.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Iterator, Optional

from attn_ascend.testing import emulated_ops

#: Ascend Extension for PyTorch release -> (the fused-infer operator's scale keyword, query_rope/key_rope)
RELEASES = {"6.0.0": ("scale_value", False), "7.0.0": ("scale", True)}


def emulated_torch_npu(release: str = "7.0.0") -> types.ModuleType:
    """A module named torch_npu with the emulated operators of `release` (a key of RELEASES)."""
    scale_keyword, rope = RELEASES[release]
    mod = types.ModuleType("torch_npu")
    mod.__version__ = f"emulated ({release})"
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # find_spec() works while installed
    mod.npu_fused_infer_attention_score = emulated_ops.make_fused_infer_attention_score(scale_keyword, rope)
    for name in (
        "_npu_reshape_and_cache",
        "_npu_paged_attention",
        "_npu_paged_attention_mla",
        "_npu_fused_infer_attention_score_get_max_workspace",
    ):
        setattr(mod, name, getattr(emulated_ops, name))
    return mod


@contextlib.contextmanager
def installed(release: str = "7.0.0") -> Iterator[types.ModuleType]:
    """`sys.modules["torch_npu"]` is the emulation inside the block (the previous entry, if any, after)."""
    previous = sys.modules.get("torch_npu")
    mod = emulated_torch_npu(release)
    sys.modules["torch_npu"] = mod
    try:
        yield mod
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous


def emulated_backend_class(device: str = "cpu", archs: Optional[frozenset[str]] = None) -> type:
    """`AscendBackend` declaring `device` (default the CPU) instead of "npu": the test-only device shim.
    `archs` narrows the declared archs (e.g. {"mla"}, so that the conformance kit runs every mode and
    the graph path in MLA). Everything else - metadata, operator calls, K/V writes - is the real class's."""
    import dataclasses

    from attn_ascend.backend import AscendBackend

    caps = AscendBackend.capabilities
    caps = dataclasses.replace(
        caps, devices=frozenset({device}), archs=caps.archs if archs is None else frozenset(archs)
    )
    name = "EmulatedAscend" + ("" if archs is None else "_" + "_".join(sorted(archs)))
    return type(name, (AscendBackend,), {"capabilities": caps, "__module__": __name__})

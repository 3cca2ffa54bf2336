"""A stand-in `wave_lang` module tree made of `emulated_kernels`, for tests on machines without an AMD GPU.

    with installed("full"):
        backend = WaveBackend(ctx)  # imports wave_lang's templates and compiler: gets the emulation

Only the names attn-wave uses exist: the two templates, the shape descriptors, the MMA variant names,
and a compiler whose `wave_compile(options, kernel)` returns the emulated kernel unchanged (the compile
options are recorded on `COMPILED`, not checked: what the real compiler does with them never ran here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.machinery
import sys
import types
from typing import Iterator

from attn_wave.testing import emulated_kernels as ek

#: the modules attn-wave imports (`attn_wave.wave_kernels.MODULES`)
NAMES = (
    "wave_lang",
    "wave_lang.kernel",
    "wave_lang.kernel.wave",
    "wave_lang.kernel.wave.compile",
    "wave_lang.kernel.wave.constraints",
    "wave_lang.kernel.wave.utils",
    "wave_lang.kernel.wave.utils.general_utils",
    "wave_lang.kernel.wave.utils.run_utils",
    "wave_lang.kernel.wave.templates",
    "wave_lang.kernel.wave.templates.attention_common",
    "wave_lang.kernel.wave.templates.extend_attention",
    "wave_lang.kernel.wave.templates.paged_decode_attention",
)

#: every (options, kernel) passed to the emulated wave_compile, in order
COMPILED: list[tuple[dict, object]] = []


class MMAType(enum.Enum):
    F32_16x16x16_F16 = 0
    F32_16x16x32_K8_F16 = 1
    F32_32x32x8_F16 = 2


class MMAOperand(enum.Enum):
    M = 0
    N = 1
    K = 2


@dataclasses.dataclass(frozen=True)
class GenericDot:
    along_dim: MMAOperand = MMAOperand.M
    k_vec_size: int = 4
    k_mult: int = 1


class WaveCompileOptions:
    """Records the keyword options it is given."""

    def __init__(self, **options):
        self.options = options


def wave_compile(options: WaveCompileOptions, kernel):
    COMPILED.append((dict(options.options), kernel))
    return kernel


def emulated_wave_lang(decode_form: str = "full") -> dict[str, types.ModuleType]:
    """The module tree; `decode_form` picks the decode template's keywords (`emulated_kernels`)."""
    mods = {}
    for name in NAMES:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mods[name] = mod
    mods["wave_lang"].__version__ = f"emulated ({decode_form} decode template)"
    w = "wave_lang.kernel.wave."
    mods[w + "compile"].WaveCompileOptions = WaveCompileOptions
    mods[w + "compile"].wave_compile = wave_compile
    mods[w + "constraints"].MMAType, mods[w + "constraints"].MMAOperand = MMAType, MMAOperand
    mods[w + "constraints"].GenericDot = GenericDot
    mods[w + "utils.general_utils"].get_default_scheduling_params = lambda: {}
    mods[w + "utils.run_utils"].set_default_run_config = lambda options: options
    mods[w + "templates.attention_common"].AttentionShape = ek.AttentionShape
    mods[w + "templates.extend_attention"].get_extend_attention_kernel = ek.get_extend_attention_kernel
    decode = mods[w + "templates.paged_decode_attention"]
    decode.paged_decode_attention_shape = ek.paged_decode_attention_shape
    decode.get_paged_decode_attention_kernels = ek.make_decode_template(decode_form)
    decode.get_paged_decode_intermediate_arrays_shapes = ek.get_paged_decode_intermediate_arrays_shapes
    return mods


@contextlib.contextmanager
def installed(decode_form: str = "full") -> Iterator[dict[str, types.ModuleType]]:
    """The emulated tree in `sys.modules` inside the block (previous entries after)."""
    previous = {name: sys.modules.get(name) for name in NAMES}
    mods = emulated_wave_lang(decode_form)
    sys.modules.update(mods)
    try:
        yield mods
    finally:
        for name, mod in previous.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def emulated_backend_class(device: str = "cpu") -> type:
    """`WaveBackend` declaring `device` (default the CPU) instead of "cuda": the test-only device shim.
    Everything else - metadata, kernel calls, K/V writes - is the real class's."""
    from attn_wave.backend import WaveBackend

    caps = dataclasses.replace(WaveBackend.capabilities, devices=frozenset({device}))
    return type("EmulatedWave", (WaveBackend,), {"capabilities": caps, "__module__": __name__})

"""Test support: `emulated_fa4` (FA4's varlen forward in float64 from its documented semantics) and
`emulated_backend_class`, the backend over it on CPU tensors, for machines without a Hopper GPU."""

from __future__ import annotations

import dataclasses


def emulated_backend_class(device: str = "cpu") -> type:
    """`FlashAttention4Backend` declaring `device` (default the CPU) and calling the emulation instead of
    FA4: the test-only shim. Everything else (metadata, key lists, graph buffers, K/V writes, the
    arguments of the FA4 call) is the real class's."""
    from attn_flashattention.backend import FlashAttention4Backend
    from attn_flashattention.testing import emulated_fa4

    caps = dataclasses.replace(FlashAttention4Backend.capabilities, devices=frozenset({device}))
    return type(
        "EmulatedFlashAttention4",
        (FlashAttention4Backend,),
        {"capabilities": caps, "load_kernel": lambda self: emulated_fa4.flash_attn_varlen_func, "__module__": __name__},
    )

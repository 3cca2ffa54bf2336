"""The kit's checks of the ragged op (`Feature.RAGGED`, `attn_core.contract.ragged`): packed sequences of random
lengths (empty and one-row sequences included) against the float64 reference of each sequence, with q/k/v
read as strided views of a fused qkv buffer whose margins and unused columns are NaN (a kernel reading
outside its rows or heads turns the output NaN), several layers per batch and several batches per backend
object; bad inputs must raise `InvalidArgumentError` (or its subclasses) before any kernel; a backend that
does not declare the op must refuse it with `UnsupportedFeatureError`.

Check ids: `ragged-dtype-<q dtype>`, `ragged-causal`, `ragged-head_dim-<D>`, `ragged-gqa-<Hq>x<Hkv>`,
`ragged-lse`, `ragged-scaling`, `ragged-long`, `ragged-steps`, `ragged-bad_input-<what>`, `refuse-ragged`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from attn_core.contract.capabilities import Feature
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.ragged import RaggedBatch, ragged_batch, ragged_context
from attn_core.testing.outcome import Check, KitFailure
from attn_core.testing.profile import KitProfile
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_core.testing.target import KitTarget

#: head dims of the ViTs the op serves (checked where declared)
VISION_HEAD_DIMS = (64, 72, 80, 96, 128)


@dataclass(frozen=True)
class RaggedCase:
    """One ragged check: `steps` batches (each a tuple of sequence lengths) run one after the other on one
    backend object, `num_layers` layers per batch (metadata once per batch)."""

    steps: tuple[tuple[int, ...], ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    causal: bool = False
    return_lse: bool = False
    scaling: Optional[float] = None
    num_layers: int = 2
    seed: int = 0

    def describe(self) -> str:
        parts = [f"ragged lens={[list(s) for s in self.steps]}", f"heads={self.num_q_heads}/{self.num_kv_heads}"]
        parts += [f"d={self.head_dim}", self.dtype]
        for name in ("causal", "return_lse", "scaling"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        return " ".join(parts)

    def context(self) -> BackendContext:
        """A ragged-only context (`attn_core.contract.ragged.ragged_context`), validation "full"."""
        dtype = getattr(torch, self.dtype)
        return ragged_context(
            self.device, dtype, self.num_q_heads, self.num_kv_heads, self.head_dim, self.return_lse, "full"
        )


#: a vision tower's packed images (patch counts of 448² to 896² pictures at patch 14, and one in between)
VISION_TOWER_LENS = (1024, 2304, 3136, 4096)


def vision_tower_case(head_dim: int, dtype: str, device: str = "cuda", **kw) -> RaggedCase:
    """A `RaggedCase` at a vision tower's size: 16 heads, the images of `VISION_TOWER_LENS`, one layer."""
    fields = dict(
        steps=(VISION_TOWER_LENS,), num_q_heads=16, num_kv_heads=16, head_dim=head_dim, dtype=dtype, device=device
    )
    return RaggedCase(**{**fields, "num_layers": 1, **kw})


def packed_inputs(
    case: RaggedCase, total: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]`, k / v `[T, Hkv, D]` as views of one fused buffer `[T + 4, Hq + 2·Hkv + 1, D + 8]`
    (rows 2 … T+1, the last head and the last 8 columns unused): random normal values where used, NaN
    everywhere else, so a read outside the views shows in the output."""
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    dtype, dev = getattr(torch, case.dtype), torch.device(case.device)
    buf = torch.full((total + 4, hq + 2 * hkv + 1, d + 8), float("nan"), dtype=dtype, device=dev)
    body = buf[2 : total + 2, : hq + 2 * hkv, :d]
    body.copy_(torch.randn(body.shape, generator=gen, dtype=torch.float32).to(dtype))
    return body[:, :hq], body[:, hq : hq + hkv], body[:, hq + hkv :]


def reference_ragged(q, k, v, lens: tuple[int, ...], scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's float64 dense attention (`reference_attention`), concatenated: `[T, Hq, D]`, `[T, Hq]`."""
    outs, lses, start = [], [], 0
    for n in lens:
        rows = slice(start, start + n)
        o, lse = reference_attention(q[rows], k[rows], v[rows], q_positions=torch.arange(n), scale=scale, causal=causal)
        outs.append(o)
        lses.append(lse)
        start += n
    return torch.cat(outs), torch.cat(lses)


def run_ragged_case(target: KitTarget, case: RaggedCase) -> str:
    """Run `case` and compare every layer with the reference; `KitFailure` naming the case on a mismatch."""
    backend = target.factory(case.context())
    gen = torch.Generator().manual_seed(case.seed)
    tol = tolerance(getattr(torch, case.dtype))
    worst = 0.0
    scale = case.scaling if case.scaling is not None else case.head_dim**-0.5
    for step, lens in enumerate(case.steps):
        batch = ragged_batch(lens, case.device, causal=case.causal)
        backend.init_ragged_metadata(batch)
        for layer in range(case.num_layers):
            q, k, v = packed_inputs(case, sum(lens), gen)
            res = backend.ragged_attention(q, k, v, batch, scaling=case.scaling, return_lse=case.return_lse)
            out, lse = res if case.return_lse else (res, None)
            ref_o, ref_lse = reference_ragged(q, k, v, lens, scale, case.causal)
            want = (sum(lens), case.num_q_heads * case.head_dim)
            if tuple(out.shape) != want or out.dtype != q.dtype:
                raise KitFailure(
                    f"output {tuple(out.shape)} {out.dtype}, expected {want} {q.dtype}\n  case: {case.describe()}"
                )
            err = relative_error(out.reshape(ref_o.shape), ref_o)
            lse_err = 0.0
            if lse is not None:
                if lse.dtype != torch.float32 or tuple(lse.shape) != (sum(lens), case.num_q_heads):
                    raise KitFailure(
                        f"LSE {tuple(lse.shape)} {lse.dtype}, expected float32 {(sum(lens), case.num_q_heads)}"
                    )
                lse_err = float((lse.double().cpu() - ref_lse).abs().max()) if ref_lse.numel() else 0.0
            if not (err <= tol and lse_err <= max(tol, 1e-4)):
                where = (
                    f"step {step} layer {layer}: out rel err {err:.3g}, lse abs err {lse_err:.3g} (tolerance {tol:g})"
                )
                raise KitFailure(f"{where}\n  case: {case.describe()}")
            worst = max(worst, err)
    return f"max rel err {worst:.2g}"


def random_lengths(rng: random.Random, count: int, longest: int) -> tuple[int, ...]:
    """`count` lengths in 0 … longest, one of them 0 and one 1 when count >= 4 (edge cases), the rest random."""
    lens = [rng.randint(1, longest) for _ in range(count)]
    if count >= 4:
        lens[rng.randrange(count)] = 0
        lens[(lens.index(0) + 1) % count] = 1
    return tuple(lens)


def _expect_error(case: RaggedCase, target: KitTarget, errors: tuple, what: str, attempt: Callable) -> str:
    """A backend built for `case` (its construction inside the check), then `attempt(backend, batch, q, k, v)`:
    one of `errors` must be raised."""
    gen = torch.Generator().manual_seed(case.seed)
    lens = case.steps[0]
    batch = ragged_batch(lens, case.device, causal=case.causal)
    q, k, v = packed_inputs(case, sum(lens), gen)
    names = " or ".join(e.__name__ for e in errors)
    try:
        attempt(target.factory(case.context()), batch, q, k, v)
    except errors as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        raise KitFailure(
            f"{what}: expected {names}, got {type(exc).__name__}: {exc}\n  case: {case.describe()}"
        ) from exc
    raise KitFailure(f"{what}: expected {names}, but the call succeeded\n  case: {case.describe()}")


def _bad_inputs(case: RaggedCase) -> dict[str, tuple[str, Callable]]:
    """name -> (what, attempt(backend, batch, q, k, v)) for malformed ragged calls."""

    def init_then(call: Callable) -> Callable:
        def attempt(backend, batch, q, k, v):
            backend.init_ragged_metadata(batch)
            return call(backend, batch, q, k, v)

        return attempt

    def decreasing(backend, batch, q, k, v):
        bad = RaggedBatch(
            batch.cu_seqlens.flip(0).contiguous(), batch.cu_seqlens_cpu.flip(0).contiguous(), batch.max_seqlen
        )
        backend.init_ragged_metadata(bad)

    def short_max(backend, batch, q, k, v):
        backend.init_ragged_metadata(replace(batch, max_seqlen=max(batch.max_seqlen - 1, 0)))

    def device_copy(backend, batch, q, k, v):
        wrong = batch.cu_seqlens.clone()
        wrong[-1] += 1
        backend.init_ragged_metadata(replace(batch, cu_seqlens=wrong))

    odd = torch.float64 if case.dtype != "float64" else torch.float32
    return {
        "q_rows": (
            "q with one row too many",
            init_then(lambda b, r, q, k, v: b.ragged_attention(torch.cat([q, q[:1]]), k, v, r)),
        ),
        "k_heads": (
            "k with one head too many",
            init_then(lambda b, r, q, k, v: b.ragged_attention(q, torch.cat([k, k[:, :1]], 1), v, r)),
        ),
        "v_missing": ("v None", init_then(lambda b, r, q, k, v: b.ragged_attention(q, k, None, r))),
        "q_dtype": (f"q of dtype {odd}", init_then(lambda b, r, q, k, v: b.ragged_attention(q.to(odd), k, v, r))),
        "scaling": ("scaling 0", init_then(lambda b, r, q, k, v: b.ragged_attention(q, k, v, r, scaling=0.0))),
        "no_metadata": (
            "ragged_attention before init_ragged_metadata",
            lambda b, r, q, k, v: b.ragged_attention(q, k, v, r),
        ),
        "other_batch": (
            "ragged_attention with a batch other than the one of init_ragged_metadata",
            init_then(lambda b, r, q, k, v: b.ragged_attention(q, k, v, replace(r))),
        ),
        "cu_seqlens_decreasing": ("cu_seqlens not non-decreasing", decreasing),
        "max_seqlen_short": ("max_seqlen below the longest sequence", short_max),
        "cu_seqlens_device_copy": ("cu_seqlens differing from its host copy (validation full)", device_copy),
    }


class RaggedPlan:
    """The ragged checks of one target under one profile (`checks()`)."""

    def __init__(self, target: KitTarget, profile: KitProfile, dtype: str, seed: int = 0):
        self.target, self.p, self.dtype, self.seed = target, profile, dtype, seed
        self.caps = target.capabilities
        cuda = not profile.device.startswith("cpu")
        self.longest = 1024 if cuda else 24
        self.count = 6 if cuda else 5
        self.long_len = (4096 if profile.quick else 8192) if cuda else 80

    def head_dim(self) -> int:
        declared = self.caps.ragged_head_dims
        if declared is None or self.p.head_dim in declared:
            return self.p.head_dim
        return min(declared, key=lambda d: (abs(d - self.p.head_dim), d))

    def case(self, i: int, **kw) -> RaggedCase:
        rng = random.Random(f"{self.seed}-ragged-{i}")
        fields = dict(
            steps=(random_lengths(rng, self.count, self.longest),),
            num_q_heads=self.p.num_q_heads,
            num_kv_heads=self.p.num_kv_heads,
            head_dim=self.head_dim(),
            dtype=self.dtype,
            device=self.p.device,
            seed=self.seed + i,
        )
        fields.update(kw)
        return RaggedCase(**fields)

    def checks(self) -> list[Check]:
        out: list[Check] = []
        if Feature.RAGGED not in self.caps.features:
            case = self.case(0)

            def refuse() -> str:
                def attempt(backend, batch, q, k, v):
                    backend.init_ragged_metadata(batch)
                    return backend.ragged_attention(q, k, v, batch)

                refusals = (UnsupportedFeatureError, IncompatibleBackendError)
                return _expect_error(case, self.target, refusals, "undeclared ragged op", attempt)

            return [Check("refuse-ragged", refuse, case.describe())]

        def numeric(cid: str, case: RaggedCase) -> None:
            out.append(Check(cid, lambda: run_ragged_case(self.target, case), case.describe()))

        for dtype in sorted(self.caps.q_dtypes):
            numeric(f"ragged-dtype-{dtype}", self.case(1, dtype=dtype))
        numeric("ragged-causal", self.case(2, causal=True))
        declared = self.caps.ragged_head_dims
        dims = [d for d in VISION_HEAD_DIMS if declared is None or d in declared]
        for d in dims[:2] if self.p.quick else dims:
            numeric(f"ragged-head_dim-{d}", self.case(3 + d, head_dim=d))
        for hq, hkv in self.p.gqa:
            numeric(f"ragged-gqa-{hq}x{hkv}", self.case(4, num_q_heads=hq, num_kv_heads=hkv))
        if Feature.LSE_OUTPUT in self.caps.features:
            numeric("ragged-lse", self.case(5, return_lse=True, causal=False))
            numeric("ragged-lse-causal", self.case(6, return_lse=True, causal=True))
        numeric("ragged-scaling", self.case(7, scaling=0.37))
        numeric("ragged-long", self.case(8, steps=((self.long_len, 3, self.long_len // 3),), num_layers=1))
        rng = random.Random(f"{self.seed}-ragged-steps")
        steps = tuple(random_lengths(rng, self.count - i, self.longest) for i in range(3))
        numeric("ragged-steps", self.case(9, steps=steps, num_layers=3))
        base = self.case(10)
        for name, (what, attempt) in _bad_inputs(base).items():

            def run(what=what, attempt=attempt) -> str:
                return _expect_error(base, self.target, (InvalidArgumentError,), what, attempt)

            out.append(Check(f"ragged-bad_input-{name}", run, base.describe()))
        return out


def ragged_checks(target: KitTarget, profile: KitProfile, dtype: str, seed: int = 0) -> list[Check]:
    """The ragged op's checks for `target` (its base q dtype `dtype`), or its refusal when undeclared."""
    return RaggedPlan(target, profile, dtype, seed).checks()


__all__ = [
    "RaggedCase",
    "RaggedPlan",
    "VISION_HEAD_DIMS",
    "packed_inputs",
    "ragged_checks",
    "reference_ragged",
    "run_ragged_case",
]

"""Helpers shared by the wrappers that compose backends: capability intersection and the check that
composed backends read and write the same KV cache the same way."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence

from attn_core.contract.capabilities import Capabilities, CudaGraphLevel, Feature
from attn_core.contract.errors import InvalidArgumentError

if TYPE_CHECKING:  # annotations only
    from attn_core.contract.backend import AttentionBackend

#: BackendContext fields that fix how K/V sit in the cache; composed backends must agree on all of them.
KV_LAYOUT_FIELDS = (
    "device",
    "page_size",
    "kv_dtype",
    "attention_arch",
    "num_kv_heads",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
)


def check_same_kv_layout(named_backends: Sequence[tuple[str, AttentionBackend]]) -> None:
    """Raise `InvalidArgumentError` naming the first backend whose context disagrees with the first one on
    the KV layout (page size, dtype, heads, arch, device) or uses another KV pool / request table."""
    (ref_name, ref), *rest = named_backends
    for name, b in rest:
        for f in KV_LAYOUT_FIELDS:
            want, got = getattr(ref.ctx, f), getattr(b.ctx, f)
            if want != got:
                raise InvalidArgumentError(
                    name, f"a backend with {f}={want} like {ref_name} (same KV layout)", f"{f}={got}"
                )
        for pool in ("token_to_kv_pool", "req_to_token_pool"):
            a, c = getattr(ref.ctx, pool), getattr(b.ctx, pool)
            if a is not None and c is not None and a is not c:
                raise InvalidArgumentError(name, f"the same {pool} as {ref_name}", "another pool object")


def _meet(a: Optional[frozenset], b: Optional[frozenset]) -> Optional[frozenset]:
    """Intersection where None means "any"."""
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _max_cc(a, b):
    if a is None or b is None:
        return a or b
    return max(tuple(a), tuple(b))


def _min_cc(a, b):
    if a is None or b is None:
        return a or b
    return min(tuple(a), tuple(b))


def intersect_capabilities(caps: Sequence[Capabilities]) -> Capabilities:
    """What every one of `caps` can do: sets intersected, the lowest CUDA-graph level, the narrowest
    compute-capability range, the union of required CPU features. `Feature.RAGGED` is dropped: the ragged
    op takes no `ForwardBatch` to route, so a composed backend does not serve it (call a child's)."""
    out = caps[0]
    for c in caps[1:]:
        out = replace(
            out,
            devices=out.devices & c.devices,
            q_dtypes=out.q_dtypes & c.q_dtypes,
            kv_dtypes=out.kv_dtypes & c.kv_dtypes,
            archs=out.archs & c.archs,
            head_dims=_meet(out.head_dims, c.head_dims),
            page_sizes=_meet(out.page_sizes, c.page_sizes),
            forward_modes=out.forward_modes & c.forward_modes,
            features=out.features & c.features,
            cuda_graph=CudaGraphLevel(min(out.cuda_graph, c.cuda_graph)),
            min_compute_capability=_max_cc(out.min_compute_capability, c.min_compute_capability),
            max_compute_capability=_min_cc(out.max_compute_capability, c.max_compute_capability),
            cpu_isa=out.cpu_isa | c.cpu_isa,
            kv_layouts=out.kv_layouts & c.kv_layouts,
        )
    return replace(out, features=out.features - {Feature.RAGGED})

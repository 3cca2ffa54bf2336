"""`FlashAttention4Backend` (`fa4`): attn-core's backend contract over FlashAttention-4's varlen forward.

Per step, `build_forward_metadata` builds the step's key lists once, on the device (`keys.py`): the query
offsets and the page table of every request, plus the encoder tokens' table for cross-attention layers.
Per layer, `forward` writes the new K/V into the pool and makes one FA4 call (`kernel.attend`) over the
pool's buffers viewed as pages: no copy, no host sync, no per-layer planning.

What each step runs (every mode one call per layer):
- DECODE, EXTEND, MIXED, DRAFT_EXTEND, TARGET_VERIFY without a custom mask: each request a sequence of its
  new tokens over all of its keys (cached and new), causal from the bottom right, at the pool's page size;
  a window of W keys is FA4's window (W - 1, 0).
- TARGET_VERIFY with a custom mask (draft trees): each query a sequence of its own over the keys its mask
  row lets it see (`keys.tree_key_lists`, per token, not causal); a window filters the lists, built once
  per step and window on first use.
- Cross-attention layers: the request's encoder tokens (the first of its row), not causal, no window.
  Decoder self attention in encoder-decoder batches reads per token (the encoder tokens shift the
  decoder's off page boundaries).

CUDA graphs (DECODE and TARGET_VERIFY, `CudaGraphLevel.UNIFORM_BATCH`): `init_cuda_graph_state`
allocates the key counts and page tables every captured size shares (slices of them); capture builds a
step over those views with the size's fixed query offsets, replay rewrites them in place. Tree lists get
a table per window met before capture (the warm-up run). Encoder-decoder batches run eagerly only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_flashattention.kernel import Fa4Function, attend, load_fa4
from attn_flashattention.keys import (
    KeyList,
    TreeVerify,
    page_lists,
    pages_for,
    query_offsets,
    token_lists,
    verify_queries,
)
from attn_flashattention.spec import CAPABILITIES

#: FA4 on SM90 reads a page of exactly one key tile whole by TMA (rows past a request's end included, which
#: attn's pools do not promise to keep finite); at head dim 256 a windowed layer's tile is 64 keys
TMA_TILE_PAGES = {256: 64}


@dataclass
class Fa4Step:
    """One step's metadata: the key lists of its self-attention layers (`seq`, or per query and window
    `tree` for a verify step with a custom mask) and of its cross-attention layers (`cross`, encoder
    tokens; None without an encoder). `graph`: captured for CUDA graphs (its lists view graph buffers)."""

    mode: ForwardMode
    num_tokens: int
    seq: Optional[KeyList] = None
    tree: Optional[TreeVerify] = None
    cross: Optional[KeyList] = None
    graph: bool = False


@dataclass
class _GraphBuffers:
    """What every captured size shares: key counts `[max_num_tokens]`, page tables `[max_bs, pages of
    max_context_len]`, and per window the tree-verify tables `[max_num_tokens, max_context_len]`."""

    counts: torch.Tensor
    pages: torch.Tensor
    tree: dict = field(default_factory=dict)  # window -> (table, counts)


def check_context(ctx, name: str) -> None:
    """What `CAPABILITIES` cannot say, refused at construction: a V head dim other than the K head dim, and
    a page size that is one FA4 key tile at its head dim (`TMA_TILE_PAGES`)."""
    if ctx.v_head_dim != ctx.head_dim:
        raise UnsupportedFeatureError(name, f"v_head_dim {ctx.v_head_dim} != head_dim {ctx.head_dim}")
    if TMA_TILE_PAGES.get(ctx.head_dim) == ctx.page_size:
        why = "FA4 reads such a page whole by TMA, rows past a request's end included"
        raise UnsupportedFeatureError(name, f"page_size {ctx.page_size} at head_dim {ctx.head_dim} ({why})")


class FlashAttention4Backend(AttentionBackend[Fa4Step]):
    """FlashAttention-4 on CUDA, compute capability 9.0 (10.x unverified). No options."""

    name = "fa4"
    capabilities = CAPABILITIES

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)  # unknown options: a typed error
        check_context(ctx, self.name)
        self.fa4 = self.load_kernel()
        self.page_size = ctx.page_size
        self._offsets: dict[tuple[int, int], torch.Tensor] = {}  # (sequences, queries each) -> arange offsets
        self._graph: Optional[_GraphBuffers] = None
        self._captured: dict[tuple[int, ForwardMode], Fa4Step] = {}

    def load_kernel(self) -> Fa4Function:
        """FA4's varlen forward (the CPU tests' stand-in class returns the emulation here)."""
        return load_fa4(self.name)

    # ---- per-step metadata -------------------------------------------------------------------
    def _uniform_offsets(self, n: int, per: int) -> torch.Tensor:
        """int32 `[n + 1]` offsets of n sequences of `per` queries each (0, per, 2 per, ...), made once."""
        out = self._offsets.get((n, per))
        if out is None:
            out = self._offsets[(n, per)] = torch.arange(0, n * per + 1, per, dtype=torch.int32, device=self.device)
        return out

    def build_forward_metadata(self, forward_batch: ForwardBatch) -> Fa4Step:
        b = forward_batch
        mode, bs, ps = b.forward_mode, b.batch_size, self.page_size
        r2t, rows = self.req_to_token(b), b.req_pool_indices
        if mode.is_decode():
            offsets, max_q = self._uniform_offsets(bs, 1), 1
        else:
            offsets, max_q = query_offsets(b.extend_seq_lens), max(1, int(b.extend_seq_lens_cpu.max())) if bs else 1
        max_seq = int(b.seq_lens_cpu.max()) if bs else 0
        enc = b.encoder_lens
        step = Fa4Step(mode, b.num_tokens)
        # the key lists check every device row and slot against the table and the pool: refused, never read
        slots, fault = self.kv_pool(b).num_slots, self.device_faults.buffer
        mask = b.spec_info.custom_mask if mode.is_target_verify() and b.spec_info is not None else None
        if mask is not None:
            if enc is not None:
                raise UnsupportedFeatureError(self.name, "a verify custom mask in an encoder-decoder batch")
            q_req, q_idx = verify_queries(b.extend_seq_lens_cpu, self.device)
            inputs = (mask, b.spec_info.mask_indptr, r2t, rows, b.seq_lens, q_req, q_idx, b.extend_seq_lens)
            step.tree = TreeVerify(*inputs, max(1, max_seq), self._uniform_offsets(b.num_tokens, 1), num_slots=slots)
        elif enc is None:
            step.seq = KeyList(
                offsets,
                max_q,
                b.seq_lens,
                page_lists(r2t, rows, b.seq_lens, ps, pages_for(max_seq, ps), slots, fault),
                ps,
                True,
            )
        else:
            step.seq = KeyList(
                offsets, max_q, b.seq_lens, token_lists(r2t, rows, enc, b.seq_lens, max(1, max_seq), slots), 1, True
            )
        if enc is not None:
            max_enc = int(b.encoder_lens_cpu.max()) if bs else 0
            cross = page_lists(r2t, rows, enc, ps, pages_for(max_enc, ps), slots, fault)
            step.cross = KeyList(offsets, max_q, enc, cross, ps, False)
        return step

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise InvalidArgumentError(
                "max_bs/max_num_tokens", "max_num_tokens >= max_bs >= 1", (max_bs, max_num_tokens)
            )
        width = pages_for(self.ctx.max_context_len, self.page_size)
        counts = torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device)
        self._graph = _GraphBuffers(counts, torch.zeros(max_bs, width, dtype=torch.int32, device=self.device))
        self._captured = {}

    def _tree_buffers(self, window: Optional[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n rows of the graph's tree-verify table and counts of `window` (allocated on first use)."""
        g = self._graph
        found = g.tree.get(window)
        if found is None:
            rows, width = g.counts.shape[0], max(1, self.ctx.max_context_len)
            found = g.tree[window] = (
                torch.zeros(rows, width, dtype=torch.int32, device=self.device),
                torch.zeros(rows, dtype=torch.int32, device=self.device),
            )
        return found[0][:n], found[1][:n]

    def _graph_step(self, step: CudaGraphStep, num_tokens: int, old: Optional[Fa4Step]) -> Fa4Step:
        """The step of graph batch `step` over the graph buffers, their contents rewritten for it."""
        g, mode, bs = self._graph, step.forward_mode, step.bs
        if step.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with encoder-decoder batches")
        if not (mode.is_decode() or mode.is_target_verify()):
            raise UnsupportedFeatureError(self.name, f"CUDA graphs for {mode.name}")
        if bs > g.pages.shape[0] or num_tokens > g.counts.shape[0]:
            raise InvalidArgumentError(
                "bs", f"a graph batch within init_cuda_graph_state's sizes {tuple(g.pages.shape[:1])}", bs
            )
        per = num_tokens // bs
        r2t = self.req_to_token()
        mask = step.spec_info.custom_mask if mode.is_target_verify() and step.spec_info is not None else None
        if old is not None and (mask is None) != (old.tree is None):
            raise InvalidArgumentError(
                "spec_info.custom_mask", "a mask exactly when the graph was captured with one", mask is not None
            )
        if mask is None:
            counts, pages = g.counts[:bs], g.pages[:bs]
            counts.copy_(step.seq_lens)
            checks = (self.kv_pool().num_slots, self.device_faults.buffer)  # rows and slots refused, never read
            pages.copy_(page_lists(r2t, step.req_pool_indices, step.seq_lens, self.page_size, pages.shape[1], *checks))
            seq = KeyList(self._uniform_offsets(bs, per), per, counts, pages, self.page_size, True)
            return Fa4Step(mode, num_tokens, seq=seq, graph=True)
        q_lens = torch.full((bs,), per, dtype=torch.int32)
        q_req, q_idx = verify_queries(q_lens, self.device)
        inputs = (
            mask,
            step.spec_info.mask_indptr,
            r2t,
            step.req_pool_indices,
            step.seq_lens,
            q_req,
            q_idx,
            q_lens.to(self.device),
        )
        width, offsets = max(1, self.ctx.max_context_len), self._uniform_offsets(num_tokens, 1)
        tree = TreeVerify(*inputs, width, offsets, num_slots=self.kv_pool().num_slots)
        for window in old.tree.lists if old is not None else (None,):  # every list the graph reads
            tree.keys(window, out=self._tree_buffers(window, num_tokens))
        return Fa4Step(mode, num_tokens, tree=tree, graph=True)

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        if self._graph is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before capture", None)
        state = self._graph_step(step, step.num_tokens, None)
        self._captured[(step.bs, step.forward_mode)] = state
        self.bind_graph_metadata(state, step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        key = (step.bs, step.forward_mode)
        old = self._captured.get(key)
        if old is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {step.forward_mode.name}", step.bs)
        if step.num_tokens not in (None, old.num_tokens):
            raise InvalidArgumentError("num_tokens", f"{old.num_tokens} as captured for bs={step.bs}", step.num_tokens)
        state = self._graph_step(step, old.num_tokens, old)
        self._captured[key] = state
        self.bind_graph_metadata(state, step)

    # ---- attention ---------------------------------------------------------------------------
    def _keys_for(self, step: Fa4Step, layer) -> tuple[KeyList, Optional[int]]:
        """The key list a layer reads in this step and the window FA4 applies (None: none or already in
        the list), or a typed error before any K/V write."""
        if layer.is_cross_attention:
            if step.cross is None:
                raise InvalidArgumentError(
                    "forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None
                )
            return step.cross, None
        window = layer.sliding_window_size
        if step.tree is None:
            return step.seq, window
        if window not in step.tree.lists:
            if not step.graph:
                return step.tree.keys(window), None
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise InvalidArgumentError(
                    f"layer {layer.layer_id} sliding_window_size",
                    "a window met before CUDA-graph capture (run the batch once eagerly first)",
                    window,
                )
            return step.tree.keys(window, out=self._tree_buffers(window, step.num_tokens)), None
        return step.tree.lists[window], None

    def describe_path(self, layer, forward_batch: ForwardBatch) -> str:
        """The FA4 call a layer makes in this step (`attn_core.contract.debug_paths`, `ATTN_DEBUG_PATHS=1`)."""
        step = self.forward_metadata
        if step is None:
            return "no tokens: no FA4 call"
        window = "" if layer.sliding_window_size is None else f", window {layer.sliding_window_size}"
        if layer.is_cross_attention:
            return "FA4 varlen over each request's encoder tokens (paged, not causal)"
        if step.tree is not None:
            return f"FA4 varlen, one sequence per query over the keys its verify mask shows (per token{window})"
        return f"FA4 varlen over each request's keys (page {step.seq.page_size}, causal{window})"

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def _forward(self, q, k, v, layer, batch, save_kv_cache, return_lse=False, sinks=None):
        keys, window = self._keys_for(self.forward_metadata, layer)
        pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
        k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        settings = dict(
            scale=layer.scaling, window=window, logit_cap=layer.logit_cap, sinks=sinks, return_lse=return_lse
        )
        o, lse = attend(self.fa4, q, k_cache, v_cache, keys, **settings)
        o = o.flatten(1)  # [T, Hq * Dv]; flatten, not view(T, -1): T may be 0
        return (o, lse) if return_lse else o

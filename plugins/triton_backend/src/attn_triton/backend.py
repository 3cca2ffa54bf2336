"""`TritonAttnBackend`: paged-KV attention with the kernels of `attn_triton.kernels`.

Per step, `init_forward_metadata` builds CSR key indices (and decode split counts) on the device with
one Triton launch per key set; per layer, DECODE runs the split-KV decode kernel, MHA/GQA TARGET_VERIFY
and DRAFT_EXTEND steps whose requests all carry the same 1..16 tokens the verify kernel (tokens folded
with the q heads of each KV head), and every other mode the extend kernel, except absorbed MLA, whose
DECODE and same-length (2..16 tokens) TARGET_VERIFY / DRAFT_EXTEND steps run the MLA kernel
(`kernels/mla_decode.py`). CUDA graphs (DECODE, TARGET_VERIFY) read persistent buffers that replay
refreshes (`graph.py`). With `ctx.deterministic` the decode split layout depends only on each request's
own length (batch-invariant outputs; the verify kernel has no splits). With `ctx.attention_chunk_size` C
the step's metadata also holds the keys of
chunked local layers: in DECODE each request's keys from its chunk start, in the other modes the step
split into virtual requests (`attn_core.local_attention`), served by the same kernels; CUDA graphs and
TARGET_VERIFY custom masks are refused together with chunked local attention. With a
`SlidingWindowKVPool` the window layers read a second key index: each request's keys from the oldest one
inside the pool's window, translated to window slots (CUDA graphs and custom masks refused there too).
A cascade step (`attn_core.cascade`) adds the shared prefix's keys and each request's keys after it:
plain causal layers run the suffix pass (the usual kernel), then the prefix pass (one extend launch,
all queries over the prefix, non-causal), merged by LSE.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from attn_core.backend import AttentionBackend
from attn_core.batch import ForwardBatch
from attn_core.cascade import splits_into_cascade
from attn_core.context import BackendContext
from attn_core.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.graph_step import CudaGraphStep
from attn_core.layer import AttentionLayer
from attn_core.local_attention import local_decode_starts, make_local_attention_virtual_batches
from attn_core.memory.fp8 import is_fp8
from attn_core.memory.pools import kv_scales
from attn_core.memory.window_pool import SlidingWindowKVPool, window_pool_of
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_core.ops.merge_state import merge_state
from attn_core.probes import triton_interpreter_enabled
from attn_triton.config import SplitPolicy, decode_config, extend_config, hopper_kernels_available, mla_config, verify_config
from attn_triton.graph import GraphState
from attn_triton.kernels.decode import DecodeConfig, decode_attention, head_blocks
from attn_triton.kernels.extend import ExtendConfig, extend_attention
from attn_triton.kernels.mla_decode import MAX_FOLDED_Q_LEN, MLAConfig, mla_attention, programs_per_request
from attn_triton.kernels.ragged import RaggedConfig, attend_ragged, ragged_config, ragged_tiles
from attn_triton.kernels.verify import VerifyConfig, verify_attention, verify_q_len
from attn_triton.metadata import (
    CascadeKeys,
    DecodeMetadata,
    ExtendMetadata,
    IndexScratch,
    KVIndex,
    LocalExtend,
    Splits,
    SplitScratch,
    fill_kv,
    new_kv,
)
from attn_triton.mixed import MixedMetadata, build_mixed_metadata, forward_mixed
from attn_triton.spec import CAPABILITIES

MAX_MHA_HEAD_DIM = 256
MAX_MLA_RANK = 512
MAX_MLA_ROPE = 64


class TritonAttnBackend(AttentionBackend[Union[DecodeMetadata, ExtendMetadata, MixedMetadata]]):
    """Triton attention over the paged pools of attn-core (MHA/GQA/MQA and absorbed MLA).

    Options (tests and tuning): `split_policy` (decode splits), `decode_config` / `extend_config` /
    `mla_config` / `verify_config` (tile sizes; defaults from `attn_triton.config`), `mixed_split` (MIXED
    steps: decodes through the decode kernel, the rest through the extend kernel, `attn_triton.mixed`;
    default True: 1.24-3.7x faster on an H100, docs/dev/perf-notebook.md "MIXED steps"; False keeps one extend launch).

    Absorbed MLA with a KV pool of the q dtype runs DECODE, and TARGET_VERIFY / DRAFT_EXTEND steps whose
    requests all have the same 2..16 new tokens, on the MLA kernel (`kernels/mla_decode.py`); other
    MLA steps (and float8 / uint8 KV pools) run the general decode / extend kernels.
    """

    name = "triton"
    capabilities = CAPABILITIES

    def __init__(
        self,
        ctx: BackendContext,
        *,
        split_policy: Optional[SplitPolicy] = None,
        decode_config: Optional[DecodeConfig] = None,
        extend_config: Optional[ExtendConfig] = None,
        mixed_split: bool = True,
        mla_config: Optional[MLAConfig] = None,
        verify_config: Optional[VerifyConfig] = None,
        ragged_config: Optional[RaggedConfig] = None,
        **options,
    ):
        super().__init__(ctx, **options)
        _check_device(ctx.device)
        _check_context(ctx)
        self.is_mla = ctx.is_mla
        self.d_rope = ctx.qk_rope_head_dim if ctx.is_mla else 0
        self.split_policy = split_policy or SplitPolicy()
        if not isinstance(mixed_split, bool):
            raise InvalidArgumentError("mixed_split", "a bool", mixed_split)
        self.mixed_split = mixed_split
        self.decode_cfg = decode_config or _default_decode(ctx)
        self.extend_cfg = extend_config or _default_extend(ctx)
        if self.extend_cfg.wgmma_block_n and not hopper_kernels_available(ctx.device):
            raise InvalidArgumentError(
                "extend_config.wgmma_block_n",
                f"0 on {ctx.device}: the Hopper extend kernel needs a CUDA GPU of compute capability 9.x and Triton >= 3.6",
                self.extend_cfg.wgmma_block_n,
            )
        self.mla_cfg = mla_config or _default_mla(ctx)
        self.verify_cfg = verify_config or _default_verify(ctx)
        self.ragged_cfg = ragged_config or _default_ragged(ctx)
        self.ctas_per_sm = 0  # the split policy's programs per SM: the MLA kernel's tiles say (MLAConfig.ctas_per_sm)
        if self.is_mla and _mla_kernel_takes(ctx.dtype, ctx.kv_dtype or ctx.dtype):
            self.heads_per_kv_block = programs_per_request(ctx.num_q_heads, self.mla_cfg)
            self.ctas_per_sm = self.mla_cfg.ctas_per_sm
        else:
            self.heads_per_kv_block = head_blocks(ctx.num_q_heads // ctx.num_kv_heads, self.decode_cfg)
        if ctx.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        else:
            self.num_sms = 4
        self.graph: Optional[GraphState] = None
        self._splits: dict[int, Splits] = {}
        self._scratch = SplitScratch(ctx.num_q_heads, ctx.v_head_dim, ctx.device)
        self._index_scratch = IndexScratch(ctx.device)
        self._plain_decode: dict[int, DecodeMetadata] = {}  # bs -> the last plain DECODE step's metadata
        self.device_faults = DeviceFaultFlags(ctx.device)

    # ---- metadata ----------------------------------------------------------------------------
    def decode_splits(self, bs: int) -> Splits:
        """Split parameters of a DECODE batch of `bs` requests (graph-safe: depends on bs only)."""
        splits = self._splits.get(bs)
        if splits is None:
            det = self.ctx.deterministic
            p = self.split_policy
            ms = p.max_splits(bs, self.ctx.num_kv_heads * self.heads_per_kv_block, self.num_sms, det, self.ctas_per_sm)
            splits = self._splits[bs] = Splits(ms, p.min_len(det))
        return splits

    def build_forward_metadata(self, forward_batch: ForwardBatch) -> Union[DecodeMetadata, ExtendMetadata, MixedMetadata]:
        b = forward_batch
        r2t = self.req_to_token(b)
        if b.forward_mode.is_decode():
            return self._decode_metadata(b, r2t)
        if b.forward_mode.is_mixed() and self.mixed_split and b.bidirectional_spans is None:
            mixed = build_mixed_metadata(self, b, r2t)
            if mixed is not None:
                return mixed
        return self._extend_metadata(b, r2t)

    def _decode_metadata(self, b: ForwardBatch, r2t: torch.Tensor) -> DecodeMetadata:
        bs, dev, fault = b.batch_size, self.device, self.device_faults.buffer
        kv = self._index_scratch.kv(bs, b.seq_lens_sum)
        fill_kv(kv, r2t, b.req_pool_indices, b.seq_lens, fault, kv_start=b.encoder_lens, capacity=b.seq_lens_sum)
        splits = self.decode_splits(bs)
        part_o, part_lse = self._scratch.views(bs, splits.max_splits)
        pool = window_pool_of(self.kv_pool(b))
        if b.encoder_lens is None and self.ctx.attention_chunk_size is None and not b.cascade_prefix_len and pool is None:
            # the common step: everything but the index contents depends on bs alone, so the last
            # metadata object of this size is handed out again while its scratch views are current
            meta = self._plain_decode.get(bs)
            if meta is None or meta.kv is not kv or meta.part_o is not part_o:
                meta = self._plain_decode[bs] = DecodeMetadata(kv, None, splits, part_o, part_lse)
            return meta
        cross = None
        if b.encoder_lens is not None:
            cross = new_kv(bs, int(b.encoder_lens_cpu.sum()), dev)
            fill_kv(cross, r2t, b.req_pool_indices, b.encoder_lens, fault)
        local_kv = self._local_decode_kv(b, r2t) if self.ctx.attention_chunk_size is not None else None
        window_kv = self._window_kv(b, r2t, pool) if pool is not None else None
        return DecodeMetadata(
            kv,
            cross,
            splits,
            part_o,
            part_lse,
            local_kv=local_kv,
            window_kv=window_kv,
            cascade=self._cascade_keys(b, r2t) if b.cascade_prefix_len else None,
        )

    def _cascade_keys(self, b: ForwardBatch, r2t: torch.Tensor) -> CascadeKeys:
        """A cascade step's key indices: the shared prefix once (the first request's row) for all the
        step's queries, and each request's keys after it."""
        p, bs, dev, fault = b.cascade_prefix_len, b.batch_size, self.device, self.device_faults.buffer
        prefix = new_kv(1, p, dev)
        fill_kv(prefix, r2t, b.req_pool_indices[:1], torch.full((1,), p, dtype=torch.int32, device=dev), fault)
        suffix = new_kv(bs, b.seq_lens_sum - bs * p, dev)
        start = torch.full((bs,), p, dtype=torch.int32, device=dev)
        fill_kv(suffix, r2t, b.req_pool_indices, (b.seq_lens - p).to(torch.int32), fault, kv_start=start)
        qo_indptr = torch.tensor([0, b.num_tokens], dtype=torch.int32).to(dev, non_blocking=True)
        return CascadeKeys(prefix, qo_indptr, suffix)

    def _window_kv(self, b: ForwardBatch, r2t: torch.Tensor, pool: SlidingWindowKVPool) -> KVIndex:
        """Keys of window-pool layers: request r's keys from position max(0, first query - window + 1)
        (older ones may be released) to its last, as window slots. The kernels' causal and window masks
        depend only on positions relative to the request's last key, so the shorter key list is exact."""
        w = pool.window
        if b.forward_mode.is_decode():
            q_dev, q_cpu = 1, 1
        else:
            q_dev, q_cpu = b.extend_seq_lens, b.extend_seq_lens_cpu
        starts = (b.seq_lens - q_dev - w + 1).clamp_min(0)
        total = int((b.seq_lens_cpu - (b.seq_lens_cpu - q_cpu - w + 1).clamp_min(0)).sum())
        kv = new_kv(b.batch_size, total, self.device)
        col = starts if b.encoder_lens is None else starts + b.encoder_lens
        fill_kv(kv, r2t, b.req_pool_indices, (b.seq_lens - starts).to(torch.int32), self.device_faults.buffer, kv_start=col.to(torch.int32))
        kv.indices[:total] = pool.window_slots(kv.indices[:total])
        return kv

    def _local_decode_kv(self, b: ForwardBatch, r2t: torch.Tensor) -> KVIndex:
        """Keys of chunked local layers in DECODE: request r's keys from the start of the chunk holding
        its position seq_len-1 (one request each, no virtual batch)."""
        chunk = self.ctx.attention_chunk_size
        starts = local_decode_starts(chunk, b.seq_lens)
        total = int((b.seq_lens_cpu - local_decode_starts(chunk, b.seq_lens_cpu)).sum())
        kv = new_kv(b.batch_size, total, self.device)
        col = starts if b.encoder_lens is None else starts + b.encoder_lens
        fill_kv(kv, r2t, b.req_pool_indices, (b.seq_lens - starts).to(torch.int32), self.device_faults.buffer, kv_start=col.to(torch.int32))
        return kv

    def _local_extend(self, b: ForwardBatch, r2t: torch.Tensor) -> LocalExtend:
        """The step as the virtual requests of chunked local attention: host lists from the batch's
        `*_cpu` data, one host→device copy, one index launch."""
        vb = make_local_attention_virtual_batches(self.ctx.attention_chunk_size, b)
        n = vb.num_virtual
        host = torch.tensor([vb.req_indices, vb.kv_starts, vb.kv_lens, vb.q_lens], dtype=torch.int32).reshape(4, n)
        dev = host.to(self.device, non_blocking=True)
        req = dev[0].long()
        col = dev[1] if b.encoder_lens is None else dev[1] + b.encoder_lens[req]
        kv = new_kv(n, vb.num_keys, self.device)
        qo_indptr = torch.empty(n + 1, dtype=torch.int32, device=self.device)
        fill_kv(
            kv,
            r2t,
            b.req_pool_indices[req],
            dev[2],
            self.device_faults.buffer,
            kv_start=col.to(torch.int32),
            q_lens=dev[3],
            qo_indptr=qo_indptr,
        )
        return LocalExtend(qo_indptr, vb.max_q_len, kv)

    def _extend_metadata(self, b: ForwardBatch, r2t: torch.Tensor) -> ExtendMetadata:
        bs, dev = b.batch_size, self.device
        mask = _custom_mask(b)
        qo_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
        mask_indptr = torch.empty(bs + 1, dtype=torch.int64, device=dev) if mask is not None else None
        kv = self._index_scratch.kv(bs, b.seq_lens_sum)
        fill_kv(
            kv,
            r2t,
            b.req_pool_indices,
            b.seq_lens,
            self.device_faults.buffer,
            kv_start=b.encoder_lens,
            q_lens=b.extend_seq_lens,
            qo_indptr=qo_indptr,
            mask_indptr=mask_indptr,
            capacity=b.seq_lens_sum,
        )
        cross = None
        if b.encoder_lens is not None:
            cross = new_kv(bs, int(b.encoder_lens_cpu.sum()), dev)
            fill_kv(cross, r2t, b.req_pool_indices, b.encoder_lens, self.device_faults.buffer)
        max_q = int(b.extend_seq_lens_cpu.max()) if bs else 0
        local = None
        if self.ctx.attention_chunk_size is not None:
            if mask is not None:
                raise UnsupportedFeatureError(self.name, "chunked local attention together with a custom mask (TARGET_VERIFY)")
            local = self._local_extend(b, r2t)
        pool = window_pool_of(self.kv_pool(b))
        window_kv = None
        if pool is not None:
            if mask is not None:
                raise UnsupportedFeatureError(self.name, "a sliding-window KV pool together with a custom mask (TARGET_VERIFY)")
            window_kv = self._window_kv(b, r2t, pool)
        cascade = self._cascade_keys(b, r2t) if b.cascade_prefix_len else None
        return ExtendMetadata(qo_indptr, max_q, kv, cross, mask, mask_indptr, local, window_kv, cascade)

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise InvalidArgumentError("max_bs/max_num_tokens", "max_bs >= 1 and max_num_tokens >= max_bs", (max_bs, max_num_tokens))
        self.graph = GraphState(self, max_bs, max_num_tokens)

    def _graph_state(self) -> GraphState:
        if self.graph is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before capture/replay", None)
        return self.graph

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        if self.ctx.attention_chunk_size is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with chunked local attention (attention_chunk_size)")
        if window_pool_of(self.ctx.token_to_kv_pool) is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with a sliding-window KV pool")
        self.bind_graph_metadata(self._graph_state().capture(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_state().replay(step), step)

    def poll_device_fault(self) -> Optional[str]:
        """What the kernels refused since the last poll (an out-of-range request row, slot, length,
        offset...: see `attn_core.ops.device_faults`), or None; reads and clears the fault buffer (one
        device sync). The index kernel runs in `init_forward_metadata`, the attention kernels in the
        layers: a fault of the attention kernels shows at the poll after the step's forward."""
        return self.device_faults.poll()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padding rows of a graph batch attend one key (their row's first slot): every kernel stays in
        bounds and no split is empty."""
        return 1

    def support_triton(self) -> bool:
        return True

    def needs_page_aligned_draft_kv(self) -> bool:
        """Keys are gathered slot by slot through CSR kv_indices (no page arithmetic), so the draft
        wrapper's branch rows may point at the request's own last page: no K/V copies needed."""
        return False

    # ---- attention ---------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, return_lse=False):
        meta = self._metadata(DecodeMetadata)
        cascade = meta.cascade if sinks is None and splits_into_cascade(layer) else None
        if cascade is not None:
            keys = cascade.suffix
        elif layer.attention_chunk_size is not None:
            keys = self._local(meta.local_kv, layer)
        else:
            keys = self._keys(meta, layer, forward_batch)
        k_buf, v_buf = self._save_and_buffers(q, k, v, layer, forward_batch, save_kv_cache, sinks)
        if self.is_mla and cascade is None and _mla_kernel_takes(q.dtype, k_buf.dtype):
            return self._mla(q, k_buf, layer, keys, sinks, return_lse, q_len=1, decode=meta)
        T, hq, dv = q.shape[0], layer.num_q_heads, layer.v_head_dim
        o = q.new_empty((T, hq, dv))
        lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if return_lse or cascade else None
        self._decode(q, k_buf, v_buf, o, lse, layer, keys, meta.splits, meta.part_o, meta.part_lse, sinks)
        if cascade is not None:
            o, lse = self._merge_prefix_pass(q, k_buf, v_buf, layer, cascade, o, lse)
        o = o.view(T, hq * dv)
        return (o, lse) if return_lse else o

    def _decode(self, q, k_buf, v_buf, o, lse, layer, keys: KVIndex, splits: Splits, part_o, part_lse, sinks) -> None:
        """One split-KV decode launch: q `[bs, Hq, D]` (one row per request of `keys`) into `o` `[bs, Hq,
        Dv]` (and `lse` `[bs, Hq]` float32 when not None), stage-1 results in `part_o` / `part_lse`."""
        k_scale, v_scale = kv_scales(layer, self.ctx.token_to_kv_pool)
        decode_attention(
            _last_dim_contiguous(q),
            k_buf,
            v_buf,
            o,
            keys.indptr,
            keys.indices,
            splits.max_splits,
            splits.min_split_len,
            part_o,
            part_lse,
            self.device_faults.buffer,
            sm_scale=layer.scaling,
            config=self.decode_cfg,
            logit_cap=layer.logit_cap,
            window=None if layer.is_cross_attention else layer.sliding_window_size,
            sinks=_sinks(sinks),
            lse_out=lse,
            k_scale=k_scale,
            v_scale=v_scale,
            d_rope=self.d_rope,
            share_kv=self.is_mla,
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, return_lse=False):
        if isinstance(self.forward_metadata, MixedMetadata):
            return forward_mixed(self, self.forward_metadata, q, k, v, layer, forward_batch, save_kv_cache, sinks, return_lse)
        meta = self._metadata(ExtendMetadata)
        qo_indptr, max_q_len = meta.qo_indptr, meta.max_q_len
        cascade = meta.cascade if sinks is None and splits_into_cascade(layer) else None
        if cascade is not None:
            keys = cascade.suffix
        elif layer.attention_chunk_size is not None:
            local = self._local(meta.local, layer)
            qo_indptr, max_q_len, keys = local.qo_indptr, local.max_q_len, local.kv
        else:
            keys = self._keys(meta, layer, forward_batch)
        k_buf, v_buf = self._save_and_buffers(q, k, v, layer, forward_batch, save_kv_cache, sinks)
        cross = layer.is_cross_attention
        b = forward_batch
        causal, spans = _causal_and_spans(layer, b)
        plain = causal and spans is None and not (cascade is not None or layer.attention_chunk_size is not None)
        # one host-only rule (`verify_q_len`) picks the folded kernels: MLA's for 2..16 tokens, else verify's
        same_q_len = verify_q_len(b.forward_mode, b.batch_size, q.shape[0], max_q_len) if plain else None
        if self.is_mla:
            if same_q_len is not None and 2 <= same_q_len <= MAX_FOLDED_Q_LEN and _mla_kernel_takes(q.dtype, k_buf.dtype):
                return self._mla(q, k_buf, layer, keys, sinks, return_lse, q_len=same_q_len, qo_indptr=qo_indptr, extend=meta)
            same_q_len = None
        o, lse = self._extend(
            q,
            k_buf,
            v_buf,
            layer,
            qo_indptr,
            keys,
            max_q_len,
            causal=causal,
            spans=spans,
            custom_mask=None if cross else meta.custom_mask,
            mask_indptr=None if cross else meta.mask_indptr,
            sinks=sinks,
            want_lse=return_lse or cascade is not None,
            verify_len=same_q_len,
        )
        if cascade is not None:
            o, lse = self._merge_prefix_pass(q, k_buf, v_buf, layer, cascade, o, lse)
        o = o.view(q.shape[0], layer.num_q_heads * layer.v_head_dim)
        return (o, lse) if return_lse else o

    def _extend(
        self, q, k_buf, v_buf, layer, qo_indptr, keys: KVIndex, max_q_len, *, causal, custom_mask, mask_indptr, sinks, want_lse,
        verify_len=None, spans=None,
    ):  # fmt: skip
        """One extend-kernel launch: output `[T, Hq, Dv]` and LSE `[T, Hq]` (None unless `want_lse`).
        With `verify_len` (every request has that many tokens: `verify_q_len`) the verify kernel runs
        instead, its tokens folded with the q heads of each KV head. An fp8 cache is read as stored; the
        layer's scales fold into the score scale and the output."""
        k_scale, v_scale = kv_scales(layer, self.ctx.token_to_kv_pool)
        T, hq, dv = q.shape[0], layer.num_q_heads, layer.v_head_dim
        o = q.new_empty((T, hq, dv))
        lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if want_lse else None
        common = dict(
            sm_scale=layer.scaling,
            custom_mask=custom_mask,
            mask_indptr=mask_indptr,
            logit_cap=layer.logit_cap,
            window=None if layer.is_cross_attention else layer.sliding_window_size,
            sinks=_sinks(sinks),
            lse_out=lse,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        q_in, fault = _last_dim_contiguous(q), self.device_faults.buffer
        if verify_len is not None:
            verify_attention(q_in, k_buf, v_buf, o, keys.indptr, keys.indices, verify_len, fault, config=self.verify_cfg, **common)
        else:
            extend_attention(
                q_in, k_buf, v_buf, o, qo_indptr, keys.indptr, keys.indices, max_q_len, fault,
                config=self.extend_cfg, causal=causal, d_rope=self.d_rope, share_kv=self.is_mla, spans=spans, **common,
            )  # fmt: skip
        return o, lse

    def _mla(
        self,
        q,
        kv_buf,
        layer,
        keys: KVIndex,
        sinks,
        return_lse,
        *,
        q_len: int,
        decode: Optional[DecodeMetadata] = None,
        qo_indptr: Optional[torch.Tensor] = None,
        extend: Optional[ExtendMetadata] = None,
    ):
        """The MLA kernel: DECODE (q_len 1, split-KV with `decode`'s splits and scratch) or q_len folded
        tokens per request (`extend`'s custom mask, if any). Returns the output `[T, Hq * kv_lora_rank]`
        (and the LSE `[T, Hq]` with return_lse)."""
        T, hq, rank = q.shape[0], layer.num_q_heads, self.ctx.kv_lora_rank
        k_scale, v_scale = kv_scales(layer, self.ctx.token_to_kv_pool)
        o = q.new_empty((T, hq, rank))
        lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if return_lse else None
        mla_attention(
            _last_dim_contiguous(q),
            kv_buf,
            o,
            keys.indptr,
            keys.indices,
            self.device_faults.buffer,
            kv_lora_rank=rank,
            sm_scale=layer.scaling,
            config=self.mla_cfg,
            q_len=q_len,
            qo_indptr=qo_indptr,
            max_splits=decode.splits.max_splits if decode is not None else 1,
            min_split_len=decode.splits.min_split_len if decode is not None else 1,
            part_o=decode.part_o if decode is not None else None,
            part_lse=decode.part_lse if decode is not None else None,
            custom_mask=extend.custom_mask if extend is not None else None,
            mask_indptr=extend.mask_indptr if extend is not None else None,
            logit_cap=layer.logit_cap,
            window=None if layer.is_cross_attention else layer.sliding_window_size,
            sinks=_sinks(sinks),
            lse_out=lse,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        o = o.view(T, hq * rank)
        return (o, lse) if return_lse else o

    def _merge_prefix_pass(self, q, k_buf, v_buf, layer, cascade: CascadeKeys, o_suffix, lse_suffix):
        """A cascade's prefix pass (every query of the step, as one non-causal group, over the shared
        keys: one extend launch) merged by LSE with the suffix pass's result."""
        o_p, lse_p = self._extend(
            q,
            k_buf,
            v_buf,
            layer,
            cascade.qo_indptr,
            cascade.prefix,
            q.shape[0],
            causal=False,
            custom_mask=None,
            mask_indptr=None,
            sinks=None,
            want_lse=True,
        )
        return merge_state(o_p, lse_p, o_suffix, lse_suffix)

    def build_ragged_metadata(self, ragged) -> torch.Tensor:
        """The varlen kernel's work list for the batch (`kernels/ragged.ragged_tiles`), once per batch."""
        return ragged_tiles(ragged.seq_lens_cpu.tolist(), self.ragged_cfg.block_m, ragged.causal, self.device)

    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        """The ragged op on the varlen kernel (`kernels/ragged.py`)."""
        fault, cfg, tiles = self.device_faults.buffer, self.ragged_cfg, self.ragged_metadata
        return attend_ragged(q, k, v, ragged, fault, sm_scale=scaling, config=cfg, tiles=tiles, return_lse=return_lse)

    # ---- helpers (host-side checks only; no device sync) -----------------------------------
    def _metadata(self, kind: type):
        meta = self.forward_metadata
        if not isinstance(meta, kind):
            want = "DECODE" if kind is DecodeMetadata else "an extend-like mode"
            raise InvalidArgumentError(
                "forward_metadata", f"metadata built for {want} (call init_forward_metadata on this batch)", type(meta).__name__
            )
        return meta

    def _keys(self, meta, layer: AttentionLayer, b: ForwardBatch) -> KVIndex:
        if meta.window_kv is not None and window_pool_of(self.kv_pool(b)).is_window_layer(layer.layer_id):
            return meta.window_kv
        if layer.is_cross_attention:
            if meta.cross is None:
                raise InvalidArgumentError("forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None)
            return meta.cross
        return meta.kv

    def _local(self, local, layer: AttentionLayer):
        """The step's chunked-local metadata for `layer`, built for the context's chunk size."""
        chunk = self.ctx.attention_chunk_size
        if local is None or layer.attention_chunk_size != chunk:
            raise InvalidArgumentError(
                f"layer {layer.layer_id} attention_chunk_size",
                f"the context's attention_chunk_size ({chunk}), for which the step's metadata is built",
                layer.attention_chunk_size,
            )
        return local

    def _save_and_buffers(self, q, k, v, layer, b: ForwardBatch, save_kv_cache: bool, sinks):
        if sinks is not None and (sinks.device != q.device):
            raise InvalidArgumentError("sinks", f"a tensor on {q.device}", sinks.device)
        pool = self.save_kv(k, v, layer, b) if save_kv_cache else self.kv_pool(b)
        return pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)


def _default_decode(ctx: BackendContext) -> DecodeConfig:
    return decode_config(ctx.head_dim, ctx.v_head_dim, ctx.dtype, ctx.device, ctx.is_mla, ctx.kv_dtype)


def _default_extend(ctx: BackendContext) -> ExtendConfig:
    return extend_config(ctx.head_dim, ctx.v_head_dim, ctx.dtype, ctx.device, ctx.is_mla)


def _default_mla(ctx: BackendContext) -> MLAConfig:
    return mla_config(ctx.dtype, ctx.device)


def _default_ragged(ctx: BackendContext) -> RaggedConfig:
    return ragged_config(ctx.head_dim, ctx.dtype, ctx.device)


def _causal_and_spans(layer: AttentionLayer, b: ForwardBatch) -> tuple[bool, Optional[torch.Tensor]]:
    """(causal, spans) of a self-attention extend launch: encoder-only layers are not causal; bidirectional
    layers of a batch with spans pass its `[bs, 2]` spans to the kernel (`attn_core.bidirectional`)."""
    if layer.is_cross_attention:
        return False, None
    if layer.attn_type == "encoder_only":
        return False, None
    if layer.attn_type == "decoder_bidirectional" and b.bidirectional_spans is not None:
        return True, b.bidirectional_spans.contiguous()
    return True, None


def _mla_kernel_takes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the MLA kernel serves a KV pool of `kv_dtype`: the q dtype itself (float8 / uint8 pools
    keep the general kernels, which convert K/V tile by tile)."""
    return kv_dtype == q_dtype


def _default_verify(ctx: BackendContext) -> VerifyConfig:
    return verify_config(ctx.head_dim, ctx.v_head_dim, ctx.dtype, ctx.device)


def _check_device(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError("triton", "needs a CUDA or ROCm GPU (torch sees none)")
        return
    if device.type == "cpu":
        if not triton_interpreter_enabled():
            raise BackendUnavailableError(
                "triton", "CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
            )
        return
    raise InvalidArgumentError("ctx.device", "a cuda device (or cpu under TRITON_INTERPRET=1)", device)


def _check_context(ctx: BackendContext) -> None:
    """What the declared capabilities cannot say (checked by the base class, with the pool layout): the
    MLA parts, v_head_dim, the GPU an fp8 KV cache needs."""
    _check_fp8_device(ctx)
    if ctx.is_mla:
        if ctx.kv_lora_rank > MAX_MLA_RANK or ctx.qk_rope_head_dim > MAX_MLA_ROPE:
            raise UnsupportedFeatureError(
                "triton", f"MLA kv_lora_rank {ctx.kv_lora_rank} + rope {ctx.qk_rope_head_dim} (max {MAX_MLA_RANK} + {MAX_MLA_ROPE})"
            )
    elif ctx.head_dim > MAX_MHA_HEAD_DIM or ctx.v_head_dim > MAX_MHA_HEAD_DIM or ctx.head_dim % 8 or ctx.v_head_dim % 8:
        raise UnsupportedFeatureError("triton", f"head_dim {ctx.head_dim} / v_head_dim {ctx.v_head_dim} (multiples of 8 up to 256)")


def _check_fp8_device(ctx: BackendContext) -> None:
    """An fp8 (float8_e4m3fn) cache is read through Triton's fp8e4nv type, which NVIDIA GPUs of compute
    capability >= 8.9 convert; refuse it elsewhere on the GPU (the CPU interpreter converts it)."""
    if not is_fp8(ctx.kv_dtype) or ctx.device.type != "cuda":
        return
    if torch.version.hip:
        raise UnsupportedFeatureError("triton", f"kv_dtype {ctx.kv_dtype} on ROCm (Triton's fp8e4nv; ROCm GPUs of this build use e4m3fnuz)")
    cc = torch.cuda.get_device_capability(ctx.device)
    if cc < (8, 9):
        raise UnsupportedFeatureError("triton", f"kv_dtype {ctx.kv_dtype} on compute capability {cc[0]}.{cc[1]} (fp8e4nv needs >= 8.9)")


def _custom_mask(b: ForwardBatch) -> Optional[torch.Tensor]:
    """The verify mask as uint8 (its dtype and size checked by the batch validation), or None."""
    spec = b.spec_info
    if not b.forward_mode.is_target_verify() or spec is None or spec.custom_mask is None:
        return None
    return spec.custom_mask.view(torch.uint8)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _sinks(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if sinks is None else sinks.to(torch.float32).contiguous()

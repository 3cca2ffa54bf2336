"""`TritonAttnBackend`: paged-KV attention with the kernels of `attn_triton.kernels`.

Plan once per step, run thin per layer: `build_forward_metadata` (`planner.StepPlanner`) builds the
step's CSR key indices (and decode split counts) on the device with one Triton launch per key set and
decides every layer path of the step (`plans.StepPlan`); a layer call picks its path (`path_for`: a few
attribute tests), writes the new K/V and runs the path's launches (`launchers.py`).

DECODE runs the split-KV decode kernel, MHA/GQA TARGET_VERIFY and DRAFT_EXTEND steps whose requests all
carry the same 1..16 tokens the verify kernel (tokens folded with the q heads of each KV head), and every
other mode the extend kernel, except absorbed MLA, whose DECODE and same-length (2..16 tokens)
TARGET_VERIFY / DRAFT_EXTEND steps run the MLA kernel (`kernels/mla_decode.py`); MIXED steps split
(`mixed.py`). CUDA graphs (DECODE, TARGET_VERIFY) read persistent buffers that replay refreshes
(`graph.py`); their plans are built once, at capture. With `ctx.deterministic` the decode split layout
depends only on each request's own length (batch-invariant outputs; the verify kernel has no splits).
With `ctx.attention_chunk_size` C the step's metadata also holds the keys of chunked local layers: in
DECODE each request's keys from its chunk start, in the other modes the step split into virtual requests
(`attn_core.batching.local_attention`), served by the same kernels; CUDA graphs and TARGET_VERIFY custom masks are
refused together with chunked local attention. With a
`SlidingWindowKVPool` the window layers read a second key index: each request's keys from the oldest one
inside the pool's window, translated to window slots (CUDA graphs and custom masks refused there too).
A cascade step (`attn_core.batching.cascade`) adds the shared prefix's keys and each request's keys after it:
plain causal layers run the suffix pass (the usual kernel), then the prefix pass (one extend launch,
all queries over the prefix, non-causal), merged by LSE.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.discovery.probes import triton_interpreter_enabled
from attn_core.engine.graph_captures import captures_of
from attn_core.memory.fp8 import is_fp8
from attn_core.memory.window_pool import window_pool_of
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_triton.config import (
    SplitPolicy,
    decode_config,
    extend_config,
    hopper_kernels_available,
    mla_config,
    verify_config,
)
from attn_triton.graph import GraphState
from attn_triton.kernels.decode import DecodeConfig, head_blocks
from attn_triton.kernels.extend import ExtendConfig
from attn_triton.kernels.mla_decode import MLAConfig, programs_per_request
from attn_triton.kernels.ragged import RaggedConfig, attend_ragged, ragged_config, ragged_tiles
from attn_triton.kernels.verify import VerifyConfig
from attn_triton.launchers import Launch
from attn_triton.mixed import plan_mixed
from attn_triton.planner import StepPlanner
from attn_triton.plans import StepPlan
from attn_triton.spec import CAPABILITIES

MAX_MHA_HEAD_DIM = 256
MAX_MLA_RANK = 512
MAX_MLA_ROPE = 64


class TritonAttnBackend(AttentionBackend[StepPlan]):
    """Triton attention over the paged pools of attn-core (MHA/GQA/MQA and absorbed MLA).

    Options (tests and tuning): `split_policy` (decode splits), `decode_config` / `extend_config` /
    `mla_config` / `verify_config` (tile sizes; defaults from `attn_triton.config`), `mixed_split` (MIXED
    steps: decodes through the decode kernel, the rest through the extend kernel, `attn_triton.mixed`;
    default True: 1.24-3.7x faster on an H100, docs/dev/perf-notebook.md "MIXED steps"; False keeps one
    extend launch).

    Absorbed MLA with a KV pool of the q dtype runs DECODE, and TARGET_VERIFY / DRAFT_EXTEND steps whose
    requests all have the same 2..16 new tokens, on the MLA kernel (`kernels/mla_decode.py`); other
    MLA steps (and float8 / uint8 KV pools) run the general decode / extend kernels.
    """

    name = "triton"
    capabilities = CAPABILITIES
    step_check_in_index_launch = True  # the planner's main index launch runs it (`take_step_check`)

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
        if not isinstance(mixed_split, bool):
            raise InvalidArgumentError("mixed_split", "a bool", mixed_split)
        self.mixed_split = mixed_split
        decode_cfg = decode_config or _default_decode(ctx)
        extend_cfg = extend_config or _default_extend(ctx)
        if extend_cfg.wgmma_block_n and not hopper_kernels_available(ctx.device):
            raise InvalidArgumentError(
                "extend_config.wgmma_block_n",
                f"0 on {ctx.device}: the Hopper extend kernel needs a CUDA GPU of compute capability 9.x "
                "and Triton >= 3.6",
                extend_cfg.wgmma_block_n,
            )
        mla_cfg = mla_config or _default_mla(ctx)
        self.ragged_cfg = ragged_config or _default_ragged(ctx)
        mla_kernel = ctx.is_mla and _mla_kernel_takes(ctx.dtype, ctx.kv_dtype or ctx.dtype)
        ctas_per_sm = 0  # the split policy's programs per SM: the MLA kernel's tiles say (MLAConfig.ctas_per_sm)
        if mla_kernel:
            programs = programs_per_request(ctx.num_q_heads, mla_cfg)
            ctas_per_sm = mla_cfg.ctas_per_sm
        else:
            programs = head_blocks(ctx.num_q_heads // ctx.num_kv_heads, decode_cfg)
        num_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.device.type == "cuda" else 4
        self.device_faults = DeviceFaultFlags(ctx.device)
        launch = Launch(
            decode=decode_cfg,
            extend=extend_cfg,
            mla=mla_cfg,
            verify=verify_config or _default_verify(ctx),
            d_rope=ctx.qk_rope_head_dim if ctx.is_mla else 0,
            share_kv=ctx.is_mla,
            kv_lora_rank=ctx.kv_lora_rank if ctx.is_mla else 0,
            fault=self.device_faults.buffer,
            pool=ctx.token_to_kv_pool,
        )
        policy = split_policy or SplitPolicy()
        self.planner = StepPlanner(ctx, launch, policy, programs, num_sms, ctas_per_sm, mla_kernel)
        self.graph: Optional[GraphState] = None

    # ---- metadata: the step's plan ---------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> StepPlan:
        b = forward_batch
        r2t, pool = self.req_to_token(b), self.kv_pool(b)
        if b.forward_mode.is_mixed() and self.mixed_split and b.bidirectional_spans is None:
            plan = plan_mixed(self.planner, b, r2t, window_pool_of(pool) is not None)
            if plan is not None:
                return plan
        return self.planner.plan(b, r2t, pool, self.take_step_check())

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph = GraphState(self.planner, self.req_to_token, max_bs, max_num_tokens)

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        if self.ctx.attention_chunk_size is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with chunked local attention (attention_chunk_size)")
        if window_pool_of(self.ctx.token_to_kv_pool) is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with a sliding-window KV pool")
        self.bind_graph_metadata(captures_of(self.graph, self.name).capture(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(captures_of(self.graph, self.name).replay(step), step)

    def poll_device_fault(self) -> Optional[str]:
        """What the kernels refused since the last poll (an out-of-range request row, slot, length,
        offset...: see `attn_core.ops.device_faults`), or None; reads and clears the fault buffer (one
        device sync). The index kernel runs in `init_forward_metadata`, the attention kernels in the
        layers: a fault of the attention kernels shows at the poll after the step's forward."""
        return self.device_faults.poll()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def support_triton(self) -> bool:
        return True

    def needs_page_aligned_draft_kv(self) -> bool:
        """Keys are gathered slot by slot through CSR kv_indices (no page arithmetic), so the draft
        wrapper's branch rows may point at the request's own last page: no K/V copies needed."""
        return False

    # ---- attention: the layer's path, the new K/V, the launches -----------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, return_lse=False):
        path = self._plan(True).path_for(layer, sinks)
        k_buf, v_buf = self._save_and_buffers(q, k, v, layer, forward_batch, save_kv_cache, sinks)
        return path.run(q, k_buf, v_buf, layer, sinks, return_lse)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, return_lse=False):
        path = self._plan(False).path_for(layer, sinks)
        k_buf, v_buf = self._save_and_buffers(q, k, v, layer, forward_batch, save_kv_cache, sinks)
        return path.run(q, k_buf, v_buf, layer, sinks, return_lse)

    # ---- the ragged op (attn_core.contract.ragged) ---------------------------------------------------------
    def build_ragged_metadata(self, ragged) -> torch.Tensor:
        """The varlen kernel's work list for the batch (`kernels/ragged.ragged_tiles`), once per batch."""
        return ragged_tiles(ragged.seq_lens_cpu.tolist(), self.ragged_cfg.block_m, ragged.causal, self.device)

    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        """The ragged op on the varlen kernel (`kernels/ragged.py`)."""
        fault, cfg, tiles = self.device_faults.buffer, self.ragged_cfg, self.ragged_metadata
        return attend_ragged(q, k, v, ragged, fault, sm_scale=scaling, config=cfg, tiles=tiles, return_lse=return_lse)

    def describe_path(self, layer, forward_batch) -> Optional[str]:
        """The kernels `layer` runs in this step (`plans.StepPlan.describe`; a cascade step's layer called
        with sinks runs unsplit, which this, not knowing the call's sinks, does not say)."""
        plan = self.forward_metadata
        return None if plan is None else plan.describe(layer)

    def _plan(self, decode: bool) -> StepPlan:
        plan = self.forward_metadata
        if plan is None or plan.decode is not decode:
            want = "DECODE" if decode else "an extend-like mode"
            expected = f"metadata built for {want} (call init_forward_metadata on this batch)"
            raise InvalidArgumentError("forward_metadata", expected, type(plan).__name__)
        return plan

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
                "triton",
                f"MLA kv_lora_rank {ctx.kv_lora_rank} + rope {ctx.qk_rope_head_dim} "
                f"(max {MAX_MLA_RANK} + {MAX_MLA_ROPE})",
            )
    elif ctx.head_dim > MAX_MHA_HEAD_DIM or ctx.v_head_dim > MAX_MHA_HEAD_DIM or ctx.head_dim % 8 or ctx.v_head_dim % 8:
        raise UnsupportedFeatureError(
            "triton", f"head_dim {ctx.head_dim} / v_head_dim {ctx.v_head_dim} (multiples of 8 up to 256)"
        )


def _check_fp8_device(ctx: BackendContext) -> None:
    """An fp8 (float8_e4m3fn) cache is read through Triton's fp8e4nv type, which NVIDIA GPUs of compute
    capability >= 8.9 convert; refuse it elsewhere on the GPU (the CPU interpreter converts it)."""
    if not is_fp8(ctx.kv_dtype) or ctx.device.type != "cuda":
        return
    if torch.version.hip:
        raise UnsupportedFeatureError(
            "triton", f"kv_dtype {ctx.kv_dtype} on ROCm (Triton's fp8e4nv; ROCm GPUs of this build use e4m3fnuz)"
        )
    cc = torch.cuda.get_device_capability(ctx.device)
    if cc < (8, 9):
        raise UnsupportedFeatureError(
            "triton", f"kv_dtype {ctx.kv_dtype} on compute capability {cc[0]}.{cc[1]} (fp8e4nv needs >= 8.9)"
        )

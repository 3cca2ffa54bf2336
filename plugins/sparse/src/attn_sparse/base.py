"""`PlannedBackend`: what attn-sparse's two backends share around their own per-step logic: the device check,
the split policy, the device fault flags, the step plan (`attn_sparse.plan`, eager or in CUDA-graph
buffers) and the output's layout.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.discovery.probes import triton_interpreter_enabled
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_sparse.config import SplitPolicy
from attn_sparse.plan import GraphPlans, PlanShape, StepPlan, plan_step

MetadataT = TypeVar("MetadataT")


def default_split_policy(device: torch.device) -> SplitPolicy:
    """On a GPU: splits until a step has two programs per SM; under the interpreter: few and small (its
    programs run one after another)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return SplitPolicy(min_split_keys=512, max_splits=16, target_programs=2 * sms)
    return SplitPolicy(min_split_keys=64, max_splits=4, target_programs=4)


def check_device(name: str, device: torch.device) -> None:
    """Raise unless the kernels can run on `device`: a CUDA GPU torch sees, or CPU tensors under the
    Triton interpreter."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(name, "needs a CUDA GPU (torch sees none)")
        return
    if device.type == "cpu":
        if not triton_interpreter_enabled():
            raise BackendUnavailableError(
                name, "CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
            )
        return
    raise InvalidArgumentError("ctx.device", "a cuda device (or cpu under TRITON_INTERPRET=1)", device)


class PlannedBackend(AttentionBackend[MetadataT]):
    """Base of `DoubleSparsityBackend` and `DualChunkBackend`. Option `split_policy` (`SplitPolicy`): how
    keys are split across programs (default `default_split_policy`)."""

    def __init__(self, ctx: BackendContext, *, split_policy: Optional[SplitPolicy] = None, **options):
        super().__init__(ctx, **options)
        check_device(self.name, ctx.device)
        if split_policy is not None and not isinstance(split_policy, SplitPolicy):
            raise InvalidArgumentError("split_policy", "an attn_sparse.config.SplitPolicy", type(split_policy).__name__)
        self.split_policy = split_policy or default_split_policy(ctx.device)
        self.faults = DeviceFaultFlags(ctx.device)
        self.graph_plans: Optional[GraphPlans] = None

    # ---- plans -----------------------------------------------------------------------------------
    def plan_shape(self, num_slots: int) -> PlanShape:
        ctx = self.ctx
        return PlanShape(
            num_kv_heads=ctx.num_kv_heads,
            group=ctx.num_q_heads // ctx.num_kv_heads,
            num_slots=num_slots,
            policy=self.split_policy,
            on_gpu=ctx.device.type == "cuda",
            fault=self.faults.buffer,
        )

    def step_plan(self, batch: ForwardBatch) -> StepPlan:
        """The eager plan of `batch` (no device sync)."""
        return plan_step(batch, self.req_to_token(batch), self.plan_shape(self.kv_pool(batch).num_slots))

    def poll_device_fault(self) -> Optional[str]:
        return self.faults.poll()

    def support_triton(self) -> bool:
        return True

    # ---- CUDA graphs (DECODE) --------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Buffers for DECODE graphs of up to `max_bs` requests of up to the context's max_context_len keys."""
        pool = self.ctx.token_to_kv_pool
        if pool is None:
            raise InvalidArgumentError(
                "ctx.token_to_kv_pool", "the KV pool the graphs will read (CUDA graphs need it)", None
            )
        if max_bs < 1:
            raise InvalidArgumentError("max_bs", ">= 1", max_bs)
        self.graph_plans = GraphPlans(
            max_bs, self.ctx.max_context_len, self.plan_shape(pool.num_slots), self.ctx.device
        )

    def graph_plan(self, step: CudaGraphStep) -> StepPlan:
        """The plan of graph size `step.bs`, refreshed in place for `step` (capture and replay)."""
        if not step.forward_mode.is_decode():
            raise UnsupportedFeatureError(self.name, f"CUDA graphs for {step.forward_mode.name} (DECODE only)")
        if self.graph_plans is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before capture/replay", None)
        if step.bs > self.graph_plans.max_bs:
            raise InvalidArgumentError(
                "bs", f"at most the max_bs {self.graph_plans.max_bs} of init_cuda_graph_state", step.bs
            )
        return self.graph_plans.capture(step, self.req_to_token())

    # ---- output ----------------------------------------------------------------------------------
    @staticmethod
    def finish(out: torch.Tensor, lse: Optional[torch.Tensor], return_lse: bool):
        """`[T, Hq * Dv]`, with the LSE `[T, Hq]` when asked for."""
        o = out.reshape(out.shape[0], -1)
        return (o, lse) if return_lse else o


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dimension has unit stride (what the kernels read), else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()

"""`CudaGraphRunner`: capture attention "layers" once per batch size, then run real batches by padding
them to the next captured size and replaying.

What an engine's graph runner does, cut down to attention: static input buffers (request rows,
seq_lens, out_cache_loc, positions, the verify mask, and the per-token tensors the layers read),
one graph per (mode, batch size), padding rows that read and write only the reserved dummy
(req_pool_indices 0, out_cache_loc slot 0, seq_len = the backend's fill value + new tokens - 1), and the
backend's `replay_cuda_graph_metadata` before every replay. On a CPU (or with
`use_cuda_graph=False`) the same capture / replay metadata calls run and the layers run eagerly on
the static buffers instead of a graph replay, so the logic is testable anywhere. Padding follows
`attn_core.contract.graph_step.graph_padding`.

Every `run` validates the batch as `init_forward_metadata` does (a graph replay is an entry point like
any other): on the CPU every check at once (typed errors, nothing written); on a GPU the host checks.
Then, in every mode, the step check (`attn_core.ops.step_checks`) reads the static buffers as the first
work of the captured graph: the engine's `out_cache_loc`, copied into a raw slot buffer, becomes the static
`out_cache_loc` the captured layers write through, every refused token's slot the dummy 0; the host's
`seq_lens_sum` reaches it through a one-element device buffer that `run` fills (`fill_`: the value travels
as the kernel's argument, so a later step cannot overwrite it before the graph reads it). So a replay
launches no check of its own (a Triton launch costs ~35-45 µs of host time), only two small copies; the
fault word's host copy is the graph's last captured work (a device-to-host copy into pinned memory, so no
host call per replay), and its faults surface at the next replay or step as `DeviceFaultError` (no sync). A
replay whose shape differs from the capture (batch size bucket, tokens per request, draft count, inputs) is
refused with `GraphShapeError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from attn_core.batching.positions import positions_from_lens
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch, SpecInfo, batch_field
from attn_core.contract.errors import GraphShapeError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep, GraphPadding, graph_padding, graph_tokens_per_request
from attn_core.contract.validation import check_forward_batch, effective_level
from attn_core.ops.step_checks import StepTensors, check_step

if TYPE_CHECKING:
    from attn_core.memory.kv_pool import KVPool
    from attn_core.memory.pools import ReqToTokenPool

InputShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]

LayerOutput = Union[torch.Tensor, tuple[torch.Tensor, ...]]
#: run_layers(forward_batch, inputs) -> per-token output(s) `[num_tokens, ...]`; inputs maps each name of
#: `input_shapes` to a `[num_tokens, *shape]` tensor.
RunLayers = Callable[[ForwardBatch, dict[str, torch.Tensor]], LayerOutput]


class CudaGraphRunner:
    """Graphs of `run_layers` over `backend` for each size in `batch_sizes`.

    Captures DECODE, and TARGET_VERIFY too when the backend's graph level covers it and
    `num_draft_tokens` (default: the context's speculative_num_draft_tokens) is > 0.

    `input_shapes` names the per-token inputs of `run_layers`: a dict name (str) -> (shape after the
    token dimension: a tuple of ints >= 1, dtype: a `torch.dtype`); e.g. `{"x": ((4096,), torch.bfloat16)}`
    makes a static `[max_tokens, 4096]` bfloat16 buffer that `run` fills from `inputs["x"]` (`[tokens,
    4096]`, bfloat16, on the context's device). Anything else is refused at construction
    (`InvalidArgumentError` naming `input_shapes[...]`), and an input of another shape, dtype or device at
    `run` with `GraphShapeError` naming `inputs[...]`.
    Outputs of `run` are views into static buffers, valid until the next `run`.
    """

    def __init__(
        self,
        backend: AttentionBackend,
        batch_sizes: Sequence[int],
        run_layers: RunLayers,
        input_shapes: InputShapes,
        *,
        num_draft_tokens: Optional[int] = None,
        use_cuda_graph: Optional[bool] = None,
    ):
        sizes = _batch_sizes(batch_sizes)
        input_shapes = check_input_shapes(input_shapes)
        level = backend.capabilities.cuda_graph
        if not level.covers(ForwardMode.DECODE):
            raise UnsupportedFeatureError(backend.name, "CUDA graphs")
        ctx = backend.ctx
        nd = ctx.speculative_num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        self.modes = [ForwardMode.DECODE] + (
            [ForwardMode.TARGET_VERIFY] if nd > 0 and level.covers(ForwardMode.TARGET_VERIFY) else []
        )
        self.backend = backend
        self.ctx = ctx
        self.batch_sizes = sizes
        self.run_layers = run_layers
        self.num_draft_tokens = nd
        device = torch.device(ctx.device)
        self.use_cuda_graph = device.type == "cuda" if use_cuda_graph is None else use_cuda_graph
        if self.use_cuda_graph and device.type != "cuda":
            raise InvalidArgumentError("use_cuda_graph", "False on a device without CUDA graphs", ctx.device)
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        max_bs = sizes[-1]
        self.max_tokens = max_bs * max(nd, 1)
        dev = ctx.device
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), self.fill, dtype=torch.int32, device=dev)
        self.out_cache_loc = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        # filled only with checked slots (the captured step check's allowed slots; padding rows the dummy 0):
        # the captured layers' writes need no guard of their own
        backend.trust_graph_slots(self.out_cache_loc)
        # what the captured step check reads besides the request rows and lengths: the engine's slots as given
        # and the host's seq_lens total (padding rows included)
        self.raw_out_cache_loc = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        self.seq_total = torch.zeros(1, dtype=torch.int64, device=dev)
        self.verify_q_lens = torch.full((max_bs,), max(nd, 1), dtype=torch.int32, device=dev)
        self.verify_start_loc = torch.arange(0, max_bs * max(nd, 1), max(nd, 1), dtype=torch.int32, device=dev)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        self.inputs = {
            name: torch.zeros((self.max_tokens, *shape), dtype=dtype, device=dev)
            for name, (shape, dtype) in input_shapes.items()
        }
        self.spec_info: Optional[SpecInfo] = None
        if ForwardMode.TARGET_VERIFY in self.modes:
            self.spec_info = SpecInfo(
                num_draft_tokens=nd,
                custom_mask=torch.ones(max_bs * nd * ctx.max_context_len, dtype=torch.bool, device=dev),
                mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
            )
        self._graphs: dict[tuple[ForwardMode, int], tuple[Optional[torch.cuda.CUDAGraph], Optional[LayerOutput]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        self._capture_all()

    # ---- static batch ------------------------------------------------------------------------------
    def _tokens_per_request(self, mode: ForwardMode) -> int:
        per = graph_tokens_per_request(mode, self.num_draft_tokens)
        if per is None:  # only DECODE and TARGET_VERIFY with draft tokens are captured
            raise UnsupportedFeatureError(self.backend.name, f"CUDA graphs of {mode.name} without a fixed token count")
        return per

    def _mask_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The static verify mask and its offsets (`spec_info`'s), present when TARGET_VERIFY is captured."""
        spec = self.spec_info
        if spec is None or spec.custom_mask is None or spec.mask_indptr is None:
            raise UnsupportedFeatureError(self.backend.name, "TARGET_VERIFY graphs (none captured)")
        return spec.custom_mask, spec.mask_indptr

    def _padding(self, mode: ForwardMode, bs: int, sizes: Sequence[int]) -> GraphPadding:
        return graph_padding(mode, bs, sizes, self.fill, self.num_draft_tokens)

    def _write_padding(self, mode: ForwardMode, pad: GraphPadding, mask_start: int) -> None:
        """Rows pad.bs..pad.padded_bs-1 become padding: request row 0, `pad.seq_len` keys, dummy slot 0;
        verify rows get an all-visible mask of their keys after `mask_start`."""
        start, bs, per = pad.bs, pad.padded_bs, pad.tokens_per_request
        if start == bs:  # a batch of a captured size: no padding rows
            return
        self.req_pool_indices[start:bs] = 0
        self.seq_lens[start:bs] = pad.seq_len
        self.raw_out_cache_loc[start * per : bs * per] = 0
        self.positions[start * per : bs * per] = 0
        for buf in self.inputs.values():
            buf[start * per : bs * per] = 0
        if mode.is_target_verify():
            mask, indptr = self._mask_buffers()
            size = per * pad.seq_len
            end = mask_start + (bs - start) * size
            if end > mask.numel():
                raise InvalidArgumentError("spec_info.custom_mask", f"at most {mask.numel()} mask entries", end)
            mask[mask_start:end] = True
            indptr[start + 1 : bs + 1] = mask_start + size * torch.arange(1, bs - start + 1, device=self.ctx.device)

    def _graph_step(self, mode: ForwardMode, bs: int, seq_lens_cpu: Optional[torch.Tensor]) -> CudaGraphStep:
        """The static buffers' first `bs` rows as a graph step (no host lengths at capture)."""
        return CudaGraphStep(
            forward_mode=mode,
            bs=bs,
            num_tokens=bs * self._tokens_per_request(mode),
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            spec_info=self.spec_info if mode.is_target_verify() else None,
        )

    def _static_batch(self, mode: ForwardMode, bs: int, seq_lens_cpu: torch.Tensor) -> ForwardBatch:
        per = self._tokens_per_request(mode)
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            out_cache_loc=self.out_cache_loc[: bs * per],
            positions=self.positions[: bs * per],
            req_to_token_pool=self.ctx.req_to_token_pool,
            token_to_kv_pool=self.ctx.token_to_kv_pool,
            attn_backend=self.backend,
        )
        if mode.is_target_verify():
            ext_cpu = torch.full((bs,), per, dtype=torch.int32)
            batch.extend_seq_lens_cpu = ext_cpu
            batch.extend_seq_lens = ext_cpu.to(self.ctx.device)
            batch.extend_prefix_lens_cpu = (seq_lens_cpu - per).clamp(min=0)
            batch.extend_prefix_lens = (self.seq_lens[:bs] - per).clamp(min=0)
            batch.extend_start_loc = torch.arange(0, bs * per, per, dtype=torch.int32, device=self.ctx.device)
            batch.extend_num_tokens = bs * per
            batch.spec_info = self.spec_info
        return batch

    def _views(self, tokens: int) -> dict[str, torch.Tensor]:
        return {name: buf[:tokens] for name, buf in self.inputs.items()}

    def _pools(self) -> tuple[ReqToTokenPool, KVPool]:
        """The context's request table and KV pool, which graphs read (`InvalidArgumentError` without them)."""
        r2t_pool, kv_pool = self.ctx.req_to_token_pool, self.ctx.token_to_kv_pool
        if r2t_pool is None or kv_pool is None:
            raise InvalidArgumentError(
                "backend.ctx", "a context with req_to_token_pool and token_to_kv_pool (graphs read them)", None
            )
        return r2t_pool, kv_pool

    def _checked_layers(self, batch: ForwardBatch, views: dict[str, torch.Tensor]) -> LayerOutput:
        """What a graph holds (and what runs without one): the step check of the static buffers' first
        batch.batch_size rows, padding rows included (`attn_core.ops.step_checks`: the allowed slots of
        `raw_out_cache_loc` into `out_cache_loc`, faults into the backend's fault word), then `run_layers`."""
        mode, bs = batch.forward_mode, batch.batch_size
        per = self._tokens_per_request(mode)
        r2t_pool, pool = self._pools()
        verify = mode.is_target_verify()
        mask_indptr = self._mask_buffers()[1][: bs + 1] if verify else None
        check = StepTensors(
            req_to_token=r2t_pool.req_to_token,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            num_tokens=bs * per,
            num_slots=pool.num_slots,
            q_lens=self.verify_q_lens[:bs] if verify else None,
            start_loc=self.verify_start_loc[:bs] if verify else None,
            mask_indptr=mask_indptr,
            out_cache_loc=self.raw_out_cache_loc[: bs * per],
            seq_total=self.seq_total,
            decode=not verify,
            pad_seq_len=self._padding(mode, 0, [bs]).seq_len,
        )
        check_step(check, self.out_cache_loc[: bs * per], self.backend.device_faults.buffer)
        return self.run_layers(batch, views)

    # ---- capture -------------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        self.backend.init_cuda_graph_state(self.batch_sizes[-1], self.max_tokens)
        for mode in self.modes:
            for bs in self.batch_sizes:
                self._capture(mode, bs)

    def _capture(self, mode: ForwardMode, bs: int) -> None:
        pad = self._padding(mode, 0, [bs])
        self._write_padding(mode, pad, 0)
        seq_cpu = torch.full((bs,), pad.seq_len, dtype=torch.int32)
        tokens = pad.num_tokens
        self.backend.capture_graph_step(self._graph_step(mode, bs, None))
        if not self.use_cuda_graph:
            self._graphs[(mode, bs)] = (None, None)
            return
        batch, views = self._static_batch(mode, bs, seq_cpu), self._views(tokens)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        self.seq_total.fill_(int(seq_cpu.sum()))
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy allocations, autotuning)
            self._checked_layers(batch, views)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._checked_layers(batch, views)
            # the fault word's host copy (pinned: a captured device-to-host copy), after the step check and
            # the layers: each replay refreshes it with no host call of its own (`run` marks it taken)
            self.backend.device_faults.copy_to_host()
        self._graphs[(mode, bs)] = (graph, out)

    # ---- replay --------------------------------------------------------------------------------------
    def captured_size(self, mode: ForwardMode, bs: int) -> Optional[int]:
        """The smallest captured batch size >= bs for `mode`, or None."""
        if mode not in self.modes or not 1 <= bs <= self.batch_sizes[-1]:
            return None
        return self._padding(mode, bs, self.batch_sizes).padded_bs

    def _check_inputs(self, inputs: dict[str, torch.Tensor], tokens: int) -> None:
        if not isinstance(inputs, dict) or set(inputs) != set(self.inputs):
            found = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise GraphShapeError("inputs", f"tensors named {sorted(self.inputs)} (the captured inputs)", found)
        for name, buf in self.inputs.items():
            x = inputs[name]
            want = (tokens, *buf.shape[1:])
            tensor = isinstance(x, torch.Tensor)
            if not tensor or tuple(x.shape) != want or x.dtype != buf.dtype or x.device != buf.device:
                got = (tuple(x.shape), x.dtype, x.device) if tensor else type(x).__name__
                expected = f"a {buf.dtype} tensor of shape {want} on {buf.device}"
                raise GraphShapeError(f"inputs[{name!r}]", expected, got)

    def run(self, forward_batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> LayerOutput:
        """Run `forward_batch` (DECODE or TARGET_VERIFY, its pools the context's) through the graph of
        the next captured size; returns the real rows of the layers' output(s). Validates the batch
        first (see the module docstring): typed errors, nothing written."""
        b = forward_batch
        mode, bs = b.forward_mode, b.batch_size
        if self.captured_size(mode, bs) is None:
            raise GraphShapeError(
                "forward_batch",
                f"a batch of 1..{self.batch_sizes[-1]} requests in a captured mode {self.modes}",
                (mode.name, bs),
            )
        pad = self._padding(mode, bs, self.batch_sizes)
        gbs, per = pad.padded_bs, pad.tokens_per_request
        for pool in ("req_to_token_pool", "token_to_kv_pool"):
            if getattr(b, pool) is not None and getattr(b, pool) is not getattr(self.ctx, pool):
                raise InvalidArgumentError(
                    f"forward_batch.{pool}", "the backend context's pool (graphs read it)", "another pool"
                )
        tokens = bs * per
        self._check_inputs(inputs, tokens)
        if mode.is_target_verify():
            spec = b.spec_info
            drafts = None if spec is None else spec.num_draft_tokens
            if spec is None or spec.custom_mask is None or drafts != per or b.extend_num_tokens != tokens:
                found = None if spec is None else (drafts, b.extend_num_tokens)
                expected = f"a custom mask and {per} draft tokens per request, as captured"
                raise GraphShapeError("forward_batch.spec_info", expected, found)
        if b.request_guard is not None:
            b.request_guard.check()
        level = effective_level(self.ctx)
        r2t_pool, kv_pool = self._pools()
        r2t = r2t_pool.req_to_token
        check_forward_batch(b, r2t, kv_pool, self.ctx, level=level, padding_seq_len=pad.seq_len)
        self.req_pool_indices[:bs] = b.req_pool_indices
        self.seq_lens[:bs] = b.seq_lens
        # read by the captured step check, which writes the allowed slots into the buffer the layers read
        self.raw_out_cache_loc[:tokens] = b.out_cache_loc
        self.seq_total.fill_(b.seq_lens_sum + (gbs - bs) * pad.seq_len)
        if b.positions is None:  # the engine's RoPE positions are optional: derive them from the lengths
            self.positions[:tokens] = positions_from_lens(b.seq_lens - per, torch.full_like(b.seq_lens, per), tokens)
        else:
            self.positions[:tokens] = b.positions
        for name, buf in self.inputs.items():
            buf[:tokens] = inputs[name]
        mask_end = 0
        if mode.is_target_verify():
            mask, indptr = self._mask_buffers()
            given = batch_field(b.spec_info, "spec_info")
            given_mask = batch_field(given.custom_mask, "spec_info.custom_mask")
            mask_end = per * b.seq_lens_sum
            if given_mask.numel() != mask_end or mask_end > mask.numel():
                raise InvalidArgumentError(
                    "spec_info.custom_mask", f"{mask_end} entries (<= {mask.numel()})", given_mask.numel()
                )
            mask[:mask_end] = given_mask
            indptr[: bs + 1] = batch_field(given.mask_indptr, "spec_info.mask_indptr")
        self._write_padding(mode, pad, mask_end)
        seq_cpu = b.seq_lens_cpu  # padded with the padding rows' length when there are any
        if gbs > bs:
            seq_cpu = torch.cat([seq_cpu, torch.full((gbs - bs,), pad.seq_len, dtype=seq_cpu.dtype)])
        # the fault word's host copy is queued after the layers (below), not after the metadata
        self.backend.replay_graph_step(self._graph_step(mode, gbs, seq_cpu), snapshot_faults=False)
        graph, out = self._graphs[(mode, gbs)]
        faults = self.backend.device_faults
        if graph is None:
            out = self._checked_layers(self._static_batch(mode, gbs, seq_cpu), self._views(gbs * per))
            faults.snapshot(self.backend.step_count)
        else:
            graph.replay()  # its last work: the fault word's host copy (captured, `_capture`)
            assert out is not None, "a captured graph keeps the output it was captured with"
            faults.mark_snapshot(self.backend.step_count)  # read by the next replay or step
        if isinstance(out, tuple):
            return tuple(o[:tokens] for o in out)
        return out[:tokens]


def _batch_sizes(batch_sizes) -> list[int]:
    """The captured sizes, sorted and distinct: a non-empty sequence of ints >= 1 (`InvalidArgumentError`
    naming `batch_sizes` otherwise). Example: [4, 1, 2, 2] -> [1, 2, 4]."""
    try:
        sizes = sorted({int(b) for b in batch_sizes if not isinstance(b, bool) and int(b) == b})
        ok = len(sizes) == len(set(batch_sizes)) and bool(sizes) and sizes[0] >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        expected = "a non-empty list of positive integer batch sizes"
        raise InvalidArgumentError("batch_sizes", expected, _short(batch_sizes))
    return sizes


def check_input_shapes(input_shapes: object) -> InputShapes:
    """`input_shapes` of `CudaGraphRunner` checked: a dict of str names to (shape, dtype), the shape a
    tuple (or list) of ints >= 1 (the per-token dimensions after the token dimension; () for one value a
    token), the dtype a `torch.dtype`. Returns it with shapes as tuples; raises `InvalidArgumentError`
    naming `input_shapes` or `input_shapes[name]`.

    Example: `check_input_shapes({"x": ([64], torch.float32)})` is `{"x": ((64,), torch.float32)}`;
    `{"x": ((64,), "float32")}` raises ("input_shapes['x']: expected (shape, dtype) with a torch.dtype ...")."""
    if not isinstance(input_shapes, dict):
        expected = "a dict of input name -> (shape after the token dim, torch.dtype)"
        raise InvalidArgumentError("input_shapes", expected, type(input_shapes).__name__)
    out: InputShapes = {}
    for name, spec in input_shapes.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("input_shapes", "non-empty str names", _short(name))
        where = f"input_shapes[{name[:40]!r}]"
        expected = "(shape, dtype) with a shape of ints >= 1 and a torch.dtype, e.g. ((4096,), torch.bfloat16)"
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise InvalidArgumentError(where, expected, _short(spec))
        shape, dtype = spec
        if not isinstance(shape, (tuple, list)) or not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(where, expected, _short(spec))
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise InvalidArgumentError(where, expected, _short(spec))
        out[name] = (tuple(shape), dtype)
    return out


def _short(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (error messages quote user values briefly)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""The conformance kit's engine-owned-memory section: a backend over caches an engine allocated in its own
layout (`attn_core.memory.EngineKVPool`) and batches shaped as a paged engine holds them
(`attn_core.EngineBatches`), over several steps, against the float64 reference.

A layout (`ENGINE_LAYOUTS`) allocates every layer's cache in one tensor as that engine does; a plain
indexer per layout (`EngineLayout.rows`, written from the layout's definition, not through the pool)
says where slot s, head h of layer l's K and V live. A run poisons the whole allocation with NaN, then
plays `ENGINE_STEPS` (prefills, chunked prefill, MIXED and DECODE steps, a request whose first block is
another's: prefix caching) with block tables of scattered pages; per step and layer it writes the new
K/V through attn's write step (`backend.save_kv`, or `forward(save_kv_cache=True)`), runs `forward(...,
out=)` into a NaN-poisoned engine output buffer, and checks: the output against `reference_attention`
(the q dtype's tolerance), the buffer's rows past the step's tokens untouched, the allocation equal to
before plus exactly the new K/V at their slots (NaN-aware, bit for bit), and the pool's buffers still the
engine's memory (never copied or reallocated).

Hostile cases (`engine_hostile_checks`): wrong strides, overlapping strides, V aliasing K, a block table
pointing past the cache, a slot mapping outside it, a wrong `out`: each a typed error with the
allocation untouched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from attn_core.contract.context import BackendContext
from attn_core.contract.errors import AttnError, IncompatibleBackendError, InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.layer import AttentionLayer
from attn_core.engine.engine_batch import EngineBatches
from attn_core.memory.engine_pool import EngineKVPool
from attn_core.testing.outcome import KitFailure, KitSkip
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_core.testing.target import KitTarget

#: one engine schedule: per step [(request, new tokens)]; ("d", n, "a", B) makes request d start with the
#: first B blocks of request a cached (its block table begins with a's blocks: prefix caching)
ENGINE_STEPS: list[list[tuple]] = [
    [("a", 20)],  # a prefill over two blocks (page 16)
    [("a", 1), ("b", 9)],  # MIXED: a decode beside a prefill
    [("b", 1), ("c", 18), ("a", 1)],  # MIXED, c's first chunk
    [("a", 1), ("b", 1), ("c", 1)],  # DECODE
    [("c", 1), ("d", 6, "a", 1)],  # MIXED: d's prompt begins with a's first block (cached)
    [("d", 1), ("a", 1), ("c", 1)],  # DECODE
]

#: the GPU schedule (tests/test_engine_kv_gpu.py): prefills over many pages, a 16-block shared prefix,
#: chunks, decodes; its requests grow to 304 keys, past `EngineCase`'s default table width of 128
LONG_ENGINE_STEPS: list[list[tuple]] = [
    [("a", 300)],
    [("a", 1), ("b", 200)],
    [("b", 1), ("c", 257), ("a", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("c", 1), ("d", 40, "a", 16)],
    [("d", 1), ("a", 1), ("c", 1)],
]
#: the request-table width LONG_ENGINE_STEPS runs with (`EngineCase.max_context_len`)
LONG_ENGINE_CONTEXT = 512


def longest_request(steps, page_size: int) -> int:
    """The most keys any request of a schedule reaches (a shared prefix of B blocks counts B * page_size):
    the smallest `EngineCase.max_context_len` the schedule runs with. Example: `longest_request(ENGINE_STEPS,
    16)` is 24 (request a: 20 + 4 decodes; d: 16 shared + 6 + 1 = 23)."""
    lens: dict[str, int] = {}
    for step in steps:
        for item in step:
            name, n = item[0], item[1]
            if name not in lens:
                lens[name] = item[3] * page_size if len(item) == 4 else 0
            lens[name] += n
    return max(lens.values(), default=0)


@dataclass(frozen=True)
class EngineLayout:
    """How an engine lays out the KV cache of all layers: `alloc(layers, pages, heads, page, dim, dtype,
    device)` -> the one allocation; `per_layer(raw, layers)` -> the per-layer tensors the engine hands a
    backend; `pool(per_layer)` -> the `EngineKVPool` over them; `rows(t, slots)` -> (K, V) `[n, heads, dim]`
    of `slots` in one layer's tensor `t`, as views-by-index of that tensor (read and write)."""

    name: str
    what: str
    kv_layout: str  # the pool's layout ("NHD": pages are one run of slots; "HND" otherwise)
    alloc: Callable
    per_layer: Callable
    pool: Callable
    rows: Callable


def _fused_rows(t, slots, page):  # t [pages, H, P, 2D]: K the first half of the last dim, V the second
    d = t.shape[-1] // 2
    p, o = torch.div(slots, page, rounding_mode="floor"), slots % page
    return (p, slice(None), o, slice(0, d)), (p, slice(None), o, slice(d, None))


def _stacked_rows(t, slots, page, kv_dim, hnd):  # t has a K/V axis of 2 at kv_dim; pages HND or NHD
    p, o = torch.div(slots, page, rounding_mode="floor"), slots % page
    inner = (slice(None), o) if hnd else (o, slice(None))
    if kv_dim == 0:
        return (0, p, *inner), (1, p, *inner)
    return (p, 0, *inner), (p, 1, *inner)


def _layouts() -> dict[str, EngineLayout]:
    def e(*a):
        return torch.empty(*a[:-2], dtype=a[-2], device=a[-1])

    return {
        "vllm_lbhnc": EngineLayout(
            "vllm_lbhnc",
            "vLLM 0.32 LBHNC (its CPU layout): per layer [blocks, H, P, 2D], K|V side by side",
            "HND",
            lambda L, n, h, p, d, dt, dev: e(L, n, h, p, 2 * d, dt, dev),
            lambda raw, L: [raw[i] for i in range(L)],
            lambda ts: EngineKVPool.from_fused(ts, kv_order="HND"),
            lambda t, s, p: _fused_rows(t, s, p),
        ),
        "vllm_lbnhc": EngineLayout(
            "vllm_lbnhc",
            "vLLM 0.32 LBNHC: per layer [blocks, H, P, 2D] over token-major pages [blocks, P, H, 2D]",
            "NHD",
            lambda L, n, h, p, d, dt, dev: e(L, n, p, h, 2 * d, dt, dev),
            lambda raw, L: [raw[i].permute(0, 2, 1, 3) for i in range(L)],
            lambda ts: EngineKVPool.from_fused(ts, kv_order="HND"),
            lambda t, s, p: _fused_rows(t, s, p),
        ),
        "vllm_blhnc": EngineLayout(
            "vllm_blhnc",
            "vLLM 0.32 BLHNC: layers interleaved inside each block, per layer [blocks, H, P, 2D] strided",
            "HND",
            lambda L, n, h, p, d, dt, dev: e(n, L, h, p, 2 * d, dt, dev),
            lambda raw, L: [raw[:, i] for i in range(L)],
            lambda ts: EngineKVPool.from_fused(ts, kv_order="HND"),
            lambda t, s, p: _fused_rows(t, s, p),
        ),
        "flash_attn": EngineLayout(
            "flash_attn",
            "vLLM FlashAttention: per layer [2, blocks, P, H, D]",
            "NHD",
            lambda L, n, h, p, d, dt, dev: e(L, 2, n, p, h, d, dt, dev),
            lambda raw, L: [raw[i] for i in range(L)],
            lambda ts: EngineKVPool.from_stacked(ts, kv_dim=0, kv_order="NHD"),
            lambda t, s, p: _stacked_rows(t, s, p, 0, False),
        ),
        "flashinfer": EngineLayout(
            "flashinfer",
            "vLLM FlashInfer / Triton NHD: per layer [blocks, 2, P, H, D] (K and V pages interleaved)",
            "HND",
            lambda L, n, h, p, d, dt, dev: e(L, n, 2, p, h, d, dt, dev),
            lambda raw, L: [raw[i] for i in range(L)],
            lambda ts: EngineKVPool.from_stacked(ts, kv_dim=1, kv_order="NHD"),
            lambda t, s, p: _stacked_rows(t, s, p, 1, False),
        ),
        "flashinfer_hnd": EngineLayout(
            "flashinfer_hnd",
            "vLLM FlashInfer HND: per layer [blocks, 2, H, P, D]",
            "HND",
            lambda L, n, h, p, d, dt, dev: e(L, n, 2, h, p, d, dt, dev),
            lambda raw, L: [raw[i] for i in range(L)],
            lambda ts: EngineKVPool.from_stacked(ts, kv_dim=1, kv_order="HND"),
            lambda t, s, p: _stacked_rows(t, s, p, 1, True),
        ),
    }


#: the engine layouts the kit builds, by name
ENGINE_LAYOUTS: dict[str, EngineLayout] = _layouts()


@dataclass(frozen=True)
class EngineCase:
    """One engine-owned-memory run: the layout, shapes, dtype, device and how new K/V are written
    ("save_kv": attn's write step, then forward(q, k, v, save_kv_cache=False), k/v the new tokens' values
    already in the cache; "forward": forward writes them). `max_context_len`: the width of the request
    table `EngineBatches` keeps (keys per request); `steps` whose requests grow past it are refused by
    `EngineBatches.build` (`InvalidArgumentError` naming seq_lens_cpu), so a longer schedule says so here."""

    layout: str
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    page_size: int = 16
    num_layers: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    write_by: str = "save_kv"
    sliding_window: Optional[int] = None
    steps: tuple = field(default_factory=lambda: tuple(tuple(s) for s in ENGINE_STEPS))
    max_context_len: int = 128

    def describe(self) -> str:
        w = f" window={self.sliding_window}" if self.sliding_window else ""
        return (
            f"engine layout {self.layout} ({ENGINE_LAYOUTS[self.layout].what}) "
            f"heads={self.num_q_heads}/{self.num_kv_heads} d={self.head_dim} page={self.page_size} {self.dtype} "
            f"on {self.device}, K/V written by {self.write_by}{w}"
        )


class EngineWorld:
    """The engine's side of a case: one NaN-poisoned allocation, its pool, a block allocator of scattered
    pages (page 0 never handed out), the requests' block lists and the dense K/V each request has cached
    (float64, per layer), and the attn side: `EngineBatches`, the context and the backend."""

    def __init__(self, case: EngineCase, factory: Callable):
        self.case = case
        self.gen = torch.Generator().manual_seed(case.seed)
        self.rng = random.Random(case.seed)
        self.layout = ENGINE_LAYOUTS[case.layout]
        self.dtype = getattr(torch, case.dtype)
        dev = torch.device(case.device)
        P, H, D, L = case.page_size, case.num_kv_heads, case.head_dim, case.num_layers
        tokens = sum(n for step in case.steps for _, n, *_ in step)
        self.num_pages = tokens // P + len({r for step in case.steps for r, *_ in step}) + 4
        self.raw = self.layout.alloc(L, self.num_pages, H, P, D, self.dtype, dev)
        self.raw.fill_(float("nan"))
        self.tensors = self.layout.per_layer(self.raw, L)
        self.pool = self.layout.pool(self.tensors)
        if self.pool.kv_layout != self.layout.kv_layout:
            raise KitFailure(
                f"{case.layout}: EngineKVPool took layout {self.pool.kv_layout}, expected {self.layout.kv_layout}"
            )
        self.buffers = [(b.data_ptr(), b.untyped_storage().data_ptr()) for b in self.pool.k_buffer + self.pool.v_buffer]
        self.free = list(range(1, self.num_pages))
        self.rng.shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.cache: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.batches = EngineBatches(self.pool, max_requests=8, max_context_len=case.max_context_len, device=dev)
        self.ctx = BackendContext(
            device=dev,
            dtype=self.dtype,
            num_q_heads=case.num_q_heads,
            num_kv_heads=H,
            head_dim=D,
            page_size=P,
            max_batch_size=8,
            max_context_len=self.batches.req_to_token_pool.max_context_len,
            req_to_token_pool=self.batches.req_to_token_pool,
            token_to_kv_pool=self.pool,
            sliding_window_size=case.sliding_window,
            forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED}),
            validation="full",
        )
        self.backend = factory(self.ctx)
        self.layers = [
            AttentionLayer(i, case.num_q_heads, H, D, scaling=D**-0.5 * 1.2, sliding_window_size=case.sliding_window)
            for i in range(L)
        ]

    # ---- the engine's bookkeeping ------------------------------------------------------------------
    def admit(self, work) -> None:
        """New requests join (a shared one starts with another's first blocks and their K/V cached)."""
        for item in work:
            name = item[0]
            if name in self.blocks:
                continue
            self.blocks[name], self.lens[name] = [], 0
            self.cache[name] = [(self._empty(), self._empty()) for _ in range(self.case.num_layers)]
            if len(item) == 4:
                src, nblocks = item[2], item[3]
                n = nblocks * self.case.page_size
                if n > self.lens[src]:
                    raise ValueError(f"{name} shares {n} tokens of {src}, which has {self.lens[src]} cached")
                self.blocks[name] = list(self.blocks[src][:nblocks])
                self.lens[name] = n
                self.cache[name] = [(k[:n].clone(), v[:n].clone()) for k, v in self.cache[src]]

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.case.num_kv_heads, self.case.head_dim, dtype=torch.float64)

    def slots_for(self, name: str, n: int) -> torch.Tensor:
        """Blocks for `n` more tokens of `name` (scattered pages), and their slots."""
        P, start = self.case.page_size, self.lens[name]
        while len(self.blocks[name]) * P < start + n:
            self.blocks[name].append(self.free.pop())
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.blocks[name])
        return table[torch.div(pos, P, rounding_mode="floor")] * P + pos % P

    def step_tensors(self, work) -> dict:
        """The engine's per-step tensors (on the device) and their host copies; slot_mapping carries two
        padding entries (-1) past the step's tokens, as a padded engine's does."""
        dev = torch.device(self.case.device)
        names = [item[0] for item in work]
        q_lens = [item[1] for item in work]
        slots = torch.cat([self.slots_for(nm, n) for nm, n in zip(names, q_lens)])
        seq = [self.lens[nm] + n for nm, n in zip(names, q_lens)]
        width = max(len(self.blocks[nm]) for nm in names) + 1
        table = torch.zeros(len(names), width, dtype=torch.int32)
        for i, nm in enumerate(names):
            table[i, : len(self.blocks[nm])] = torch.tensor(self.blocks[nm], dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_t = torch.tensor(seq, dtype=torch.int32)
        padded = torch.cat([slots, torch.full((2,), -1, dtype=torch.int64)])
        return dict(
            query_start_loc=qsl.to(dev),
            seq_lens=seq_t.to(dev),
            block_table=table.to(dev),
            slot_mapping=padded.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_t,
        )

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32).to(self.dtype).to(self.case.device)

    def expected_raw(
        self, before: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """`before` with the new K/V of `layer` at `slots`, placed by the layout's own indexer."""
        want = before.clone()
        t = self.layout.per_layer(want, self.case.num_layers)[layer]
        ki, vi = self.layout.rows(t, slots.cpu().to(want.device), self.case.page_size)
        t[ki] = k.to(want.dtype)
        t[vi] = v.to(want.dtype)
        return want

    def still_engine_memory(self) -> bool:
        now = [(b.data_ptr(), b.untyped_storage().data_ptr()) for b in self.pool.k_buffer + self.pool.v_buffer]
        return now == self.buffers and all(s == self.raw.untyped_storage().data_ptr() for _, s in now)


def _same_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a.double(), nan=4242.0), torch.nan_to_num(b.double(), nan=4242.0))


def run_engine_case(factory: Callable, case: EngineCase) -> str:
    """Play `case` (see the module docstring); raises `KitFailure` naming the step and layer; returns a
    detail line (the worst relative error)."""
    w = EngineWorld(case, factory)
    tol, worst = tolerance(w.dtype), 0.0
    for si, work in enumerate(case.steps):
        w.admit(work)
        tensors = w.step_tensors(work)
        batch = w.batches.build(**tensors, attn_backend=w.backend, check_indices=True)
        w.backend.init_forward_metadata(batch)
        T = batch.num_tokens
        names, q_lens = [item[0] for item in work], [item[1] for item in work]
        slots = tensors["slot_mapping"][:T]
        for layer in w.layers:
            lid = layer.layer_id
            q, k, v = (
                w.rand(T, case.num_q_heads, case.head_dim),
                w.rand(T, case.num_kv_heads, case.head_dim),
                w.rand(T, case.num_kv_heads, case.head_dim),
            )
            out = torch.full((T + 3, case.num_q_heads, case.head_dim), float("nan"), dtype=w.dtype, device=q.device)
            before = w.raw.clone()
            if case.write_by == "save_kv":
                w.backend.save_kv(k, v, layer, batch)
                res = w.backend.forward(q, k, v, layer, batch, save_kv_cache=False, out=out[:T])
            else:
                res = w.backend.forward(q, k, v, layer, batch, out=out[:T])
            where = f"step {si} ({batch.forward_mode.name}) layer {lid}: {case.describe()}"
            if res.data_ptr() != out.data_ptr():
                raise KitFailure(f"{where}: forward(out=) returned another tensor than the engine's buffer")
            if not bool(torch.isnan(out[T:]).all()):
                raise KitFailure(f"{where}: rows of the engine's output buffer past the step's tokens were written")
            if not _same_nan(w.raw, w.expected_raw(before, lid, slots, k, v)):
                raise KitFailure(f"{where}: the engine's cache differs from before plus the new K/V at slot_mapping")
            start = 0
            refs = []
            for nm, n in zip(names, q_lens):
                ck, cv = w.cache[nm][lid]
                ck = torch.cat([ck, k[start : start + n].double().cpu()])
                cv = torch.cat([cv, v[start : start + n].double().cpu()])
                w.cache[nm][lid] = (ck, cv)
                pos = torch.arange(w.lens[nm], w.lens[nm] + n)
                o, _ = reference_attention(
                    q[start : start + n].cpu(), ck, cv, q_positions=pos, scale=layer.scaling, window=case.sliding_window
                )
                refs.append(o)
                start += n
            err = relative_error(out[:T].cpu().reshape(T, case.num_q_heads, case.head_dim), torch.cat(refs))
            worst = max(worst, err)
            if not err <= tol:
                raise KitFailure(f"{where}: output rel err {err:.3g} > {tol:g}")
        for nm, n in zip(names, q_lens):
            w.lens[nm] += n
        if not w.still_engine_memory():
            raise KitFailure(
                f"step {si}: the pool's buffers are no longer views of the engine's allocation ({case.describe()})"
            )
    return f"{len(case.steps)} steps, max rel err {worst:.2g}"


def engine_case_check(target: KitTarget, case: EngineCase):
    def run() -> str:
        needs = {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED} - target.capabilities.forward_modes
        if needs:
            raise KitSkip(f"the engine schedule runs {sorted(m.name for m in needs)}, not declared")
        return run_engine_case(target.factory, case)

    return run


def engine_refusal_check(target: KitTarget, case: EngineCase):
    """An engine-owned pool in a layout the backend does not declare: refused at construction."""

    def run() -> str:
        try:
            EngineWorld(case, target.factory)
        except IncompatibleBackendError as exc:
            return f"refused: {exc}"
        layout = ENGINE_LAYOUTS[case.layout].kv_layout
        raise KitFailure(f"{case.describe()}: accepted an engine-owned pool in layout {layout} it does not declare")

    return run


# ---- hostile engines ---------------------------------------------------------------------------------
def _expect(what: str, argument: str, fn: Callable, raw: Optional[torch.Tensor] = None) -> str:
    before = None if raw is None else raw.clone()
    try:
        fn()
    except InvalidArgumentError as exc:
        if argument not in exc.argument:
            raise KitFailure(f"{what}: InvalidArgumentError names {exc.argument!r}, expected {argument!r}") from exc
        if raw is not None and before is not None and not _same_nan(raw, before):
            raise KitFailure(f"{what}: typed error raised, but the engine's cache was written") from exc
        return f"{type(exc).__name__}: {exc}"
    except AttnError as exc:
        raise KitFailure(
            f"{what}: {type(exc).__name__} where InvalidArgumentError naming {argument!r} was expected"
        ) from exc
    raise KitFailure(f"{what}: accepted (expected InvalidArgumentError naming {argument!r})")


def engine_hostile_checks(target: KitTarget, case: EngineCase) -> dict[str, Callable]:
    """name -> check: each hostile input must raise `InvalidArgumentError` naming it, nothing written."""
    lay = ENGINE_LAYOUTS[case.layout]
    H, P, D, dev = case.num_kv_heads, case.page_size, case.head_dim, case.device
    dt = getattr(torch, case.dtype)

    def transposed_last():  # a cache whose last dimension is not contiguous
        c = torch.zeros(6, H, 2 * D, P, dtype=dt, device=dev).transpose(2, 3)
        EngineKVPool.from_fused([c], kv_order="HND")

    def overlapping():  # pages 0 elements apart: every page is the same memory
        base = torch.zeros(H * P * 2 * D, dtype=dt, device=dev)
        c = base.as_strided((6, H, P, 2 * D), (0, P * 2 * D, 2 * D, 1))
        EngineKVPool.from_fused([c], kv_order="HND")

    def aliased():
        c = torch.zeros(6, H, P, D, dtype=dt, device=dev)
        EngineKVPool([c], [c], kv_order="HND")

    def stepped(spoil: Callable) -> Callable:
        def call():
            w = EngineWorld(replace(case, steps=case.steps[:1]), target.factory)
            w.admit(case.steps[0])
            tensors = w.step_tensors(case.steps[0])
            spoil(w, tensors)
            out = tensors.pop("out", None)
            T = int(tensors["query_start_loc_cpu"][-1])
            q = w.rand(T, case.num_q_heads, D)
            k, v = w.rand(T, H, D), w.rand(T, H, D)
            before = w.raw.clone()
            try:
                batch = w.batches.build(**tensors, attn_backend=w.backend, check_indices=True)
                w.backend.init_forward_metadata(batch)
                out = torch.empty(T, case.num_q_heads, D, dtype=w.dtype, device=q.device) if out is None else out
                w.backend.forward(q, k, v, w.layers[0], batch, out=out)
            finally:
                if not _same_nan(w.raw, before):
                    raise KitFailure("the engine's cache was written before the typed error")

        return call

    def past_cache(w, t):
        t["block_table"][0, 0] = w.num_pages + 3

    def slot_outside(w, t):
        t["slot_mapping"][0] = w.pool.num_slots + 5

    def wrong_out(w, t):
        T = int(t["query_start_loc_cpu"][-1])
        t["out"] = torch.empty(T, case.num_q_heads * D + 1, dtype=getattr(torch, case.dtype), device=dev)

    return {
        "strides": lambda: _expect("a cache whose last dimension is not contiguous", "stride", transposed_last),
        "overlap": lambda: _expect("a cache whose pages overlap (page stride 0)", "stride", overlapping),
        "alias": lambda: _expect("V the same memory as K", "v_caches[0]", aliased),
        "block_table": lambda: _expect(
            f"a block table pointing past the cache ({lay.name})", "block_table", stepped(past_cache)
        ),
        "slot_mapping": lambda: _expect(
            f"a slot mapping outside the cache ({lay.name})", "slot_mapping", stepped(slot_outside)
        ),
        "out": lambda: _expect("an output buffer of the wrong shape", "out", stepped(wrong_out)),
    }


def engine_page_size(page_sizes) -> int:
    """The page size the engine cases use: 16 where declared (or any), else the largest declared below 16,
    else the smallest declared (`ENGINE_STEPS` shares one whole page of a 24-token request)."""
    if page_sizes is None or 16 in page_sizes:
        return 16
    below = [p for p in page_sizes if p < 16]
    return max(below) if below else min(page_sizes)


__all__ = [
    "ENGINE_LAYOUTS",
    "ENGINE_STEPS",
    "EngineCase",
    "LONG_ENGINE_CONTEXT",
    "LONG_ENGINE_STEPS",
    "EngineLayout",
    "EngineWorld",
    "engine_case_check",
    "engine_hostile_checks",
    "engine_page_size",
    "engine_refusal_check",
    "longest_request",
    "run_engine_case",
]

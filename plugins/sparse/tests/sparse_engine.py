"""A small engine for the tests: NaN-poisoned pools (K, V and, for double sparsity, the label cache), a
`RequestPool`, one backend; each step built with `build_step` from (request name, new tokens) pairs, run on
every layer with random inputs, each request's output and LSE checked against a float64 reference over its
whole history, and the K/V (and label) writes checked slot by slot: the new tokens' slots hold exactly the
new values, every other slot is bit-identical to before (NaN stays NaN).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

import attn_core as ac
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_sparse.double_sparsity.pool import DoubleSparseKVPool
from attn_sparse.testing.reference import double_sparsity_reference, dual_chunk_reference

#: reference(layer, mode, q, q_succ, q_inter, keys, values, positions) -> (out [n, Hq, Dv], lse [n, Hq]) of one
#: request's n new tokens, given its keys and values (history and new tokens, `[L, Hkv, D]`)
Reference = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.double().nan_to_num(nan=12345.0), b.double().nan_to_num(nan=12345.0))


class SparseEngine:
    """Pools, requests and a backend built by `make_backend(ctx)`. Layers alternate logit cap 0 and 1.5;
    a label cache is kept when `heavy_channels` (`[num_layers, Hkv, C]`) is given."""

    def __init__(
        self,
        make_backend: Callable[[ac.BackendContext], ac.AttentionBackend],
        *,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 32,
        num_layers: int = 2,
        slots: int = 1024,
        max_context_len: int = 160,
        heavy_channels: Optional[torch.Tensor] = None,
        cuda_graph: int = 0,
        seed: int = 0,
        device: str = "cpu",
        integer_heavy_channels: bool = False,
    ):
        shape = dict(
            size=slots, page_size=page_size, dtype=dtype, head_num=num_kv_heads, head_dim=head_dim, layer_num=num_layers
        )
        if heavy_channels is not None:
            self.pool = DoubleSparseKVPool(**shape, heavy_channels=heavy_channels, device=device)
        else:
            self.pool = ac.MHATokenToKVPool(**shape, device=device)
        for buf in self.buffers():
            buf.fill_(float("nan"))
        self.rows = ac.ReqToTokenPool(size=8, max_context_len=max_context_len, device=device)
        self.requests = ac.RequestPool(self.rows, ac.PagedTokenAllocator(slots, page_size), self.pool)
        self.ctx = ac.BackendContext(
            device=device,
            dtype=dtype,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            max_batch_size=8,
            max_context_len=max_context_len,
            req_to_token_pool=self.rows,
            token_to_kv_pool=self.pool,
            forward_modes={"extend", "decode", "mixed"},
            cuda_graph=cuda_graph,
            validation="full",
        )
        self.backend = make_backend(self.ctx)
        self.layers = [
            ac.AttentionLayer(
                i, num_q_heads, num_kv_heads, head_dim, scaling=1.1 / head_dim**0.5, logit_cap=1.5 * (i % 2)
            )
            for i in range(num_layers)
        ]
        self.dtype, self.device = dtype, device
        self.integer_heavy_channels = integer_heavy_channels and heavy_channels is not None
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        self.gen = torch.Generator().manual_seed(seed)
        self.by_name: dict[str, ac.Request] = {}
        self.history: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.modes: list[str] = []

    def buffers(self) -> list[torch.Tensor]:
        out = []
        for lid in range(self.pool.layer_num):
            out += [self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid)]
            if isinstance(self.pool, DoubleSparseKVPool):
                out.append(self.pool.get_label_buffer(lid))
        return out

    def random_inputs(self, T: int, variants: bool) -> list[dict]:
        """Per layer q, k, v (and q_succ, q_inter with `variants`) for T new tokens."""
        hq, hkv, d = self.shape

        def rand(h):
            return torch.randn(T, h, d, generator=self.gen).to(self.dtype).to(self.device)

        layers = []
        for lid in range(len(self.layers)):
            x = {"q": rand(hq), "k": rand(hkv), "v": rand(hkv)}
            if self.integer_heavy_channels:
                self.integer_channels(lid, x)
            if variants:
                x["q_succ"], x["q_inter"] = rand(hq), rand(hq)
            layers.append(x)
        return layers

    def integer_channels(self, lid: int, x: dict) -> None:
        """Small random integers on layer `lid`'s heavy channels of q and k: the approximate scores are then
        exact in every dtype and kernel (no rounding can reorder keys), with many exact ties, which the
        position rule breaks."""
        hq, hkv, _ = self.shape
        chans = self.pool.heavy_channels[lid].cpu()
        for h in range(hq):
            idx = chans[h // (hq // hkv)].to(self.device)
            for name, head in (("q", h), ("k", h // (hq // hkv))):
                if name == "k" and h % (hq // hkv):
                    continue
                t = x[name]
                ints = torch.randint(-3, 4, (t.shape[0], idx.shape[0]), generator=self.gen).to(t)
                t[:, head, idx] = ints

    def build(self, work: Sequence[tuple[str, int]]) -> ac.ForwardBatch:
        for name, _ in work:
            if name not in self.by_name:
                self.by_name[name] = self.requests.add()
        return ac.build_step(self.requests, [(self.by_name[n], t) for n, t in work], attn_backend=self.backend)

    def step(
        self,
        work: Sequence[tuple[str, int]],
        reference: Reference,
        *,
        variants: bool = False,
        extras: Callable[[dict], dict] = lambda x: {},
        runner: Optional[ac.CudaGraphRunner] = None,
    ) -> list[float]:
        """One step, eager or (`runner`, DECODE steps) through a graph runner from `graph_runner`: returns each
        layer's output error; asserts outputs, LSEs and pool writes."""
        batch = self.build(work)
        inputs = self.random_inputs(batch.num_tokens, variants)
        before = [b.clone() for b in self.buffers()]
        if runner is None:
            self.backend.init_forward_metadata(batch)
            results = [
                layer(x["q"], x["k"], x["v"], batch, return_lse=True, **extras(x))
                for layer, x in zip(self.layers, inputs)
            ]
        else:
            flat = runner.run(batch, {f"{name}{lid}": t for lid, x in enumerate(inputs) for name, t in x.items()})
            results = [(flat[2 * lid], flat[2 * lid + 1]) for lid in range(len(self.layers))]
        assert self.backend.poll_device_fault() is None
        self.modes.append(batch.forward_mode.name)
        self.check_writes(batch, inputs, before, padding=runner is not None)
        errors = []
        tol = tolerance(self.dtype)
        for lid, ((out, lse), x) in enumerate(zip(results, inputs)):
            ref_o, ref_l = self.reference_step(lid, batch, work, x, reference)
            hq, d = self.shape[0], self.shape[2]
            err = relative_error(out.reshape(-1, hq, d), ref_o)
            lse_err = float((lse.double().cpu() - ref_l).abs().max())
            assert err <= tol, f"{batch.forward_mode.name} step {work}, layer {lid}: output rel err {err:.3g} > {tol:g}"
            assert lse_err <= max(tol, 1e-4), (
                f"{batch.forward_mode.name} step {work}, layer {lid}: LSE err {lse_err:.3g}"
            )
            errors.append(err)
        for lid, x in enumerate(inputs):  # the step's tokens join each request's history
            t = 0
            for name, n in work:
                k, v = self.history.get((name, lid), (x["k"][:0].cpu(), x["v"][:0].cpu()))
                self.history[(name, lid)] = (
                    torch.cat([k, x["k"][t : t + n].cpu()]),
                    torch.cat([v, x["v"][t : t + n].cpu()]),
                )
                t += n
        return errors

    def graph_runner(self, sizes: Sequence[int], variants: bool) -> ac.CudaGraphRunner:
        """A `CudaGraphRunner` over every layer (inputs q{l}, k{l}, v{l} and, with `variants`, q_succ{l},
        q_inter{l}; outputs each layer's output and LSE), capturing DECODE for `sizes` (real graphs on cuda)."""
        hq, hkv, d = self.shape
        shapes = {}
        for lid in range(len(self.layers)):
            shapes.update(
                {f"q{lid}": ((hq, d), self.dtype), f"k{lid}": ((hkv, d), self.dtype), f"v{lid}": ((hkv, d), self.dtype)}
            )
            if variants:
                shapes.update({f"q_succ{lid}": ((hq, d), self.dtype), f"q_inter{lid}": ((hq, d), self.dtype)})

        def run_layers(batch, x):
            outs = []
            for lid, layer in enumerate(self.layers):
                extra = {"q_succ": x[f"q_succ{lid}"], "q_inter": x[f"q_inter{lid}"]} if variants else {}
                outs += list(layer(x[f"q{lid}"], x[f"k{lid}"], x[f"v{lid}"], batch, return_lse=True, **extra))
            return tuple(outs)

        return ac.CudaGraphRunner(self.backend, sizes, run_layers, shapes)

    def reference_step(self, lid: int, batch, work, x: dict, reference: Reference) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses, t = [], [], 0
        layer = self.layers[lid]
        for name, n in work:
            k, v = self.history.get((name, lid), (x["k"][:0].cpu(), x["v"][:0].cpu()))
            keys, vals = torch.cat([k, x["k"][t : t + n].cpu()]), torch.cat([v, x["v"][t : t + n].cpu()])
            positions = torch.arange(keys.shape[0] - n, keys.shape[0])
            rows = {name_: x[name_][t : t + n].cpu() for name_ in ("q", "q_succ", "q_inter") if name_ in x}
            o, lse = reference(
                layer, batch.forward_mode, rows["q"], rows.get("q_succ"), rows.get("q_inter"), keys, vals, positions
            )
            outs.append(o)
            lses.append(lse)
            t += n
        return torch.cat(outs), torch.cat(lses)

    def check_writes(self, batch, inputs: list[dict], before: list[torch.Tensor], padding: bool = False) -> None:
        """New K/V (and labels) at out_cache_loc, every other slot as before; with graph `padding`, slot 0 (the
        dummy the padding rows write) is not compared."""
        loc = batch.out_cache_loc.cpu()
        labels = isinstance(self.pool, DoubleSparseKVPool)
        per_layer = 3 if labels else 2
        for lid, x in enumerate(inputs):
            new = [x["k"], x["v"]]
            if labels:
                ch = self.pool.heavy_channels[lid].cpu()
                new.append(torch.stack([x["k"][:, g, ch[g]] for g in range(ch.shape[0])], dim=1))
            for j, want in enumerate(new):
                buf, old = self.buffers()[lid * per_layer + j].cpu(), before[lid * per_layer + j].cpu()
                assert torch.equal(buf[loc], want.cpu().to(buf.dtype)), (
                    f"layer {lid} buffer {j}: new tokens not at out_cache_loc"
                )
                keep = torch.ones(buf.shape[0], dtype=torch.bool)
                keep[loc] = False
                keep[0] = keep[0] and not padding
                assert nan_equal(buf[keep], old[keep]), f"layer {lid} buffer {j}: written outside out_cache_loc"

    def free(self, name: str) -> None:
        self.requests.free(self.by_name.pop(name))
        for lid in range(len(self.layers)):
            self.history.pop((name, lid), None)


def ds_reference(heavy: int, threshold: int, chans: torch.Tensor, margins: list) -> Reference:
    """Double sparsity's reference for `SparseEngine.step`: DECODE steps by `double_sparsity_reference`
    (appending each token's per-head margins to `margins`: inf where dense), extend-like steps dense."""

    def reference(layer, mode, q, q_succ, q_inter, keys, vals, positions):
        if mode != ForwardMode.DECODE:  # extend-like steps are dense
            return reference_attention(
                q, keys, vals, q_positions=positions, scale=layer.scaling, logit_cap=layer.logit_cap
            )
        r = double_sparsity_reference(
            q[0],
            keys,
            vals,
            chans[layer.layer_id],
            scale=layer.scaling,
            heavy_token_num=heavy,
            sparse_decode_threshold=threshold,
            logit_cap=layer.logit_cap,
        )
        margins.append(r.margins)
        return r.out[None], r.lse[None]

    return reference


def dc_reference(chunk_len: int) -> Reference:
    """Dual chunk's reference for `SparseEngine.step` (`dual_chunk_reference`)."""

    def reference(layer, mode, q, q_succ, q_inter, keys, vals, positions):
        return dual_chunk_reference(
            q,
            q_succ,
            q_inter,
            keys,
            vals,
            q_positions=positions,
            chunk_len=chunk_len,
            scale=layer.scaling,
            logit_cap=layer.logit_cap,
        )

    return reference


def variants(x: dict) -> dict:
    """The forward extras carrying a layer's q_succ and q_inter (`SparseEngine.step`'s `extras`)."""
    return {"q_succ": x["q_succ"], "q_inter": x["q_inter"]}

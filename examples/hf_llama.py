"""A continuous-batching engine serving a `transformers` Llama through attn (an example, not shipped).

The model is run layer by layer (embedding, RMSNorm, projections, RoPE and MLP are HF's modules; the
engine applies RoPE at `ForwardBatch.positions`) and attn does attention over a paged KV cache. The
scheduler admits requests as they arrive, runs decodes first and prefill chunks under a token budget
(so steps are DECODE, MIXED or EXTEND), samples greedily, frees finished requests (their pages are
reused) and forks requests that share a prompt prefix with a running one. Optional: decode steps
through `attn_core.CudaGraphRunner` (real graphs on a GPU), speculative decoding (draft = the first
layers of the same model, `MultiStepDraftBackend`, TARGET_VERIFY), and HF's own forward with attn
registered as a `transformers` attention implementation.

Tensor parallelism (`tp_group`, a torch.distributed group): each rank projects and attends only its
slice of the query heads and of the KV heads (KV heads replicated when the group is larger than
num_kv_heads: `head_slice`), holds its own KV pool of those heads, and the output projection is summed
over the group (one all-reduce per layer). Embedding, MLP and lm_head are replicated, not sharded.

Decode context parallelism (`dcp_group`, `serve_dcp`): the ranks of a DCP group compute the same heads
(all of them, or with `tp_group` too their TP slice: TP x DCP over orthogonal groups), but each stores
only its interleaved share of each request's KV (`attn_core.dcp`, interleave = page size); decode attention
runs on each rank's shard and is merged across the group. Prefill attention is not sharded: a step of
whole prompts runs on a scratch pool holding just those prompts, and their K/V are then stored sharded.
`serve_dcp` has no chunked prefill and no prefix sharing. With graphs, its decode steps are graph-shaped
DCP steps replayed through the same `CudaGraphRunner` (q gather, local attention, exchange and merge
inside the graph; the collectives captured on NCCL).

    python examples/hf_llama.py --backend torch_native --page-size 16
    torchrun --nproc-per-node 2 examples/hf_llama.py --tp      # gloo on the CPU, NCCL with --device cuda
    torchrun --nproc-per-node 2 examples/hf_llama.py --dcp     # decode context parallelism (serve_dcp)
    torchrun --nproc-per-node 2 examples/hf_llama.py --dcp --graphs --device cuda --backend triton
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    """The command line (defined before the heavy imports below, so that `--help` answers at once)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch_native")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--attn-dtype", default="float32", help="KV cache and attention dtype (flashinfer: float16)")
    ap.add_argument(
        "--graphs", action="store_true", help="decode steps in CUDA graphs (attention share not measured then)"
    )
    ap.add_argument(
        "--tp", action="store_true", help="tensor parallelism over the torchrun ranks (gloo on the CPU, NCCL on GPUs)"
    )
    ap.add_argument("--dcp", action="store_true", help="decode context parallelism over the torchrun ranks (serve_dcp)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="compare every request's tokens with transformers' greedy generate and say so",
    )
    return ap


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    build_parser().parse_args()  # prints the help and exits before torch and transformers load

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import attn_core as ac  # noqa: E402
from attn_core.dcp import DCP_GRAPH_INPUTS, DcpLayout, DcpRequestPool, DcpStep, build_dcp_step, dcp_decode_attention  # noqa: E402


def tiny_llama(
    seed: int = 0, layers: int = 2, device: str = "cpu", heads: tuple[int, int] = (2, 1)
) -> LlamaForCausalLM:
    """A random float32 Llama (seeded; no download): `heads` = (query heads, KV heads) of dim 128
    (default 2 / 1), 256-token vocab."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads[0],
        head_dim=128,
        num_key_value_heads=heads[1],
        max_position_embeddings=1024,
        initializer_range=0.2,
        eos_token_id=None,
    )
    return LlamaForCausalLM(cfg).to(device).eval()


@dataclass(frozen=True)
class HeadSlice:
    """One tensor-parallel rank's attention heads: query heads q_start .. q_start+num_q-1 and KV heads
    kv_start .. kv_start+num_kv-1 of the model's."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_slice(num_q_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadSlice:
    """The heads rank `rank` of `world` tensor-parallel ranks holds: an equal share of the query heads,
    and of the KV heads when world <= num_kv_heads; when world > num_kv_heads each KV head is
    replicated on world / num_kv_heads consecutive ranks (those whose query heads read it).

    Worked example: 8 q / 2 KV heads over 2 ranks -> rank 1: q 4..7, KV 1; 2 q / 1 KV heads over 2
    ranks -> rank 1: q 1, KV 0 (replicated); 8 q / 2 KV over 4 ranks -> rank 1: q 2..3, KV 0.
    """
    if num_q_heads % world or (num_kv_heads % world and world % num_kv_heads):
        raise ValueError(f"{num_q_heads} q / {num_kv_heads} KV heads do not split over {world} ranks")
    return HeadSlice(
        rank * (num_q_heads // world), num_q_heads // world, rank * num_kv_heads // world, max(1, num_kv_heads // world)
    )


@dataclass
class DcpPrefill:
    """A DCP prefill step: attention over `batch` (the prompts on the scratch pool), K/V stored by `step`."""

    batch: ac.ForwardBatch
    step: DcpStep

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.positions


@dataclass
class Job:
    """A request: its prompt, how many tokens to generate, the step it arrives at, and optionally the
    job whose running request it shares its first `share` prompt tokens with."""

    prompt: list[int]
    max_new: int
    arrival: int = 0
    parent: Optional[int] = None
    share: int = 0
    out: list[int] = field(default_factory=list)


def attn_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, forward_batch=None, attn_layers=None, **_
):
    """HF attention implementation "attn": HF's q/k/v `[1, heads, T, D]` (RoPE applied) through attn."""
    q, k, v = (x[0].transpose(0, 1).to(forward_batch.token_to_kv_pool.dtype) for x in (query, key, value))
    out = attn_layers[module.layer_idx](q, k, v, forward_batch)
    return out.view(1, q.shape[0], q.shape[1], -1).to(query.dtype), None


AttentionInterface.register("attn", attn_attention)
AttentionMaskInterface.register("attn", lambda *args, **kwargs: None)  # attn masks by itself


class Engine:
    def __init__(
        self,
        model,
        backend="torch_native",
        page_size=1,
        num_slots=1024,
        max_running=4,
        token_budget=32,
        attn_dtype=torch.float32,
        graph_sizes=(),
        spec_steps=0,
        hf_forward=False,
        tp_group=None,
        dcp_group=None,
    ):
        cfg, dev = model.config, model.device
        self.tp_group, self.dcp_group = tp_group, dcp_group
        world, rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
        if tp_group is not None and hf_forward:
            raise ValueError("hf_forward runs HF's own (unsharded) attention modules: not with tp_group")
        self.heads_slice = head_slice(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world)
        self.model, self.budget, self.max_running, self.hf_forward = model, token_budget, max_running, hf_forward
        if hf_forward:  # HF's own forward, its attention on attn from now on
            model.set_attn_implementation("attn")
        self.kv = ac.MHATokenToKVPool(
            size=num_slots,
            page_size=page_size,
            dtype=attn_dtype,
            head_num=self.heads_slice.num_kv,
            head_dim=cfg.head_dim,
            layer_num=cfg.num_hidden_layers,
            device=dev,
        )
        rows = ac.ReqToTokenPool(size=max_running, max_context_len=512, device=dev)
        self.requests = ac.RequestPool(rows, ac.PagedTokenAllocator(num_slots, page_size), self.kv)
        modes = {"extend", "decode", "mixed"} | ({"target_verify"} if spec_steps else set())
        heads = dict(num_q_heads=self.heads_slice.num_q, num_kv_heads=self.heads_slice.num_kv, head_dim=cfg.head_dim)
        self.ctx = ac.BackendContext(
            device=dev,
            dtype=attn_dtype,
            **heads,
            page_size=page_size,
            max_batch_size=max_running,
            max_context_len=512,
            req_to_token_pool=rows,
            token_to_kv_pool=self.kv,
            forward_modes=modes,
            cuda_graph=ac.CudaGraphLevel.UNIFORM_BATCH if graph_sizes else ac.CudaGraphLevel.NEVER,
            speculative_num_steps=spec_steps,
            speculative_topk=1 if spec_steps else 0,
            speculative_num_draft_tokens=spec_steps + 1 if spec_steps else 0,
        )
        self.backend = ac.create_backend(backend, self.ctx)
        self.attn_seconds, self.shared_tokens, self.accepted_drafts = 0.0, 0, 0
        self.layers = [ac.AttentionLayer(i, **heads) for i in range(cfg.num_hidden_layers)]
        self.graphs = None
        if graph_sizes:  # captures now: under DCP every rank of the group at once (the graphs hold its collectives)
            inputs = {"x": ((cfg.hidden_size,), model.dtype)} | (DCP_GRAPH_INPUTS if dcp_group is not None else {})
            self.graphs = ac.CudaGraphRunner(self.backend, graph_sizes, self.graph_layers, inputs, num_draft_tokens=0)
        self.draft = (
            ac.MultiStepDraftBackend(lambda c, s: ac.create_backend(backend, c), 1, spec_steps, self.ctx)
            if spec_steps
            else None
        )
        if dcp_group is not None:
            layout = DcpLayout(dist.get_world_size(dcp_group), page_size)
            self.dcp = DcpRequestPool(self.requests, layout, dist.get_rank(dcp_group))
            scratch_kv = ac.MHATokenToKVPool(
                size=num_slots,
                page_size=page_size,
                dtype=attn_dtype,
                head_num=self.heads_slice.num_kv,
                head_dim=cfg.head_dim,
                layer_num=cfg.num_hidden_layers,
                device=dev,
            )
            self.scratch = ac.RequestPool(
                ac.ReqToTokenPool(size=max_running, max_context_len=512, device=dev),
                ac.PagedTokenAllocator(num_slots, page_size),
                scratch_kv,
            )

    def graph_layers(self, batch, inputs):
        """The layers a graph runs on the runner's static `batch` (under DCP a graph-shaped `DcpStep`)."""
        if self.dcp_group is not None:
            batch = DcpStep.from_graph_batch(batch, inputs)
        return self.layers_forward(batch, inputs["x"])

    def layers_forward(self, batch, x, num_layers=None):
        """Logits `[T, vocab]` of hidden states `x` `[T, hidden]` through the first num_layers layers."""
        m = self.model.model
        cos, sin = m.rotary_emb(x[None], batch.positions[None])
        for attn_layer, layer in zip(self.layers, m.layers[:num_layers]):
            a, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v = self.project_qkv(a, h)
            q, k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
            t0 = time.perf_counter()
            o = self.attend(attn_layer, *(t.to(self.kv.dtype) for t in (q, k, v)), batch).to(x.dtype)
            self.attn_seconds += time.perf_counter() - t0
            x = x + self.project_out(a, o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x))

    def attend(self, layer, q, k, v, batch):
        """Attention `[T, num_q * D]` of one layer: attn's layer call, or under DCP the sharded decode
        attention (`DcpStep`) or the unsharded prefill whose K/V are then stored sharded (`DcpPrefill`)."""
        if isinstance(batch, DcpStep):
            batch.save_kv(layer, k, v)
            return dcp_decode_attention(q, layer, batch, group=self.dcp_group, q_heads_sharded=False)
        if isinstance(batch, DcpPrefill):
            batch.step.save_kv(layer, k, v)
            return layer(q, k, v, batch.batch)
        return layer(q, k, v, batch)

    def project_qkv(self, a, h):
        """q `[T, num_q, D]`, k and v `[T, num_kv, D]` of this rank's heads from hidden states h `[T, hidden]`."""
        if self.tp_group is None:
            return tuple(p(h).view(h.shape[0], -1, a.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        s, d = self.heads_slice, a.head_dim
        out = []
        for proj, start, n in (
            (a.q_proj, s.q_start, s.num_q),
            (a.k_proj, s.kv_start, s.num_kv),
            (a.v_proj, s.kv_start, s.num_kv),
        ):
            rows = slice(start * d, (start + n) * d)
            bias = None if proj.bias is None else proj.bias[rows]
            out.append(F.linear(h, proj.weight[rows], bias).view(h.shape[0], n, d))
        return tuple(out)

    def project_out(self, a, o):
        """The output projection of attention output o `[T, num_q * D]` (this rank's heads), summed over
        the tensor-parallel group."""
        if self.tp_group is None:
            return a.o_proj(o)
        s, d = self.heads_slice, a.head_dim
        y = F.linear(o, a.o_proj.weight[:, s.q_start * d : (s.q_start + s.num_q) * d])
        dist.all_reduce(y, group=self.tp_group)
        return y if a.o_proj.bias is None else y + a.o_proj.bias

    def forward(self, batch, ids, num_layers=None):
        if isinstance(batch, DcpStep) and batch.graph_shaped:
            return self.graphs.run(batch.local_batch, {"x": self.model.model.embed_tokens(ids), **batch.graph_inputs()})
        if (
            self.graphs is not None
            and isinstance(batch, ac.ForwardBatch)
            and batch.forward_mode.is_decode()
            and self.graphs.captured_size(batch.forward_mode, batch.batch_size)
        ):
            return self.graphs.run(batch, {"x": self.model.model.embed_tokens(ids)})
        t0 = time.perf_counter()
        if isinstance(batch, DcpStep):
            batch.init_forward_metadata()
        else:
            self.backend.init_forward_metadata(batch.batch if isinstance(batch, DcpPrefill) else batch)
        self.attn_seconds += time.perf_counter() - t0
        if self.hf_forward:
            return self.model(
                input_ids=ids[None],
                position_ids=batch.positions[None],
                use_cache=False,
                forward_batch=batch,
                attn_layers=self.layers,
            ).logits[0]
        return self.layers_forward(batch, self.model.model.embed_tokens(ids), num_layers)

    @torch.no_grad()
    def serve(self, jobs: list[Job]) -> list[Job]:
        """Run every job to completion (greedy); returns them with `out` filled."""
        waiting, running, step = sorted(jobs, key=lambda j: j.arrival), [], 0
        while waiting or running:
            while waiting and waiting[0].arrival <= step and len(running) < self.max_running:
                job = waiting.pop(0)
                parent = (
                    next((r for j, r, _ in running if j is jobs[job.parent]), None) if job.parent is not None else None
                )
                req = self.requests.fork(parent, min(job.share, parent.kv_len)) if parent else self.requests.add()
                self.shared_tokens += req.kv_len
                running.append((job, req, list(job.prompt)))
            work, budget = [], self.budget
            for _, req, toks in sorted(running, key=lambda s: len(s[2]) - s[1].kv_len):  # decodes first
                n = min(len(toks) - req.kv_len, budget)
                if n:
                    work.append((req, toks[req.kv_len : req.kv_len + n], toks))
                    budget -= n
            step += 1
            if not work:
                continue
            ids = torch.tensor([t for _, chunk, _ in work for t in chunk], device=self.model.device)
            batch = ac.build_step(self.requests, [(r, len(c)) for r, c, _ in work], attn_backend=self.backend)
            logits = self.forward(batch, ids)
            ends = torch.tensor([len(c) for _, c, _ in work], device=ids.device).cumsum(0) - 1
            for (req, _, toks), tok in zip(work, logits[ends].argmax(-1).tolist()):
                if req.kv_len == len(toks):
                    toks.append(tok)
            for s in [s for s in running if len(s[2]) - len(s[0].prompt) >= s[0].max_new]:
                s[0].out = s[2][len(s[0].prompt) :]
                self.requests.free(s[1])
                running.remove(s)
        return jobs

    @torch.no_grad()
    def serve_dcp(self, jobs: list[Job]) -> list[Job]:
        """Run every job to completion (greedy) under decode context parallelism (`dcp_group`): each
        step either prefills the jobs that arrived (whole prompts) or decodes every running request."""
        waiting, running, step = sorted(jobs, key=lambda j: j.arrival), [], 0
        dev = self.model.device
        while waiting or running:
            new = []
            while waiting and waiting[0].arrival <= step and len(running) + len(new) < self.max_running:
                job = waiting.pop(0)
                new.append((job, self.dcp.add(), list(job.prompt)))
            step += 1
            if new:
                scratch = [self.scratch.add() for _ in new]
                full = ac.build_step(
                    self.scratch, [(s, len(t)) for s, (_, _, t) in zip(scratch, new)], attn_backend=self.backend
                )
                prefill = DcpPrefill(
                    full, build_dcp_step(self.dcp, [(r, len(t)) for _, r, t in new], attn_backend=self.backend)
                )
                ids = torch.tensor([t for _, _, toks in new for t in toks], device=dev)
                ends = torch.tensor([len(t) for _, _, t in new], device=dev).cumsum(0) - 1
                for (_, _, toks), tok in zip(new, self.forward(prefill, ids)[ends].argmax(-1).tolist()):
                    toks.append(tok)
                for s in scratch:
                    self.scratch.free(s)
                running += new
            elif running:
                graphed = (
                    self.graphs is not None
                    and self.graphs.captured_size(ac.ForwardMode.DECODE, len(running)) is not None
                )
                batch = build_dcp_step(
                    self.dcp, [(r, 1) for _, r, _ in running], attn_backend=self.backend, graph_shaped=graphed
                )
                ids = torch.tensor([toks[-1] for _, _, toks in running], device=dev)
                for (_, _, toks), tok in zip(running, self.forward(batch, ids).argmax(-1).tolist()):
                    toks.append(tok)
            for s in [s for s in running if len(s[2]) - len(s[0].prompt) >= s[0].max_new]:
                s[0].out = s[2][len(s[0].prompt) :]
                self.dcp.free(s[1])
                running.remove(s)
        return jobs

    @torch.no_grad()
    def serve_speculative(self, jobs: list[Job], draft_layers: int) -> list[Job]:
        """All jobs at once: a prefill, then rounds of k draft tokens (the first `draft_layers` layers)
        verified by the full model in one TARGET_VERIFY step; the longest agreeing prefix plus the
        model's next token are kept, the rejected slots rolled back."""
        k = self.draft.num_steps
        reqs = [self.requests.add() for _ in jobs]
        toks = [list(j.prompt) for j in jobs]
        ids = torch.tensor([t for p in toks for t in p], device=self.model.device)
        batch = ac.build_step(self.requests, [(r, len(p)) for r, p in zip(reqs, toks)], attn_backend=self.backend)
        ends = torch.tensor([len(p) for p in toks], device=ids.device).cumsum(0) - 1
        for p, tok in zip(toks, self.forward(batch, ids)[ends].argmax(-1).tolist()):
            p.append(tok)
        while any(len(p) - len(j.prompt) < j.max_new for p, j in zip(toks, jobs)):
            committed = [r.kv_len for r in reqs]
            verify = ac.build_step(
                self.requests, [(r, k + 1) for r in reqs], mode="target_verify", attn_backend=self.backend
            )
            loc = verify.out_cache_loc.view(len(reqs), 1, k + 1)[:, :, :k]
            lens_cpu = torch.tensor(committed, dtype=torch.int32)
            steps = self.draft.init_forward_metadata(verify.req_pool_indices, lens_cpu.to(ids.device), loc, lens_cpu)
            drafts = torch.tensor([[p[-1]] for p in toks], device=ids.device)
            for step_batch in steps:
                nxt = self.layers_forward(
                    step_batch, self.model.model.embed_tokens(drafts[:, -1]), draft_layers
                ).argmax(-1)
                drafts = torch.cat([drafts, nxt[:, None]], 1)
            target = self.forward(verify, drafts[:, : k + 1].reshape(-1)).argmax(-1).view(len(reqs), k + 1).tolist()
            for r, p, d, t, c in zip(reqs, toks, drafts[:, 1:].tolist(), target, committed):
                n = next((i for i in range(k) if d[i] != t[i]), k)
                self.accepted_drafts += n
                p += t[: n + 1]
                self.requests.truncate(r, c + n + 1)
        for j, r, p in zip(jobs, reqs, toks):
            j.out = p[len(j.prompt) :][: j.max_new]
            self.requests.free(r)
        return jobs


def demo_jobs(seed: int = 0, n: int = 8, max_new: int = 8) -> list[Job]:
    """Prompts of 5..40 tokens arriving over time; jobs 3 and 6 share a 20-token prefix with job 1."""
    g = torch.Generator().manual_seed(seed)
    jobs = [
        Job(
            torch.randint(0, 256, (int(torch.randint(5, 41, (1,), generator=g)),), generator=g).tolist(),
            max_new,
            arrival=2 * i,
        )
        for i in range(n)
    ]
    jobs[1].prompt = jobs[1].prompt + [7] * max(0, 20 - len(jobs[1].prompt))
    for i in (3, 6):
        if i < n:
            jobs[i].prompt, jobs[i].parent, jobs[i].share, jobs[i].arrival = (
                jobs[1].prompt[:20] + jobs[i].prompt[:9],
                1,
                20,
                3,
            )
    return jobs


def check_against_generate(model, jobs: list[Job]) -> list[int]:
    """The indices of the jobs whose tokens differ from `transformers`' own greedy `generate` of the same
    prompt (eager attention, its own KV cache); empty when every one is equal."""
    differ = []
    for i, j in enumerate(jobs):
        ids = torch.tensor([j.prompt], device=model.device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=j.max_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        if gen[0, len(j.prompt) :].tolist() != j.out:
            differ.append(i)
    return differ


def main() -> int:
    from attn_core.cli.progress import working

    args = build_parser().parse_args()
    group = None
    if args.tp or args.dcp:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        group = dist.group.WORLD
        if args.device.startswith("cuda"):
            args.device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}"
            torch.cuda.set_device(args.device)
    model = tiny_llama(device=args.device, heads=(8, 2) if args.tp else (2, 1))
    engine = Engine(
        model,
        args.backend,
        args.page_size,
        max_running=8,
        token_budget=64,
        attn_dtype=getattr(torch, args.attn_dtype),
        graph_sizes=(1, 2, 4, 8) if args.graphs else (),
        tp_group=group if args.tp else None,
        dcp_group=group if args.dcp else None,
    )
    serve = engine.serve_dcp if args.dcp else engine.serve
    with working(f"warm-up: {args.jobs} requests through {args.backend} (kernel compilation, lazy allocations)"):
        serve(demo_jobs(n=args.jobs, max_new=args.max_new))
    engine.attn_seconds, jobs = 0.0, demo_jobs(n=args.jobs, max_new=args.max_new)
    with working(f"timed run: {args.jobs} requests, {args.max_new} new tokens each"):
        t0 = time.perf_counter()
        serve(jobs)
        if args.device != "cpu":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    tokens = sum(len(j.prompt) + len(j.out) for j in jobs)
    share = "n/a" if args.graphs else f"{100 * engine.attn_seconds / secs:.0f}%"
    parallel = f" {'DCP' if args.dcp else 'TP'}={dist.get_world_size()}" if group is not None else ""
    if group is not None:
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return 0
    print(
        f"{args.backend}{parallel} page {args.page_size}{' graphs' if args.graphs else ''}: "
        f"{tokens} tokens in {secs:.2f} s = {tokens / secs:.0f} tokens/s; attention {share} of the time"
    )
    if args.check and group is None:
        with working("checking every request's tokens against transformers' generate"):
            differ = check_against_generate(model, jobs)
        if differ:
            print(f"check: {len(differ)} of {len(jobs)} requests differ from transformers' generate (jobs {differ})")
            return 1
        print(f"check: all {len(jobs)} requests equal transformers' generate ({sum(len(j.out) for j in jobs)} tokens)")
    elif args.check:
        print("check: skipped under --tp / --dcp (rank 0 holds a slice of the model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

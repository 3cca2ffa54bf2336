"""The benchmark scripts (`benchmarks/*.py`) stay runnable and keep the rules of their README-level
contract: every timing through `attn_core.bench.timing`, public names only (no `_`-prefixed attribute,
no pool buffers, no backend's per-step internals), no script importing another. Every script answers
`--help` on a CPU machine; the CPU-capable ones also run end to end on tiny shapes. Their GPU behaviour
is checked by `scripts/gpu_checks.sh bench` (and its named parts) on a GPU machine."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attn_core
from attn_core.testing.batch_builder import build_forward_batch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))
FIRST_PARTY = ("attn_core", "attn_triton", "attn_flashinfer", "attn_cpu_amx", "attn_trtllm_mla", "attn_ascend")
#: attributes a benchmark must not touch: the pools' storage (read and write K/V through
#: get_key_buffer / get_value_buffer / set_kv_buffer) and a backend's per-step metadata object, whose
#: layout is the backend's own business
INTERNAL_ATTRIBUTES = {"k_buffer", "v_buffer", "kv_buffer", "forward_metadata"}
#: timers that belong in attn_core.bench.timing only
TIMERS = {
    "perf_counter",
    "perf_counter_ns",
    "monotonic",
    "monotonic_ns",
    "process_time",
    "Event",
    "CUDAGraph",
    "elapsed_time",
}


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 5, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_script_imports_another(script):
    others = {p.stem for p in SCRIPTS}
    found = []
    for node in ast.walk(_tree(script)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in others]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in others:
            found.append(node.module)
    assert not found, f"{script.name} imports other benchmark scripts: {found} (shared code belongs in attn_core)"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_use_public_names_only(script):
    offenders = []
    for node in ast.walk(_tree(script)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FIRST_PARTY:
            offenders += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            offenders += [f"from {node.module} import ..." for part in node.module.split(".") if _private(part)]
        elif isinstance(node, ast.Import):
            offenders += [a.name for a in node.names if any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and (_private(node.attr) or node.attr in INTERNAL_ATTRIBUTES):
            offenders.append(f"line {node.lineno}: .{node.attr}")
    assert not offenders, f"{script.name} reaches past the public API: {offenders}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_time_through_the_timing_module(script):
    offenders = []
    for node in ast.walk(_tree(script)):
        if isinstance(node, ast.Attribute) and node.attr in TIMERS:
            offenders.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "torch.cuda"):
            offenders += [f"line {node.lineno}: {a.name}" for a in node.names if a.name in TIMERS]
    assert not offenders, f"{script.name} times by itself (use attn_core.bench.timing): {offenders}"


def test_the_scan_finds_what_it_must(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom attn_core.x import _y\nt = time.perf_counter()\npool.k_buffer[0]\nw._backend\n")
    assert "_y" in str(pytest.raises(AssertionError, test_scripts_use_public_names_only, bad).value)
    assert "perf_counter" in str(pytest.raises(AssertionError, test_scripts_time_through_the_timing_module, bad).value)
    message = str(pytest.raises(AssertionError, test_scripts_use_public_names_only, bad).value)
    assert ".k_buffer" in message and "._backend" in message


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_answers_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCH))  # as `python benchmarks/x.py` would put it first
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def _run(args: list[str], timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_window_pool_memory_reproduces_its_worked_example(tmp_path):
    # the docstring's example, by hand: 2 requests x (8 prefill + 2 decode) = 20 tokens; a slot holds
    # 1 head x (4 + 4) x 2 bytes = 16 bytes; the peak holds window + chunk = 8 slots a request (16), the
    # end one window (8); 16 x 16 / 20 = 12.8 and 8 x 16 / 20 = 6.4 bytes a token; saving 1 - 12.8 / 16
    out = tmp_path / "w.json"
    args = "--requests 2 --prefill 8 --chunk 4 --decode 2 --window 4 --page-size 2 --kv-heads 1 --head-dim 4"
    _run(
        [
            "benchmarks/window_pool_memory.py",
            *args.split(),
            "--dtype-bytes",
            "2",
            "--window-layer-fraction",
            "0.5",
            "--json",
            str(out),
        ]
    )
    got = json.loads(out.read_text())
    assert got["context_tokens"] == 20 and got["slot_bytes_per_layer"] == 16
    assert got["window_slots_peak"] == 16 and got["window_slots_at_end"] == 8
    assert got["window_pool_bytes_per_token_per_layer"] == pytest.approx(12.8)
    assert got["window_pool_bytes_per_token_per_layer_decode_steady"] == pytest.approx(6.4)
    assert got["window_layer_saving"] == pytest.approx(0.2) and got["model_kv_saving"] == pytest.approx(0.1)


def test_forward_host_cost_runs_on_the_cpu(tmp_path):
    out = tmp_path / "f.json"
    _run(["benchmarks/forward_host_cost.py", "--calls", "2", "--groups", "3", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"decode bs1", "decode bs64", "extend bs4 q128", "mla decode bs1"}
    for paths in rows.values():
        assert set(paths) == {"layer()", "backend.forward", "stub alone"} and all(us > 0 for us in paths.values())


def test_forward_host_cost_profiles_the_step_rows(tmp_path):
    # --profile appends one torch.profiler table a step path (the GPU run's diagnosis of a host-time change)
    prof = tmp_path / "p.txt"
    args = ["--steps", "--no-layer-rows", "--layers", "1", "--context", "16", "--step-runs", "1"]
    args += ["--profile", str(prof)]
    _run(["benchmarks/forward_host_cost.py", *args])
    text = prof.read_text()
    assert text.count("== step torch_native bs") == 2 and "Self CPU" in text


def test_engine_kv_layout_extend_row_runs_on_the_cpu(tmp_path):
    # the GPU script's peers built and timed end to end (its extend row twice: defaults, then the portable
    # kernel for every peer) on the interpreter: every vLLM-layout peer's output equals attn's own pool's
    pytest.importorskip("attn_triton")
    out = tmp_path / "e.json"
    args = ["--device", "cpu", "--rows", "tiny_extend", "--rounds", "1", "--budget", "0.01", "--out", str(out)]
    env_run = [sys.executable, "benchmarks/engine_kv_layout.py", *args]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(env_run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"].endswith("(same portable extend kernel)") for r in rows] == [False, True]
    for r in rows:
        assert set(r["peers"]) == {"own", "flash_attn", "vllm_lbnhc", "vllm_lbhnc", "flashinfer"}
        for p in r["peers"].values():
            assert p["kernel"] == "extend (portable)" and p["rel_err_vs_own"] < 1e-5 and p["median_us"] > 0


def test_step_host_ab_runs_two_trees_in_one_process(tmp_path):
    # this tree against a renamed copy of itself (the machinery of issue 36's in-process A/B): both steps run,
    # interleaved, and the report holds each row's medians, ratio and interval
    out = tmp_path / "ab.json"
    base = f"{ROOT / 'core' / 'src'}:{ROOT / 'plugins' / 'triton_backend' / 'src'}"
    args = ["--baseline-src", base, "--layers", "2", "--context", "32", "--batches", "1,4", "--samples", "20"]
    done = subprocess.run(
        [sys.executable, "benchmarks/step_host_ab.py", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["bs1 eager", "bs4 eager"]
    for r in rows:
        lo, hi = r["interval"]
        assert r["base_us"] > 0 and r["this_us"] > 0 and lo <= hi


def test_cascade_attention_runs_on_the_cpu(tmp_path):
    out = tmp_path / "c.json"
    tiny = ["--requests", "2", "--prefix", "32", "--suffix", "8", "--budget", "0.02"]
    _run(["benchmarks/cascade_attention.py", "--backend", "torch_native", "--device", "cpu", *tiny, "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["decode", "extend"]
    for r in rows:  # plain and cascade compute the same attention (bf16)
        assert r["plain_us"] > 0 and r["cascade_us"] > 0 and r["rel_err_cascade_vs_plain"] < 2e-2


def test_dcp_decode_runs_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "d.json"
    tiny = ["--bs", "2", "--ctx", "48", "--q-heads", "4", "--kv-heads", "2", "--reps", "2", "--dtype", "float32"]
    script = ["benchmarks/dcp_decode.py", "--device", "cpu", "--backend", "torch_native", *tiny, "--json", str(out)]
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", *script])
    got = json.loads(out.read_text())
    assert got["world"] == 2 and len(got["ranks"]) == 2
    for exchange in ("all_gather", "all_to_all"):
        for key in (f"dcp_{exchange}_s", f"collective_{exchange}_s", f"dcp_{exchange}_graph_s"):
            assert all(r[key] > 0 for r in got["ranks"]), key
    assert got["ranks"][0]["single_kv_tokens"] == 2 * 49


def test_cpu_vs_peers_runs_on_the_cpu(tmp_path):
    pytest.importorskip("attn_cpu_amx")
    out = tmp_path / "cpu.json"
    _run(
        [
            "benchmarks/cpu_vs_peers.py",
            "--rows",
            "decode",
            "--dtypes",
            "float32",
            "--reps",
            "1",
            "--no-torch-native",
            "--out",
            str(out),
        ],
        900,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r["dtype"]) for r in rows] == [("decode bs16 ctx2048", "float32")]
    assert rows[0]["median_ms"]["cpu_amx"] > 0 and rows[0]["median_ms"]["gather+sdpa"] > 0


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a script's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _plain_pages(batch, lens, page: int) -> tuple[list[int], list[int], list[int]]:
    """Page offsets, page ids and last-page lengths of the first `lens` keys of each request, by a loop."""
    indptr, ids, last = [0], [], []
    for r, n in enumerate(int(x) for x in lens):
        pages = -(-n // page)
        indptr.append(indptr[-1] + pages)
        row = batch.req_to_token_pool.req_to_token[int(batch.req_pool_indices[r])]
        ids += [int(row[j * page]) // page for j in range(pages)]
        last.append(n - (pages - 1) * page if pages else 0)
    return indptr, ids, last


def _fixture_parts(reqs: list[tuple[int, int]], page: int, mla: bool = False):
    """(request rows, allocator, KV pool) on the CPU sized for `reqs`, as the GPU scripts size them."""
    size = page * (sum(-(-(p + e) // page) for p, e in reqs) + 2)
    rows = attn_core.ReqToTokenPool(len(reqs), max(p + e for p, e in reqs) + page)
    if mla:
        pool = attn_core.MLATokenToKVPool(size, page, torch.bfloat16, 512, 64, 1)
    else:
        pool = attn_core.MHATokenToKVPool(size, page, torch.bfloat16, 8, 128, 1)
    return rows, attn_core.PagedTokenAllocator(size, page), pool


@pytest.mark.parametrize("mode,reqs", [("DECODE", [(95, 1), (16, 1), (0, 1)]), ("EXTEND", [(40, 9), (0, 7), (33, 3)])])
def test_flashinfer_overhead_hands_flashinfer_the_batchs_pages(mode, reqs):
    """The FlashInfer peer's plan inputs: offsets, last-page lengths and key counts on the host, page ids
    of the batch's own rows (on the batch's device), equal to a plain loop over the request rows."""
    bench = _load("flashinfer_overhead")
    rows, allocator, pool = _fixture_parts(reqs, bench.PAGE)
    batch = build_forward_batch(mode, reqs, req_to_token_pool=rows, allocator=allocator, token_to_kv_pool=pool)
    lens_cpu, lens = (
        (batch.seq_lens_cpu, batch.seq_lens)
        if mode == "DECODE"
        else (batch.extend_prefix_lens_cpu, batch.extend_prefix_lens)
    )
    indptr, ids, last, kv_lens = bench.paged_inputs(batch, lens, lens_cpu)
    assert (indptr.tolist(), ids.tolist(), last.tolist()) == _plain_pages(batch, lens_cpu, bench.PAGE)
    assert kv_lens.tolist() == lens_cpu.tolist()
    assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (indptr, last, kv_lens))


@pytest.mark.parametrize("mode,reqs", [("DECODE", [(200, 1), (5, 1)]), ("TARGET_VERIFY", [(130, 4), (60, 4)])])
def test_mla_vs_peers_hands_flashinfer_the_batchs_pages(mode, reqs):
    bench = _load("mla_vs_peers")
    batch = bench.new_step(mode, reqs, *_fixture_parts(reqs, bench.PAGE, mla=True))
    got = bench.flashinfer_inputs(batch)
    indptr, ids, _ = _plain_pages(batch, batch.seq_lens_cpu, bench.PAGE)
    assert got["kv_indptr"].tolist() == indptr and got["kv_indices"].tolist() == ids
    assert got["kv_len_arr"].tolist() == batch.seq_lens_cpu.tolist()
    new = [n for _, n in reqs]
    assert got["qo_indptr"].tolist() == [sum(new[:i]) for i in range(len(new) + 1)]
    assert got["causal"] == (mode != "DECODE")
    assert batch.spec_info is None or batch.spec_info.custom_mask is None  # verify runs as a causal chain
    assert all(
        t.device.type == "cpu" and t.dtype == torch.int32
        for t in (got["kv_indptr"], got["kv_len_arr"], got["qo_indptr"])
    )


def test_triton_vs_peers_extend_configs_take_the_clean_switch():
    # a ninth field of --extend-configs is ExtendConfig.wgmma_clean_masked (0 / 1), the rest ints as given
    bench = _load("triton_vs_peers")
    from attn_triton.kernels.extend import ExtendConfig

    off, on = bench.parse_configs("128,64,4,3,4,128,3,208;128,64,4,3,4,128,3,208,1", ExtendConfig)
    assert off == ExtendConfig(128, 64, 4, 3, 4, 128, 3, 208) and off.wgmma_clean_masked is False
    assert on.wgmma_clean_masked is True and on.wgmma_regs == 208
    assert bench.parse_configs(None, ExtendConfig) == [None]

"""`attn-core check`, `bench` and `explain` end to end (in-process, CPU)."""

from __future__ import annotations

import json
import re

from attn_core.bench.runner import run_bench
from attn_core.bench.workloads import model_for, standard_workloads, step_flops
from attn_core.cli.main import main


def test_check_torch_native_quick_passes(capsys):
    assert main(["check", "torch_native", "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^check: \d+ passed, 0 failed, 0 skipped", out, re.M), out
    assert "PASS  graph-DECODE" in out and "PASS  refuse-mode-SPLIT_PREFILL" in out


def test_check_lists_selects_and_skips(capsys):
    assert main(["check", "torch_native", "--device", "cpu", "--quick", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("page_size-64-") for line in listed) and any(
        line.startswith("bad_input-q_rows") for line in listed
    )
    assert main(["check", "torch_native", "--device", "cpu", "--quick", "-k", "mode-D", "--skip", "mode-DRAFT*"]) == 0
    out = capsys.readouterr().out
    assert "PASS  mode-DECODE" in out and "SKIP  mode-DRAFT_EXTEND" in out
    assert "check: 1 passed, 0 failed, 1 skipped" in out


def test_check_names_typed_errors(capsys, monkeypatch):
    # every backend the registry knows by name is installed in the dev venv: add one that is not
    import attn_core.discovery.registry

    monkeypatch.setitem(attn_core.discovery.registry.KNOWN_BACKENDS, "future_npu", "attn-future-npu")
    assert main(["check", "torch_nativ"]) == 2
    err = capsys.readouterr().err
    assert "unknown attention backend 'torch_nativ'" in err and "did you mean 'torch_native'" in err
    assert main(["check", "future_npu"]) == 2
    assert "not installed: pip install attn-future-npu" in capsys.readouterr().err
    assert main(["check", "torch_native", "--device", "npu"]) == 2
    assert "cannot run here" in capsys.readouterr().err


def test_explain_usable_and_reasons(capsys):
    assert main(["explain", "--device", "cpu", "--mla", "--feature", "sinks"]) == 0
    out = capsys.readouterr().out
    assert "arch=mla" in out and "head_dim=576" in out
    assert re.search(r"^torch_native\s+attn-core\s+usable$", out, re.M), out
    assert main(["explain", "--device", "cpu", "--dtype", "float64", "--page-size", "3"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^torch_native\s+attn-core\s+no: q dtype float64 not in", out, re.M), out
    assert "KV dtype float64 not in" in out
    from attn_core.contract.capabilities import Requirements
    from attn_core.discovery.registry import explain

    assert all(
        re.search(rf"^{r.name}\s+{r.distribution}\s+no: ", out, re.M) for r in explain(Requirements(q_dtype="float64"))
    ), out


def test_bench_decode_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "torch_native",
                "--device",
                "cpu",
                "--workload",
                "decode",
                "--budget",
                "0.02",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "decode bs1 ctx1024" in out and "GB/s" in out and "ok (" in out
    doc = json.loads(path.read_text())
    assert doc["device"]["type"] == "cpu" and doc["versions"]["torch"] and doc["date"]
    assert doc["versions"]["backends"]["torch_native"]["distribution"] == "attn-core"
    assert [r["workload"] for r in doc["rows"]] == [w.label for w in standard_workloads("decode", "small")]
    for r in doc["rows"]:
        assert r["status"] == "ok" and r["median_us"] > 0 and r["gbps"] > 0 and r["metadata_us"] > 0
        assert r["rel_error"] <= 2e-2 and r["bytes"] > 0


def test_bench_speedups_are_relative_to_the_baseline():
    rows = run_bench(
        ["torch_native", "torch_native"],
        standard_workloads("extend", "small")[:1],
        model_for("small"),
        _cpu(),
        0.02,
        baseline=1,
    )
    base = rows[1]
    assert base.speedup_vs_baseline == 1.0
    assert rows[0].speedup_vs_baseline == base.median_us / rows[0].median_us
    assert rows[0].flops == step_flops(standard_workloads("extend", "small")[0], model_for("small"))


def test_bench_reports_an_incompatible_backend_as_skipped(capsys):
    assert (
        main(
            [
                "bench",
                "torch_native",
                "--device",
                "cpu",
                "--workload",
                "mixed",
                "--dtype",
                "float64",
                "--budget",
                "0.01",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "skipped: attention backend 'torch_native' cannot serve this request: q dtype float64" in out


def test_bench_unknown_backend(capsys):
    assert main(["bench", "nope", "--device", "cpu"]) == 2
    assert "unknown attention backend 'nope'" in capsys.readouterr().err


def test_flops_count_visible_pairs_under_the_causal_mask():
    # prefill of 3 tokens: 1 + 2 + 3 visible pairs; decode at ctx 5: 5 pairs; heads 8, head_dim 128 (D + Dv = 256)
    from attn_core.bench.workloads import Workload
    from attn_core.contract.forward_mode import ForwardMode

    m = model_for("small")
    assert step_flops(Workload("extend", "x", ForwardMode.EXTEND, ((0, 3),)), m) == 2 * 8 * 256 * 6
    assert step_flops(Workload("decode", "x", ForwardMode.DECODE, ((4, 1),)), m) == 2 * 8 * 256 * 5


def _cpu():
    import torch

    return torch.device("cpu")


def test_bench_without_a_name_times_every_usable_backend_against_torch_native(tmp_path, capsys):
    from attn_core.discovery import registry

    plot, doc_path = tmp_path / "bench.png", tmp_path / "bench.json"
    argv = [
        "bench",
        "--device",
        "cpu",
        "--workload",
        "decode",
        "--budget",
        "0.01",
        "--plot",
        str(plot),
        "--json",
        str(doc_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    timed = re.search(r"^bench on cpu \(.*\): (.*)$", out, re.M).group(1).split(", ")
    assert timed[0] == "torch_native" and "SPEEDUP VS torch_native" in out
    left_out = dict(re.findall(r"^not benchmarked: (\w+): (.+)$", out, re.M))
    # every discovered backend is either timed or named with the reason it is not
    assert sorted(timed + list(left_out)) == sorted(e.name for e in registry.list_backends())
    if registry.default_registry().resolve("cpu_amx").probe() is None:
        assert "cpu_amx" in timed
    doc = json.loads(doc_path.read_text())
    rows = doc["rows"]
    assert [r["backend"] for r in rows] == timed * len(standard_workloads("decode", "small"))
    assert all(r["status"] == "ok" for r in rows), rows
    assert [r["speedup_vs_baseline"] for r in rows if r["backend"] == "torch_native"] == [1.0] * len(
        standard_workloads("decode", "small")
    )
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bench_plot_without_matplotlib_fails_before_timing(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["bench", "torch_native", "--device", "cpu", "--plot", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib: pip install 'attn-core[plot]'" in captured.err
    assert "bench on" not in captured.out and not (tmp_path / "x.png").exists()


def test_plot_series_per_backend():
    from attn_core.bench.plot import times_by_backend
    from attn_core.bench.runner import BenchRow

    rows = [
        BenchRow("decode", "decode", "a", "ok", median_us=10.0),
        BenchRow("decode", "decode", "b", "ok", median_us=20.0),
        BenchRow("extend", "extend", "a", "ok", median_us=5.0),
        BenchRow("extend", "extend", "b", "wrong", median_us=None),
        BenchRow("mixed", "mixed", "b", "ok", median_us=7.0),
    ]
    assert times_by_backend(rows) == (["decode", "extend", "mixed"], {"a": [10.0, 5.0, None], "b": [20.0, None, 7.0]})

"""What a new user meets at the command line (issue 39 items 5 and 7, issue 36 item 8): one behaviour for a
backend that cannot run here (`check`, `bench`, `explain NAME` print the registry's one line and exit 2,
`create_backend` raises `BackendUnavailableError` with the same text), `list --no-probe` says "not
probed", `list --json`, `list` wrapped to the terminal, `--version`, quoted user values cut to ~80
characters, `ForwardMode` printing its name, a stale-metadata message that says what differs, and the
debug switch that reports each layer call's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import attn_core as ac
from attn_core.cli.main import main
from attn_core.contract import debug_paths
from attn_core.contract.errors import BackendUnavailableError, StaleMetadataError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery import registry

REASON = "needs the imaginary accelerator (none on this machine)"


@pytest.fixture
def grounded():
    """A registered backend whose probe says it cannot run here."""
    reg = registry.default_registry()
    from attn_core.backends.torch_native.spec import CAPABILITIES

    spec = BackendSpec(
        name="grounded",
        summary="cannot run here",
        capabilities=CAPABILITIES,
        distribution="attn-grounded",
        backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend",
        probe_fn=lambda: REASON,
    )
    reg.register(spec, "attn-grounded")
    yield "grounded"
    reg._extra = [(s, d) for s, d in reg._extra if s is not spec]
    reg.refresh()


def _ctx():
    kv = ac.MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=1, head_dim=8, layer_num=1)
    rows = ac.ReqToTokenPool(size=2, max_context_len=32)
    return ac.BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=8,
        page_size=1,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
    )


def test_cannot_run_here_is_one_line_and_exit_2_everywhere(grounded, capsys):
    line = f"attention backend 'grounded' cannot run here: {REASON}"
    for argv in (
        ["check", "grounded"],
        ["bench", "grounded", "--device", "cpu"],
        ["bench", "torch_native", "--vs", "grounded"],
        ["explain", "grounded"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"attn-core {argv[0]}: {line}"], (argv, err)
    with pytest.raises(BackendUnavailableError) as e:
        ac.create_backend("grounded", _ctx())
    assert str(e.value) == line and e.value.reason == REASON
    assert main(["list"]) == 0
    assert f"unavailable: {REASON}" in capsys.readouterr().out


def test_explain_name_of_a_usable_backend(capsys):
    assert main(["explain", "torch_native", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0].startswith("request: ") and out[2].split() == ["torch_native", "attn-core", "usable"] and len(out) == 3
    )


def test_list_without_probes_says_not_probed_and_json_has_every_field(grounded, capsys):
    assert main(["list", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "grounded" in out and "available" not in out.replace("unavailable", "") and "not probed" in out
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["torch_native"]["state"] == "available" and rows["torch_native"]["distribution"] == "attn-core"
    assert rows["grounded"]["state"] == "unavailable" and rows["grounded"]["reason"] == REASON
    assert set(rows["grounded"]) == {
        "name",
        "distribution",
        "version",
        "state",
        "reason",
        "info",
        "notes",
        "unverified",
        "capabilities",
        "known_gaps",
    }


def _list_on_a_terminal(columns: int) -> str:
    """`attn-core list` with its stdout on a pseudo-terminal `columns` wide; what it printed."""
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "attn_core.cli.main", "list"], stdout=follower, stderr=subprocess.DEVNULL, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process is done writing
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_list_wraps_to_the_terminal_width():
    out = _list_on_a_terminal(90)
    assert out.startswith("NAME") and max(len(line) for line in out.splitlines()) <= 90, out
    assert any(line.strip().startswith("capabilities: ") for line in out.splitlines())
    # not a terminal (piped, captured): one full line per backend, whatever COLUMNS says
    wide = subprocess.run(
        [sys.executable, "-m", "attn_core.cli.main", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "90"},
    ).stdout
    assert "capabilities: " not in wide and any(len(line) > 90 for line in wide.splitlines())


def test_version_names_core_and_plugins():
    out = subprocess.run(
        [sys.executable, "-m", "attn_core.cli.main", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith(f"attn-core {ac.__version__}\n"), out
    assert "attn-triton" in out.stdout  # every plugin of the dev venv, with its backends


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "N" * 100_000],
        ["bench", "N" * 5000, "--device", "cpu"],
        ["explain", "--dtype", "d" * 5000],
        ["list", "--json=" + "j" * 500],
        ["check", "torch_native", "--option", "o" * 5000],
        ["explain", "--mode", "m" * 5000],
    ],
    ids=["check-name", "bench-name", "dtype", "unknown-flag-value", "option", "mode"],
)
def test_error_lines_quote_at_most_80_characters(argv, capsys):
    with (
        pytest.raises(SystemExit)
        if argv[0] == "list" or "--dtype" in argv or "--option" in argv or "--mode" in argv
        else _nothing()
    ):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and len(err) < 600, err[:700]
    assert "characters)" in err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_forward_mode_prints_its_name():
    assert str(ForwardMode.DECODE) == "DECODE" and f"{ForwardMode.TARGET_VERIFY}" == "TARGET_VERIFY"
    assert f"{ForwardMode.DECODE:d}" == str(int(ForwardMode.DECODE)) and ForwardMode.DECODE == ForwardMode.parse(
        "decode"
    )


def _two_steps():
    kv = ac.MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=1)
    rows = ac.ReqToTokenPool(size=4, max_context_len=64)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(size=256, page_size=1), kv)
    ctx = ac.BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=1,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
    )
    backend = ac.create_backend("torch_native", ctx)
    return requests, backend, ac.AttentionLayer(layer_id=0, num_q_heads=2, num_kv_heads=2, head_dim=8)


def test_stale_metadata_says_what_differs():
    requests, backend, layer = _two_steps()
    a, b = requests.add(), requests.add()
    first = ac.build_step(requests, [(a, 5), (b, 3)], attn_backend=backend)
    backend.init_forward_metadata(first)
    second = ac.build_step(requests, [(a, 1), (b, 1)], attn_backend=backend)
    q = torch.randn(second.num_tokens, 2, 8)
    with pytest.raises(
        StaleMetadataError, match=r"another batch: mode DECODE \(metadata: EXTEND\), tokens 2 \(metadata: 8\)"
    ):
        layer(q, q, q, second)


def test_debug_paths_report_each_layer_call(capsys):
    requests, backend, layer = _two_steps()
    a = requests.add()
    batch = ac.build_step(requests, [(a, 6)], attn_backend=backend)
    backend.init_forward_metadata(batch)
    q = torch.randn(6, 2, 8)
    plain = type(backend).forward
    with debug_paths.recording() as calls:
        layer(q, q, q, batch)
    assert type(backend).forward is plain and not debug_paths.enabled()  # off again: the plain method
    (call,) = calls
    assert (call.backend, call.layer_id, call.mode, call.num_tokens) == ("torch_native", 0, "EXTEND", 6)
    assert call.path.startswith("gather + einsum") and "causal self keys" in call.path
    env = {**os.environ, debug_paths.ENV_VAR: "1"}
    code = (
        "import torch, attn_core as ac\n"
        "from attn_core.testing.harness import AttnCase, assert_case\n"
        "assert_case(lambda ctx: ac.create_backend('torch_native', ctx), "
        "AttnCase('DECODE', [(5, 1), (9, 1)], dtype='float32'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "attn path: torch_native layer 0 DECODE (2 tokens): gather + einsum" in proc.stderr, proc.stderr[-2000:]


def test_every_public_error_class_is_in_the_docs():
    """Each `AttnError` subclass exported from attn_core is named in README.md or docs/ (with when it is
    raised: docs/errors.md lists them)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    docs = "".join(p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))])
    errors = [n for n in dir(ac) if isinstance(getattr(ac, n), type) and issubclass(getattr(ac, n), ac.AttnError)]
    assert len(errors) >= 20
    missing = [n for n in errors if not re.search(rf"`{n}`", docs)]
    assert not missing, f"public error classes named in no doc: {missing}"

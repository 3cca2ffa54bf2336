"""The `attn-core` command as a user runs it (subprocesses): reading arguments, `--help`, `list` and
`explain --help` import no torch; every bad argument is one line on stderr naming it, exit status 2,
before any work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attn_core.discovery.probes import gpu_device_present

# run the CLI in a fresh interpreter and report whether torch got imported
_RUN = """
import sys
from attn_core.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print("TORCH_IMPORTED" if "torch" in sys.modules else "NO_TORCH")
sys.exit(rc)
"""


def cli(*args: str, interpreter: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpreter:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    "args",
    [("--help",), ("list", "--no-probe"), ("explain", "--help"), ("bench", "--help"), ("check", "--help"), ()],
    ids=["help", "list-no-probe", "explain-help", "bench-help", "check-help", "no-command"],
)
def test_light_commands_import_no_torch(args):
    proc = cli(*args)
    assert proc.stdout.rstrip().endswith("NO_TORCH"), proc.stdout + proc.stderr
    assert proc.returncode in (0, 2), proc.stderr
    assert ("NAME" in proc.stdout) if args and args[0] == "list" else ("usage: attn-core" in proc.stdout)


@pytest.mark.skipif(gpu_device_present(), reason="with a GPU device node, probes ask torch whether it sees the GPU")
@pytest.mark.parametrize("interpreter", [False, True], ids=["plain", "TRITON_INTERPRET"])
def test_list_with_probes_imports_no_torch_without_a_gpu(interpreter):
    proc = cli("list", interpreter=interpreter)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("NO_TORCH"), proc.stdout
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:-1]}
    assert "available" in rows["torch_native"]
    if interpreter:
        assert " available" in rows["triton"], rows["triton"]
    else:
        assert "unavailable: needs a CUDA or ROCm GPU" in rows["triton"] and "TRITON_INTERPRET=1" in rows["triton"]


BAD_ARGUMENTS = [
    (("explain", "--dtype", "nonsense"), ("--dtype", "nonsense")),
    (("explain", "--kv-dtype", "int7"), ("--kv-dtype", "int7")),
    (("explain", "--page-size", "0"), ("--page-size", ">= 1")),
    (("explain", "--head-dim", "-8"), ("--head-dim", ">= 1")),
    (("explain", "--device", "x"), ("--device", "'x'")),
    (("explain", "--mode", "warp"), ("--mode", "'warp'", "DECODE")),
    (("explain", "--compute-capability", "nine"), ("--compute-capability", "MAJOR.MINOR")),
    (("explain", "--cuda-graph", "sometimes"), ("--cuda-graph", "sometimes")),
    (("bench", "--dtype", "nonsense"), ("--dtype", "nonsense")),
    (("bench", "--page-size", "0"), ("--page-size", ">= 1")),
    (("bench", "--device", "x"), ("--device", "'x'")),
    (("bench", "--device", "npu"), ("--device", "'npu'")),
    (("bench", "--device", "cuda:one"), ("--device", "'cuda:one'")),
    (("bench", "--budget", "nan"), ("--budget", "nan")),
    (("bench", "--budget", "inf"), ("--budget", "inf")),
    (("bench", "--budget", "-1"), ("--budget", "-1")),
    (("bench", "--budget", "soon"), ("--budget", "soon")),
    (("bench", "--json", "/no/such/folder/out.json"), ("--json", "/no/such/folder")),
    (("bench", "--plot", "/no/such/folder/out.png"), ("--plot", "/no/such/folder")),
    (("bench", "--workload", "huge"), ("--workload", "huge")),
    (("check", "torch_native", "--device", "x"), ("--device", "'x'")),
    (("check", "torch_native", "--seed", "NaN"), ("--seed", "NaN")),
    (("list", "--bogus"), ("--bogus",)),
    (("frobnicate",), ("frobnicate",)),
]


@pytest.mark.parametrize("args, names", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_one_line_and_exit_2(args, names):
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "error:" in lines[0] and "Traceback" not in proc.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert "NO_TORCH" in proc.stdout, "a bad argument must be refused before any work (torch was imported)"


def test_output_paths_are_checked_before_any_work(tmp_path):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    proc = cli("bench", "torch_native", "--json", str(folder))
    assert proc.returncode == 2 and "is a folder" in proc.stderr and "NO_TORCH" in proc.stdout, proc.stderr
    proc = cli("bench", "--plot", str(tmp_path / "missing" / "x.png"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "NO_TORCH" in proc.stdout, proc.stderr


def test_valid_values_are_normalised():
    from attn_core.cli.main import build_parser

    args = build_parser().parse_args(
        ["explain", "--dtype", "bf16", "--mode", "decode", "--compute-capability", "9.0", "--device", "cuda:1"]
    )
    assert (args.dtype, args.mode, args.compute_capability, args.device) == ("bfloat16", ["DECODE"], (9, 0), "cuda:1")
    args = build_parser().parse_args(["bench", "--budget", "0.25", "--page-size", "16", "--dtype", "torch.float16"])
    assert (args.budget, args.page_size, args.dtype, args.name) == (0.25, 16, "float16", None)


def test_the_light_commands_work_without_torch():
    """torch made unimportable: --help, list and explain still answer (backends say torch is missing)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
        "from attn_core.cli.main import main\n"
        "for argv in (['list'], ['list', '--no-probe'], ['explain', '--device', 'cpu']):\n"
        "    rc = main(argv); print('RC', rc)\n"
        "try:\n    main(['--help'])\nexcept SystemExit as exc:\n    print('HELP', exc.code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.count("RC ") == 3 and "HELP 0" in proc.stdout
    assert "RC 0" in proc.stdout  # list answers
    assert "unavailable: torch not installed (pip install torch)" in proc.stdout, proc.stdout

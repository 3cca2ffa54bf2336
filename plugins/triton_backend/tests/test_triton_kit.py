"""attn-core's conformance kit over the `triton` entry point: every check derived from the declared
capabilities (quick profile; CPU under the Triton interpreter, cuda on a GPU machine).

The one skip (bf16 under the interpreter, whose `tl.dot` has no faithful bf16) is not listed here: it is
a known limit of the machine that attn-core's kit adds itself (`attn_core.testing.limits`), the same
for `attn-core check triton`; bf16 is checked on a GPU (test_triton_gpu.py).
"""

from __future__ import annotations

import re

from triton_helpers import requires_interpreter

from attn_core.testing import ConformanceSuite


class TestTritonConformance(ConformanceSuite):
    backend = "triton"
    quick = True


@requires_interpreter
def test_cli_check_and_pytest_kit_share_the_interpreter_skip(capsys):
    """`attn-core check triton --device cpu --quick` under the interpreter skips the bf16 checks with the
    reason the pytest kit gives, and passes the rest (here the dtype checks only, to stay quick)."""
    from attn_core.cli.main import main

    reason = TestTritonConformance.kit_plan().skip_reason("dtype-bfloat16-DECODE")
    assert reason is not None and "triton-lang/triton#11584" in reason
    assert main(["check", "triton", "--device", "cpu", "--quick", "-k", "dtype-"]) == 0
    out = capsys.readouterr().out
    assert f"skipping dtype-bfloat16-*: {reason}" in out
    skipped = re.findall(r"^SKIP  (\S+) .*$", out, re.M)
    # bf16 q, over fp8 too, and the ragged op's bf16 check
    assert skipped and all(re.match(r"((fp8_kv-[^-]+-)?dtype-bfloat16-|ragged-dtype-bfloat16$)", s) for s in skipped)
    assert re.search(r"^check: [1-9]\d* passed, 0 failed, [1-9]\d* skipped", out, re.M), out

"""trtllm_mla's spec, probe and registry entry (no GPU, no flashinfer needed)."""

import subprocess
import sys

import pytest

import attn_trtllm_mla.spec as spec
from attn_core.contract.capabilities import ARCH_MLA, Requirements
from attn_core.discovery import registry


def test_spec_module_imports_neither_torch_nor_flashinfer():
    code = (
        "import sys, attn_trtllm_mla, attn_trtllm_mla.spec as s\n"
        "assert s.SPEC.name == 'trtllm_mla'\n"
        "bad = [m for m in ('torch', 'flashinfer', 'attn_flashinfer') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("cc", "reason"),
    [
        ((9, 0), "needs a Blackwell GPU (compute capability 10.x or 12.x), found 9.0; flashinfer_mla serves MLA here"),
        ((8, 0), "needs a Blackwell GPU (compute capability 10.x or 12.x), found 8.0; flashinfer_mla serves MLA here"),
        (
            (11, 0),
            "needs a Blackwell GPU (compute capability 10.x or 12.x), found 11.0; flashinfer_mla serves MLA here",
        ),
        ((10, 0), None),
        ((10, 3), None),
        ((12, 0), None),
    ],
)
def test_blackwell_reason(cc, reason):
    assert spec.blackwell_reason(cc) == reason


def test_probe_runs_its_checks_in_order():
    assert spec.probe((lambda: None, lambda: "second", lambda: "third")) == "second"
    assert spec.probe((lambda: None,)) is None
    assert spec.SPEC.probe() is not None  # no Blackwell GPU here


def test_capabilities_and_listing():
    caps = spec.CAPABILITIES
    assert (
        caps.archs == frozenset({ARCH_MLA})
        and caps.page_sizes == frozenset({32, 64})
        and caps.q_dtypes == frozenset({"bfloat16"})
    )
    assert caps.min_compute_capability == (10, 0) and caps.max_compute_capability == (12, 9)
    entry = {e.name: e for e in registry.list_backends()}["trtllm_mla"]
    assert (
        entry.distribution == "attn-trtllm-mla"
        and entry.spec.backend_class == "attn_trtllm_mla.backend:TRTLLMMLABackend"
    )
    assert "never run on hardware" in entry.spec.unverified


def test_attn_core_list_says_unverified(capsys):
    from attn_core.cli.main import main

    assert main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("trtllm_mla"))
    assert (
        "unavailable:" in row
        and "SM100/SM120" in row
        and "never run on hardware" in row
        and "ragged DeepSeek prefill" in row
    )


def test_select_backend_on_hopper_picks_flashinfer_mla(monkeypatch):
    """On an SM90 GPU with FlashInfer: trtllm_mla's probe refuses, flashinfer_mla is chosen."""
    import attn_flashinfer.mla_spec as fi_mla

    reg = registry.Registry()
    entries = reg.entries()
    monkeypatch.setattr(entries["trtllm_mla"], "probe", lambda: spec.blackwell_reason((9, 0)))
    monkeypatch.setattr(entries["flashinfer_mla"], "probe", lambda: None)
    monkeypatch.setattr(entries["flashinfer"], "probe", lambda: None)
    req = Requirements(
        device_type="cuda",
        compute_capability=(9, 0),
        arch="mla",
        head_dim=576,
        page_size=64,
        q_dtype="bfloat16",
        kv_dtype="bfloat16",
    )
    assert reg.select_backend(req) == "flashinfer_mla"
    assert fi_mla.SPEC.priority < spec.SPEC.priority
    monkeypatch.setattr(entries["trtllm_mla"], "probe", lambda: None)  # a Blackwell GPU
    req_b = Requirements(
        device_type="cuda",
        compute_capability=(10, 0),
        arch="mla",
        head_dim=576,
        page_size=64,
        q_dtype="bfloat16",
        kv_dtype="bfloat16",
    )
    assert reg.select_backend(req_b) == "trtllm_mla"

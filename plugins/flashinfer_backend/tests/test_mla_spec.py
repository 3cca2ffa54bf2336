"""Spec, probe and the torch-only helpers of the FlashInfer MLA backend (no GPU, no flashinfer needed)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import attn_flashinfer.mla_spec as mla_spec
from attn_core.contract.batch import SpecInfo
from attn_core.contract.capabilities import ARCH_MLA, CudaGraphLevel, Feature, Requirements
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.discovery import registry
from attn_flashinfer.mla_steps import check_capacity, check_mla_context, refuse_tree_mask


def test_spec_module_imports_neither_torch_nor_flashinfer():
    code = (
        "import sys, attn_flashinfer.mla_spec as s\n"
        "assert s.SPEC.name == 'flashinfer_mla'\n"
        "bad = [m for m in ('torch', 'flashinfer') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_capabilities_name_what_the_backend_does():
    caps = mla_spec.SPEC.capabilities
    assert mla_spec.SPEC.backend_class == "attn_flashinfer.mla_backend:FlashInferMLABackend"
    assert caps.archs == frozenset({ARCH_MLA}) and caps.mla_head_dims == frozenset({576})
    assert caps.page_sizes == frozenset({1, 16, 32, 64}) and caps.q_dtypes == frozenset({"bfloat16", "float16"})
    assert caps.cuda_graph == CudaGraphLevel.UNIFORM_BATCH
    assert Feature.CUSTOM_MASK not in caps.features and Feature.SPEC_TOPK_GT1 not in caps.features
    assert ForwardMode.SPLIT_PREFILL not in caps.forward_modes and ForwardMode.DRAFT_EXTEND in caps.forward_modes


def test_registry_lists_it_next_to_flashinfer():
    names = {e.name: e for e in registry.list_backends()}
    assert (
        names["flashinfer_mla"].distribution == "attn-flashinfer"
        and names["flashinfer"].distribution == "attn-flashinfer"
    )
    reason = names["flashinfer_mla"].probe()
    assert (
        reason is None
        or "flashinfer-python not installed" in reason
        or "CUDA" in reason
        or "compute capability" in reason
    )


def test_mha_contexts_are_not_matched():
    req = Requirements(device_type="cuda", compute_capability=(9, 0), arch="mha", head_dim=128)
    assert any("arch" in r for r in mla_spec.CAPABILITIES.mismatches(req))
    ok = Requirements(device_type="cuda", compute_capability=(9, 0), arch="mla", head_dim=576, page_size=64)
    assert mla_spec.CAPABILITIES.mismatches(ok) == []


def _ctx(**kw):
    base = dict(
        device=torch.device("cuda", 0),
        is_mla=True,
        v_head_dim=512,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        is_encoder_decoder=False,
        token_to_kv_pool=None,
        page_size=64,
    )
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(is_encoder_decoder=True), UnsupportedFeatureError, "encoder-decoder"),
        (dict(v_head_dim=128), InvalidArgumentError, "v_head_dim"),
    ],
)
def test_context_checks(kw, error, match):
    with pytest.raises(error, match=match):
        check_mla_context(_ctx(**kw), "flashinfer_mla")
    check_mla_context(_ctx(), "flashinfer_mla")


def test_capabilities_refuse_what_check_mla_context_leaves_to_the_base_class():
    from attn_core.contract.context import BackendContext

    def reasons(**kw):
        base = dict(device="cuda", dtype=torch.bfloat16, num_q_heads=16, num_kv_heads=1, head_dim=576, page_size=64)
        base.update(attention_arch="mla", kv_lora_rank=512, qk_rope_head_dim=64)
        base.update(kw)
        return " ".join(mla_spec.CAPABILITIES.mismatches(BackendContext(**base).requirements(), layout_only=True))

    assert reasons() == ""
    assert "device 'cpu'" in reasons(device="cpu")
    assert "arch 'mha'" in reasons(attention_arch="mha", num_kv_heads=1, kv_lora_rank=0, qk_rope_head_dim=0)
    assert "mixed dtypes" in reasons(kv_dtype=torch.float16)
    assert "page_size 8" in reasons(page_size=8)


def test_tree_masks_are_refused_chains_pass():
    mask = SpecInfo(num_draft_tokens=2, custom_mask=torch.ones(8, dtype=torch.bool))
    with pytest.raises(UnsupportedFeatureError, match="custom masks"):
        refuse_tree_mask("flashinfer_mla", ForwardMode.TARGET_VERIFY, mask)
    refuse_tree_mask("flashinfer_mla", ForwardMode.TARGET_VERIFY, SpecInfo(num_draft_tokens=2))
    refuse_tree_mask("flashinfer_mla", ForwardMode.TARGET_VERIFY, None)
    refuse_tree_mask("flashinfer_mla", ForwardMode.DECODE, mask)


def test_capacity_check():
    check_capacity("ids", 10, 10)
    with pytest.raises(InvalidArgumentError, match="at most 10"):
        check_capacity("ids", 11, 10)

import pytest

from attn_core.contract.forward_mode import ForwardMode

EXTEND_LIKE = {"EXTEND", "MIXED", "TARGET_VERIFY", "DRAFT_EXTEND", "SPLIT_PREFILL"}


@pytest.mark.parametrize("mode", list(ForwardMode))
def test_predicates_partition_the_modes(mode):
    assert mode.is_extend() == (mode.name in EXTEND_LIKE)
    assert mode.is_decode() == (mode.name == "DECODE")
    assert mode.is_decode_or_idle() == (mode.name in {"DECODE", "IDLE"})
    assert mode.is_no_tokens() == (mode.name in {"IDLE", "DUMMY_FIRST"})
    assert mode.is_cuda_graph() == (mode.name in {"DECODE", "TARGET_VERIFY", "IDLE"})
    assert mode.is_target_verify() == (mode.name == "TARGET_VERIFY")
    assert mode.is_draft_extend() == (mode.name == "DRAFT_EXTEND")
    assert mode.is_mixed() == (mode.name == "MIXED")
    assert mode.is_idle() == (mode.name == "IDLE")
    assert mode.is_split_prefill() == (mode.name == "SPLIT_PREFILL")
    assert mode.is_dummy_first() == (mode.name == "DUMMY_FIRST")
    assert mode.is_extend_or_draft_extend_or_mixed() == (mode.name in {"EXTEND", "MIXED", "DRAFT_EXTEND"})
    # every mode goes exactly one way in forward(): no tokens, decode, or extend
    assert [mode.is_no_tokens(), mode.is_decode(), mode.is_extend()].count(True) == 1


def test_parse():
    assert ForwardMode.parse("decode") is ForwardMode.DECODE
    assert ForwardMode.parse(ForwardMode.MIXED) is ForwardMode.MIXED
    assert ForwardMode.parse(int(ForwardMode.IDLE)) is ForwardMode.IDLE
    with pytest.raises(ValueError, match="unknown forward mode"):
        ForwardMode.parse("prefill")

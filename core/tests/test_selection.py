"""Selection per phase (`attn_core.discovery.selection`, `Registry.select_backend` / `explain_selection`) from the
priorities fake specs declare: one backend where it is best at both phases, a hybrid name where the best
prefill and decode backends differ, conditions on compute capability and CPU flags, `prefer`, spec
validation of the declarations, and `create_backend` building the hybrid."""

from __future__ import annotations

import pytest

from attn_core.contract.capabilities import Capabilities, Requirements
from attn_core.contract.errors import InvalidArgumentError, InvalidSpecError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.phases import DECODE, PREFILL, PhasePriority, phase_of, phases_of
from attn_core.contract.spec import BackendSpec
from attn_core.discovery import registry as reg
from attn_core.discovery.selection import hybrid_name, parse_hybrid_name

CUDA = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
)
CPU = Capabilities(devices=frozenset({"cpu"}), q_dtypes=frozenset({"float32"}), kv_dtypes=frozenset({"float32"}))
EVIDENCE = "docs/dev/perf-notebook.md (test)"
HOPPER = dict(min_compute_capability=(9, 0), max_compute_capability=(9, 0))


def _spec(name, caps=CUDA, priority=0, phases=()):
    return BackendSpec(
        name=name,
        summary="test",
        capabilities=caps,
        distribution=f"attn-{name}",
        backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend",
        priority=priority,
        phase_priorities=tuple(phases),
    )


def _registry(*specs) -> reg.Registry:
    r = reg.Registry(use_entry_points=False)
    for s in specs:
        r.register(s)
    return r


def _cuda(cc=(9, 0), modes=(ForwardMode.EXTEND, ForwardMode.DECODE)):
    return Requirements(device_type="cuda", compute_capability=cc, forward_modes=frozenset(modes))


# the GPU of issue 38: a prefill kernel that is slow at decode, a decode kernel, a general one
PREFILL_FAST = _spec("pf", priority=5, phases=[PhasePriority(PREFILL, 40, EVIDENCE, **HOPPER)])
DECODE_FAST = _spec("dec", priority=10)
GENERAL = _spec("gen", priority=20)


def test_phases_of_modes():
    assert phase_of(ForwardMode.DECODE) == DECODE and phase_of(ForwardMode.IDLE) is None
    assert {
        phase_of(m)
        for m in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
    } == {PREFILL}
    assert phases_of({ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.IDLE}) == (PREFILL, DECODE)
    assert phases_of({ForwardMode.IDLE}) == ()


def test_hybrid_names_round_trip():
    assert hybrid_name("fa4", "triton") == "hybrid(prefill=fa4,decode=triton)"
    assert parse_hybrid_name("hybrid(prefill=fa4, decode=triton)") == ("fa4", "triton")
    assert parse_hybrid_name(hybrid_name("a.b-c", "d_e")) == ("a.b-c", "d_e")
    for name in ("triton", "hybrid(decode=a,prefill=b)", "hybrid(prefill=a)", "hybrid(prefill=a,decode=b,x=c)"):
        assert parse_hybrid_name(name) is None


def test_best_prefill_and_decode_differ_gives_a_hybrid():
    r = _registry(PREFILL_FAST, DECODE_FAST)
    assert r.select_backend(_cuda()) == "hybrid(prefill=pf,decode=dec)"
    sel = r.explain_selection(_cuda())
    assert sel.is_hybrid and sel.backend_of(PREFILL) == "pf" and sel.backend_of(DECODE) == "dec"
    lines = sel.describe()
    assert lines[0] == f"prefill: pf (priority 40 on cuda, compute capability 9.0; {EVIDENCE})"
    assert lines[1] == "decode: dec (priority 10)"


def test_the_declaration_holds_only_where_its_conditions_do():
    r = _registry(PREFILL_FAST, DECODE_FAST)
    assert r.select_backend(_cuda(cc=(10, 0))) == "dec"  # not measured there: the specs' own priorities
    assert r.select_backend(_cuda(cc=None)) == "dec"  # unknown device: no declaration holds
    assert r.select_backend(_cuda(modes=(ForwardMode.DECODE,))) == "dec"  # one phase: never a hybrid
    assert r.select_backend(_cuda(modes=(ForwardMode.EXTEND, ForwardMode.MIXED))) == "pf"


def test_one_backend_best_at_both_phases_stays_one():
    r = _registry(PREFILL_FAST, GENERAL)
    assert r.select_backend(_cuda()) == "hybrid(prefill=pf,decode=gen)"
    both = _spec("both", priority=30, phases=[PhasePriority(PREFILL, 50, EVIDENCE, **HOPPER)])
    assert _registry(PREFILL_FAST, GENERAL, both).select_backend(_cuda()) == "both"
    assert _registry(DECODE_FAST, GENERAL).select_backend(_cuda()) == "gen"  # no declarations: as before


def test_ties_go_to_the_first_name():
    a = _spec("b_dec", priority=10)
    assert _registry(a, DECODE_FAST).select_backend(_cuda()) == "b_dec"


def test_cpu_flags_condition_and_negative_priority():
    """A backend slower than the reference (priority 0) at prefill on CPUs without a flag, faster with it:
    the portable-path case of attn-cpu-amx."""
    slow_without = _spec(
        "cpux",
        caps=CPU,
        priority=20,
        phases=[
            PhasePriority(PREFILL, -10, EVIDENCE, device="cpu"),
            PhasePriority(PREFILL, 20, EVIDENCE, device="cpu", cpu_isa=frozenset({"avx512f"})),
        ],
    )
    ref = _spec("ref", caps=CPU, priority=0)
    r = _registry(slow_without, ref)

    def req(flags):
        return Requirements(device_type="cpu", cpu_flags=flags, q_dtype="float32", kv_dtype="float32")

    assert r.select_backend(req(frozenset({"avx2"}))) == "hybrid(prefill=ref,decode=cpux)"
    assert r.select_backend(req(frozenset({"avx2", "avx512f"}))) == "cpux"
    assert (
        r.select_backend(req(None)) == "hybrid(prefill=ref,decode=cpux)"
    )  # flags unknown: the conditional entry does not hold


def test_prefer_takes_names_and_hybrid_names():
    r = _registry(PREFILL_FAST, DECODE_FAST, GENERAL)
    assert r.select_backend(_cuda(), prefer=["dec"]) == "dec"
    assert (
        r.select_backend(_cuda(), prefer=["nope", "hybrid(prefill=gen,decode=pf)"]) == "hybrid(prefill=gen,decode=pf)"
    )
    assert r.select_backend(_cuda(), prefer=["hybrid(prefill=gen,decode=nope)"]) == "hybrid(prefill=pf,decode=gen)"
    assert r.explain_selection(_cuda(), prefer=["dec"]).describe() == [
        "prefill: dec (preferred by the caller)",
        "decode: dec (preferred by the caller)",
    ]


@pytest.mark.parametrize(
    "entry, problem",
    [
        (PhasePriority("warmup", 1, EVIDENCE), r"phase_priorities\[0\].phase"),
        (PhasePriority(PREFILL, 1.5, EVIDENCE), r"phase_priorities\[0\].priority"),
        (PhasePriority(PREFILL, 1, ""), r"phase_priorities\[0\].evidence"),
        (PhasePriority(PREFILL, 1, EVIDENCE, min_compute_capability=9), "min_compute_capability"),
        (PhasePriority(PREFILL, 1, EVIDENCE, cpu_isa={"avx2"}), "cpu_isa"),
        ("fast", "expected a PhasePriority"),
    ],
)
def test_bad_declarations_make_the_spec_invalid(entry, problem):
    r = _registry(_spec("bad", phases=[entry]), DECODE_FAST)
    with pytest.raises(InvalidSpecError, match=problem):
        r.resolve("bad")
    assert r.select_backend(_cuda()) == "dec"  # one bad spec hides no other


def test_create_backend_builds_the_hybrid():
    import torch

    import attn_core as ac

    fast = _spec("cpu_pf", caps=CPU, phases=[PhasePriority(PREFILL, 40, EVIDENCE, device="cpu")])
    slow = _spec("cpu_dec", caps=CPU, priority=10)
    r = _registry(fast, slow)
    kv = ac.MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=1, head_dim=8, layer_num=1)
    ctx = ac.BackendContext(
        "cpu", torch.float32, 2, 1, 8, req_to_token_pool=ac.ReqToTokenPool(2, 16), token_to_kv_pool=kv
    )
    name = r.select_backend(ctx)
    assert name == "hybrid(prefill=cpu_pf,decode=cpu_dec)"
    backend = r.create_backend(name, ctx)
    assert isinstance(backend, ac.HybridAttnBackend)
    assert (
        backend.backend_for(ForwardMode.EXTEND) is backend.prefill
        and backend.backend_for(ForwardMode.DECODE) is backend.decode
    )
    assert backend.prefill is not backend.decode
    with pytest.raises(InvalidArgumentError, match="options"):
        r.create_backend(name, ctx, mixed_split=True)


def test_q_dtype_condition():
    bf16_only = _spec(
        "pf16", priority=5, phases=[PhasePriority(PREFILL, 40, EVIDENCE, q_dtypes=frozenset({"bfloat16"}))]
    )
    r = _registry(bf16_only, DECODE_FAST)
    assert r.select_backend(_cuda()) == "hybrid(prefill=pf16,decode=dec)"  # the requests above are bfloat16
    fp16 = Requirements(device_type="cuda", compute_capability=(9, 0), q_dtype="float16", kv_dtype="float16")
    assert r.select_backend(fp16) == "dec"
    assert bf16_only.phase_priorities[0].condition() == "cuda, q bfloat16"

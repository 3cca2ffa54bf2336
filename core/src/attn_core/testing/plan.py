"""The conformance plan: which checks a backend gets, derived from its declared `Capabilities`.

Every declared forward mode, page size, dtype, head dim and feature gets numerical cases against the
float64 reference (with K/V writes checked slot by slot); every undeclared feature or mode gets a
refusal check; bad inputs, the capture path, empty batches and the spec's import lightness get their
own checks. Check ids are stable strings like ``page_size-16-DECODE`` so skip lists can name them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Optional

from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, FP8_KV_DTYPES, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.compose import Draw, compose_requests
from attn_core.testing.engine_memory import (
    ENGINE_LAYOUTS,
    EngineCase,
    engine_case_check,
    engine_hostile_checks,
    engine_page_size,
    engine_refusal_check,
)
from attn_core.testing.graphs import graph_case_check, graph_relocation_check
from attn_core.testing.harness import AttnCase, run_case
from attn_core.testing.hostile import HOSTILE_MODES, hostile_cases, hostile_check
from attn_core.testing.hostile_steps import engine_path_checks
from attn_core.testing.lightness import spec_import_check, spec_matches_class_check
from attn_core.testing.masked import masked_nonfinite_check
from attn_core.testing.negative import bad_input_checks, no_token_check, refusal_check, refused_or_correct_check
from attn_core.testing.noncausal_checks import add_noncausal_checks
from attn_core.testing.outcome import Check, KitFailure
from attn_core.testing.profile import KitProfile
from attn_core.testing.ragged_checks import ragged_checks
from attn_core.testing.target import KitTarget

TOKEN_MODES = (
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND,
    ForwardMode.SPLIT_PREFILL,
)
_DTYPE_ORDER = ("float32", "float16", "bfloat16")
DEFAULT_PAGE_SIZES = (1, 16, 64)
LOGIT_CAP = 1.5


def _prefer(declared, order) -> list[str]:
    return [d for d in order if d in declared] + sorted(set(declared) - set(order))


def mla_split(head_dim: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) of an MLA case with latent width `head_dim` (576 -> 512 + 64)."""
    rope = 64 if head_dim >= 192 else max(1, head_dim // 5)
    return head_dim - rope, rope


def numeric_check(target: KitTarget, case: AttnCase, deterministic: bool = False):
    """A check running `case` against the reference (K/V writes included). `deterministic`: run it
    twice; the same inputs must give the same errors (bit-identical outputs give identical errors)."""

    def run() -> str:
        result = run_case(target.factory, case)
        if not result.ok:
            raise KitFailure(result.message())
        if deterministic:
            again = run_case(target.factory, case)
            if [(lr.out_error, lr.lse_error) for lr in again.layers] != [
                (lr.out_error, lr.lse_error) for lr in result.layers
            ]:
                raise KitFailure(
                    "two runs of the same inputs differ (declared deterministic)\n"
                    f"{result.message()}\n{again.message()}"
                )
        worst = max((lr.out_error for lr in result.layers), default=0.0)
        return f"max rel err {worst:.2g}"

    return run


def pick_head_dim(caps, arch: str, profile: KitProfile) -> int:
    """The profile's head dim for `arch` when declared, else the declared one nearest to it."""
    want = profile.head_dim if arch == ARCH_MHA else profile.mla_head_dim
    declared = caps.head_dims if arch == ARCH_MHA else caps.mla_head_dims
    if declared is None or want in declared:
        return want
    return min(declared, key=lambda d: (abs(d - want), d))


@dataclass(frozen=True)
class Base:
    """The defaults every case starts from, chosen among what the backend declares."""

    dtype: str
    kv_dtype: str
    head_dim: int
    page_size: int
    arch: str
    modes: tuple[ForwardMode, ...]  # declared modes that carry tokens, canonical order
    variant_modes: tuple[ForwardMode, ...]  # modes each variant (page size, dtype, ...) runs in


def choose_base(target: KitTarget, profile: KitProfile) -> Base:
    caps = target.capabilities
    dtype = _prefer(caps.q_dtypes, _DTYPE_ORDER)[0]
    kv_dtype = dtype if dtype in caps.kv_dtypes else _prefer(caps.kv_dtypes, _DTYPE_ORDER)[0]
    arch = ARCH_MHA if ARCH_MHA in caps.archs else ARCH_MLA
    head_dim = pick_head_dim(caps, arch, profile)
    page = 1 if caps.page_sizes is None or 1 in caps.page_sizes else min(caps.page_sizes)
    modes = tuple(m for m in TOKEN_MODES if m in caps.forward_modes)
    variants = tuple(m for m in (ForwardMode.DECODE, ForwardMode.EXTEND) if m in modes) or modes[:1]
    return Base(dtype, kv_dtype, head_dim, page, arch, modes, variants)


class PlanBuilder:
    """Builds the list of checks for one target and profile."""

    def __init__(self, target: KitTarget, profile: KitProfile, seed: int = 0):
        self.target = target
        self.caps = target.capabilities
        self.p = profile
        self.seed = seed
        self.base = choose_base(target, profile)
        self.checks: list[Check] = []
        self._variant_turn = 0

    # ---- cases -----------------------------------------------------------------------------
    def case(self, mode, requests, **kw) -> AttnCase:
        """An AttnCase at the base settings, `kw` overriding (head_dim/arch handled for MLA)."""
        b, p = self.base, self.p
        arch = kw.pop("arch", b.arch)
        head_dim = kw.pop("head_dim", b.head_dim if arch == b.arch else pick_head_dim(self.caps, arch, p))
        fields = dict(
            num_q_heads=p.num_q_heads,
            num_kv_heads=p.num_kv_heads,
            head_dim=head_dim,
            dtype=b.dtype,
            kv_dtype=b.kv_dtype,
            page_size=b.page_size,
            device=p.device,
            seed=self.seed + len(self.checks),
            num_layers=p.num_layers,
            custom_mask=self.caps.supports(Feature.CUSTOM_MASK),
        )
        if arch == ARCH_MLA:
            lora, rope = mla_split(head_dim)
            fields.update(arch=ARCH_MLA, kv_lora_rank=lora, qk_rope_head_dim=rope, num_kv_heads=1)
        fields.update(kw)
        return AttnCase(mode, tuple(requests), **fields)

    def fixed_requests(self, mode: ForwardMode) -> list[tuple[int, ...]]:
        """A hand-picked composition per mode: prefill, prefix hit, one-token and empty rows."""
        P, E, D = self.p.max_prefix, self.p.max_extend, self.p.max_draft
        return {
            ForwardMode.EXTEND: [(0, E), (P, E // 2 + 1), (P // 2 + 1, 1), (P // 3 + 2, 0)],
            ForwardMode.DECODE: [(P, 1), (0, 1), (1, 1), (P // 2 + 3, 1)],
            ForwardMode.MIXED: [(P, 1), (0, E), (P // 2, E // 2 + 2), (3, 1)],
            ForwardMode.TARGET_VERIFY: [(P, D), (P // 2 + 1, D), (1, D)],
            ForwardMode.DRAFT_EXTEND: [(P, 2), (P // 2 + 1, 3), (1, 1)],
            ForwardMode.SPLIT_PREFILL: [(0, E), (P, E // 2 + 1)],
        }[mode]

    def variant_modes(self) -> tuple[ForwardMode, ...]:
        """Modes a variant runs in: all variant modes, or (quick) one of them in turn."""
        modes = self.base.variant_modes
        if not self.p.quick or len(modes) < 2:
            return modes
        self._variant_turn += 1
        return (modes[self._variant_turn % len(modes)],)

    # ---- adding checks -----------------------------------------------------------------------
    def add(self, cid: str, run, description: str = "") -> None:
        self.checks.append(Check(cid, run, description))

    def numeric(self, cid: str, case: AttnCase, deterministic: bool = False) -> None:
        self.add(cid, numeric_check(self.target, case, deterministic), case.describe())

    # ---- the plan ----------------------------------------------------------------------------
    def build(self) -> list[Check]:
        self.add_spec_checks()
        self.add_mode_checks()
        self.add_random_checks()
        self.add_variant_checks()
        self.add_fp8_checks()
        self.add_feature_checks()
        add_noncausal_checks(self)
        self.checks += ragged_checks(self.target, self.p, self.base.dtype, self.seed)
        self.add_graph_checks()
        self.add_negative_checks()
        self.add_hostile_checks()
        self.add_masked_checks()
        self.add_engine_kv_checks()
        return self.checks

    def add_spec_checks(self) -> None:
        self.add("spec-import_light", spec_import_check(self.target))
        self.add("spec-matches_class", spec_matches_class_check(self.target))

    def add_mode_checks(self) -> None:
        for mode in self.base.modes:
            self.numeric(f"mode-{mode.name}", self.case(mode, self.fixed_requests(mode)))
        for mode in (ForwardMode.IDLE, ForwardMode.DUMMY_FIRST):
            if mode in self.caps.forward_modes:
                case = self.case(mode, ())
                self.add(f"empty-{mode.name}", no_token_check(self.target, case), case.describe())

    def random_case(self, mode: ForwardMode, draw: Draw, seed: int) -> AttnCase:
        """A random composition of `mode` at the base settings, page size drawn among the tested ones."""
        pages = self.page_sizes()
        page = pages[draw(0, len(pages) - 1)]
        return self.case(mode, compose_requests(draw, mode, self.p), page_size=page, seed=seed)

    def add_random_checks(self) -> None:
        for mode in self.base.modes:
            for i in range(self.p.random_cases):
                rng = random.Random(f"{self.seed}-{mode.name}-{i}")
                self.numeric(f"random-{mode.name}-{i}", self.random_case(mode, rng.randint, self.seed + 1000 * i))

    def page_sizes(self) -> list[int]:
        return sorted(self.caps.page_sizes) if self.caps.page_sizes is not None else list(DEFAULT_PAGE_SIZES)

    def page_requests(self, mode: ForwardMode, ps: int) -> list[tuple[int, int]]:
        """Requests whose prefixes and new tokens cross page boundaries."""
        if mode.is_decode():
            return [(2 * ps + 2, 1), (ps, 1), (ps - 1, 1)]
        return [(2 * ps + 3, min(self.p.max_extend, ps) + 1), (ps - 1, ps + 2), (0, 2 * ps + 1)]

    def long_requests(self, mode: ForwardMode) -> list[tuple[int, int]]:
        L, E = self.p.long_len, self.p.max_extend
        if mode.is_decode():
            return [(L - 1, 1), (1, 1)]
        return [(0, L), (L - E, E)]

    def add_variant_checks(self) -> None:
        caps, b = self.caps, self.base
        for mode in self.variant_modes():
            self.numeric(f"long-{mode.name}", self.case(mode, self.long_requests(mode)))
        for ps in self.page_sizes():
            for mode in self.variant_modes():
                self.numeric(f"page_size-{ps}-{mode.name}", self.case(mode, self.page_requests(mode, ps), page_size=ps))
        mixed = caps.supports(Feature.MIXED_KV_DTYPE)
        for dtype in _prefer(caps.q_dtypes, _DTYPE_ORDER):
            kv = dtype if dtype in caps.kv_dtypes else b.kv_dtype
            if kv != dtype and not mixed:
                continue  # construction refuses the pair (checked below)
            for mode in self.variant_modes():
                self.numeric(
                    f"dtype-{dtype}-{mode.name}", self.case(mode, self.fixed_requests(mode), dtype=dtype, kv_dtype=kv)
                )
        if b.arch == ARCH_MHA:
            for layout in sorted(caps.kv_layouts - {"NHD"}):
                for ps in sorted({b.page_size, self.page_sizes()[-1]}):
                    for mode in self.variant_modes():
                        case = self.case(mode, self.page_requests(mode, ps), page_size=ps, kv_layout=layout)
                        self.numeric(f"kv_layout-{layout}-page_size-{ps}-{mode.name}", case)
        others = sorted(set(caps.kv_dtypes) - {b.dtype} - FP8_KV_DTYPES)  # fp8: `add_fp8_checks`
        for kv in others if mixed else ():
            for mode in self.variant_modes():
                self.numeric(f"kv_dtype-{kv}-{mode.name}", self.case(mode, self.fixed_requests(mode), kv_dtype=kv))
        if others and not mixed:
            mode = self.variant_modes()[0]
            case = self.case(mode, self.fixed_requests(mode), kv_dtype=others[0])
            what = f"KV dtype {others[0]} under q dtype {b.dtype} (no {Feature.MIXED_KV_DTYPE.value})"
            self.add(f"refuse-kv_dtype-{others[0]}", refused_or_correct_check(self.target, case, what), case.describe())
        declared = caps.head_dims if b.arch == ARCH_MHA else caps.mla_head_dims
        dims = sorted(declared) if declared is not None else list(self.p.head_dims if b.arch == ARCH_MHA else ())
        for d in dims:
            if d == b.head_dim:
                continue
            for mode in self.variant_modes():
                self.numeric(f"head_dim-{d}-{mode.name}", self.case(mode, self.fixed_requests(mode), head_dim=d))
        if b.arch == ARCH_MHA:
            for hq, hkv in self.p.gqa:
                for mode in self.variant_modes():
                    case = self.case(mode, self.fixed_requests(mode), num_q_heads=hq, num_kv_heads=hkv)
                    self.numeric(f"gqa-{hq}x{hkv}-{mode.name}", case)
        if ARCH_MLA in caps.archs and b.arch != ARCH_MLA:
            for mode in self.variant_modes():
                self.numeric(f"mla-{mode.name}", self.case(mode, self.fixed_requests(mode), arch=ARCH_MLA))
        for mode in self.variant_modes():
            reqs = self.fixed_requests(mode) + [(self.p.max_prefix // 2, 1 if mode.is_decode() else 2), (5, 1)]
            self.numeric(f"steps-{mode.name}", self.case(mode, reqs, steps=((0, 2, 4), (1, 3, 5))))

    def add_fp8_checks(self) -> None:
        """fp8 KV caches (`FP8_KV_DTYPES`): declared, the base q dtype over the cache in decode, extend and
        target verify (where declared), over several steps, on MLA where declared, and one case per
        other declared q dtype; undeclared, construction must refuse it (`IncompatibleBackendError`)."""
        caps, b = self.caps, self.base
        for kv in sorted(FP8_KV_DTYPES):
            mode = b.variant_modes[0] if b.variant_modes else None
            if kv not in caps.kv_dtypes:
                if mode is not None:
                    case = self.case(mode, self.fixed_requests(mode), kv_dtype=kv)
                    self.add(
                        f"refuse-kv_dtype-{kv}", refusal_check(self.target, case, f"KV dtype {kv}"), case.describe()
                    )
                continue
            modes = [m for m in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY) if m in b.modes]
            for m in modes:
                self.numeric(f"fp8_kv-{kv}-{m.name}", self.case(m, self.fixed_requests(m), kv_dtype=kv))
            for m in self.variant_modes():
                reqs = self.fixed_requests(m) + [(self.p.max_prefix // 2, 1 if m.is_decode() else 2), (5, 1)]
                self.numeric(
                    f"fp8_kv-{kv}-steps-{m.name}", self.case(m, reqs, kv_dtype=kv, steps=((0, 2, 4), (1, 3, 5)))
                )
            if ARCH_MLA in caps.archs and b.arch != ARCH_MLA:
                for m in self.variant_modes():
                    self.numeric(
                        f"fp8_kv-{kv}-mla-{m.name}", self.case(m, self.fixed_requests(m), arch=ARCH_MLA, kv_dtype=kv)
                    )
            for dtype in _prefer(caps.q_dtypes, _DTYPE_ORDER):
                if dtype != b.dtype:
                    for m in self.variant_modes():
                        self.numeric(
                            f"fp8_kv-{kv}-dtype-{dtype}-{m.name}",
                            self.case(m, self.fixed_requests(m), dtype=dtype, kv_dtype=kv),
                        )

    def add_feature_checks(self) -> None:
        caps, target = self.caps, self.target
        declared = caps.features
        p = self.p
        if Feature.SLIDING_WINDOW in declared:
            for w in p.windows:
                for mode in self.variant_modes():
                    self.numeric(
                        f"sliding_window-{w}-{mode.name}", self.case(mode, self.fixed_requests(mode), sliding_window=w)
                    )
            for mode in self.variant_modes():  # one metadata, windowed and full layers interleaved
                case = self.case(
                    mode, self.fixed_requests(mode), sliding_window=p.windows[-1], window_even_layers_only=True
                )
                self.numeric(f"sliding_window_interleaved-{mode.name}", case)
        if (
            Feature.SLIDING_WINDOW_POOL in declared
            and Feature.SLIDING_WINDOW in declared
            and self.base.arch == ARCH_MHA
        ):
            self.add_window_pool_checks()
        if Feature.CHUNKED_LOCAL_ATTENTION in declared:
            self.add_chunked_local_checks()
        if Feature.CASCADE in declared and self.base.arch == ARCH_MHA:
            self.add_cascade_checks()
        if Feature.LOGIT_CAP in declared:
            for mode in self.variant_modes():
                self.numeric(f"logit_cap-{mode.name}", self.case(mode, self.fixed_requests(mode), logit_cap=LOGIT_CAP))
        if Feature.SINKS in declared:
            for mode in self.variant_modes():
                self.numeric(f"sinks-{mode.name}", self.case(mode, self.fixed_requests(mode), sinks=True))
        if Feature.LSE_OUTPUT in declared:
            for mode in self.variant_modes():
                self.numeric(f"lse-{mode.name}", self.case(mode, self.fixed_requests(mode), return_lse=True))
        if Feature.CROSS_ATTENTION in declared:
            for mode in self.variant_modes():
                reqs = self.encoder_requests(mode)
                self.numeric(f"cross_attention-{mode.name}", self.case(mode, reqs, cross_attention=True))
                self.numeric(f"encoder_self-{mode.name}", self.case(mode, reqs))
        if Feature.DETERMINISTIC in declared:
            for mode in self.variant_modes():
                self.numeric(
                    f"deterministic-{mode.name}", self.case(mode, self.fixed_requests(mode)), deterministic=True
                )
        combined = self.combined_mode()
        if combined is not None:
            kw = {}
            if Feature.SLIDING_WINDOW in declared:
                kw["sliding_window"] = p.windows[-1]
            if Feature.LOGIT_CAP in declared:
                kw["logit_cap"] = LOGIT_CAP
            if Feature.SINKS in declared:
                kw["sinks"] = True
            if Feature.LSE_OUTPUT in declared:
                kw["return_lse"] = True
            if kw:
                reqs = self.fixed_requests(combined)
                self.numeric(
                    f"combined-{combined.name}", self.case(combined, reqs, page_size=self.page_sizes()[-1], **kw)
                )
        # undeclared features must be refused
        refusals = {
            Feature.SLIDING_WINDOW: dict(sliding_window=3),
            Feature.LOGIT_CAP: dict(logit_cap=LOGIT_CAP),
            Feature.CHUNKED_LOCAL_ATTENTION: dict(attention_chunk_size=3),
            Feature.SINKS: dict(sinks=True),
            Feature.LSE_OUTPUT: dict(return_lse=True),
        }
        mode = self.base.variant_modes[0] if self.base.variant_modes else None
        if mode is None:
            return
        for feature, kw in refusals.items():
            if feature not in declared:
                case = self.case(mode, self.fixed_requests(mode), **kw)
                self.add(f"refuse-{feature.value}", refusal_check(target, case, feature.value), case.describe())
        if (
            Feature.SLIDING_WINDOW in declared
            and Feature.SLIDING_WINDOW_POOL not in declared
            and self.base.arch == ARCH_MHA
        ):
            case = self.case(mode, self.fixed_requests(mode), sliding_window=3, window_pool=True)
            self.add(
                "refuse-sliding_window_pool", refusal_check(target, case, "sliding-window KV pool"), case.describe()
            )
        if Feature.CROSS_ATTENTION not in declared:
            case = self.case(mode, self.encoder_requests(mode), cross_attention=True)
            self.add("refuse-cross_attention", refusal_check(target, case, "cross attention"), case.describe())
        if Feature.CUSTOM_MASK not in declared and ForwardMode.TARGET_VERIFY in self.base.modes:
            case = self.case(
                ForwardMode.TARGET_VERIFY, self.fixed_requests(ForwardMode.TARGET_VERIFY), custom_mask=True
            )
            self.add("refuse-custom_mask", refusal_check(target, case, "custom mask"), case.describe())

    def add_window_pool_checks(self) -> None:
        """Window layers in a `SlidingWindowKVPool` (released prefix keys poisoned), interleaved with full
        layers over one metadata and over several steps; and at a page size > 1."""
        w = self.p.windows[-1]
        for mode in self.variant_modes():
            reqs = self.fixed_requests(mode) + [(self.p.max_prefix // 2, 1 if mode.is_decode() else 2), (5, 1)]
            case = self.case(
                mode,
                reqs,
                sliding_window=w,
                window_even_layers_only=True,
                window_pool=True,
                steps=((0, 2, 4), (1, 3, 5)),
            )
            self.numeric(f"window_pool_interleaved-{mode.name}", case)
        pages = [ps for ps in self.page_sizes() if ps > 1]
        if pages:
            ps = 16 if 16 in pages else pages[0]
            for mode in self.variant_modes():
                case = self.case(mode, self.page_requests(mode, ps), page_size=ps, sliding_window=w, window_pool=True)
                self.numeric(f"window_pool-page_size-{ps}-{mode.name}", case)

    def add_cascade_checks(self) -> None:
        """Cascade steps: requests over one shared cached prefix (their own copies of it poisoned),
        plain, with logit cap / LSE, at the largest page size with a prefix off the page size, and
        window layers interleaved (they run unsplit in the same step)."""
        P, E = self.p.max_prefix, self.p.max_extend
        shared = P // 2 + 1
        for mode in self.variant_modes():
            n = 1 if mode.is_decode() else E
            reqs = [(shared, n), (P, 1 if mode.is_decode() else 2), (shared + 3, n // 2 + 1), (shared, 1)]
            self.numeric(
                f"cascade-{mode.name}",
                self.case(mode, reqs, cascade_prefix=shared, return_lse=Feature.LSE_OUTPUT in self.caps.features),
            )
            ps = self.page_sizes()[-1]
            self.numeric(
                f"cascade-page_size-{ps}-{mode.name}", self.case(mode, reqs, cascade_prefix=shared, page_size=ps)
            )
            kw = dict(logit_cap=LOGIT_CAP) if Feature.LOGIT_CAP in self.caps.features else {}
            if Feature.SLIDING_WINDOW in self.caps.features:
                kw.update(sliding_window=self.p.windows[-1], window_even_layers_only=True)
            if kw:
                self.numeric(f"cascade_mixed_layers-{mode.name}", self.case(mode, reqs, cascade_prefix=shared, **kw))

    def add_chunked_local_checks(self) -> None:
        """Chunked local attention: each profile chunk size (fixed requests, whose new tokens cross chunk
        boundaries); a page size the chunk is not a multiple of; chunked and full layers interleaved over
        one metadata, over several steps of the same pools."""
        p = self.p
        for c in p.chunk_sizes:
            for mode in self.variant_modes():
                self.numeric(
                    f"chunked_local-{c}-{mode.name}", self.case(mode, self.fixed_requests(mode), attention_chunk_size=c)
                )
        pages = [ps for ps in self.page_sizes() if ps > 1]
        if pages:
            ps = 16 if 16 in pages else pages[0]
            c = next((c for c in p.chunk_sizes if c % ps), p.chunk_sizes[0])
            for mode in self.variant_modes():
                case = self.case(mode, self.page_requests(mode, ps), page_size=ps, attention_chunk_size=c)
                self.numeric(f"chunked_local-page_size-{ps}-{mode.name}", case)
        for mode in self.variant_modes():
            reqs = self.fixed_requests(mode) + [(self.p.max_prefix // 2, 1 if mode.is_decode() else 2), (5, 1)]
            case = self.case(
                mode,
                reqs,
                attention_chunk_size=p.chunk_sizes[0],
                chunk_even_layers_only=True,
                steps=((0, 2, 4), (1, 3, 5)),
            )
            self.numeric(f"chunked_local_interleaved-{mode.name}", case)

    def combined_mode(self) -> Optional[ForwardMode]:
        for mode in (ForwardMode.MIXED, ForwardMode.EXTEND, ForwardMode.DECODE):
            if mode in self.base.modes:
                return mode
        return None

    def encoder_requests(self, mode: ForwardMode) -> list[tuple[int, int, int]]:
        """Encoder-decoder requests: new ones (their encoder K/V arrive with the step) and running ones."""
        P, E = self.p.max_prefix, self.p.max_extend
        if mode.is_decode():
            return [(P // 2 + 1, 1, 3), (2, 1, 7), (P, 1, 1)]
        return [(0, E, 5), (P // 2 + 1, E // 2 + 1, 3), (2, 1, 7)]

    def add_graph_checks(self) -> None:
        level = self.caps.cuda_graph
        P, L = self.p.max_prefix, self.p.long_len
        window = self.p.windows[-1] if Feature.SLIDING_WINDOW in self.caps.features else None
        steps = ((0, 1, 2), (3,), (4, 5))
        if level >= CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE and ForwardMode.DECODE in self.base.modes:
            reqs = [(P, 1), (1, 1), (P // 2 + 3, 1), (0, 1), (L - 1, 1), (5, 1)]
            case = self.case(ForwardMode.DECODE, reqs, steps=steps, sliding_window=window, cuda_graph_level=int(level))
            self.add("graph-DECODE", graph_case_check(self.target, case), case.describe())
            if self.p.device.startswith("cuda"):  # hostile-batch section, graph part: a real captured graph
                reqs = [(P, 1), (3, 1), (P // 2 + 1, 1), (1, 1)]
                case = self.case(ForwardMode.DECODE, reqs, cuda_graph_level=int(level))
                self.add("hostile-graph-relocation", graph_relocation_check(self.target, case), case.describe())
        if level >= CudaGraphLevel.UNIFORM_BATCH and ForwardMode.TARGET_VERIFY in self.base.modes:
            D = self.p.max_draft
            reqs = [(P, D), (3, D), (P // 2, D), (1, D), (L - D, D), (6, D)]
            case = self.case(ForwardMode.TARGET_VERIFY, reqs, steps=steps, cuda_graph_level=int(level))
            self.add("graph-TARGET_VERIFY", graph_case_check(self.target, case), case.describe())
        for kv in sorted(FP8_KV_DTYPES & self.caps.kv_dtypes):  # graphs over an fp8 cache: scales baked per layer
            if level >= CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE and ForwardMode.DECODE in self.base.modes:
                reqs = [(P, 1), (1, 1), (P // 2 + 3, 1), (0, 1), (L - 1, 1), (5, 1)]
                case = self.case(ForwardMode.DECODE, reqs, steps=steps, kv_dtype=kv, cuda_graph_level=int(level))
                self.add(f"graph-fp8_kv-{kv}-DECODE", graph_case_check(self.target, case), case.describe())
            if level >= CudaGraphLevel.UNIFORM_BATCH and ForwardMode.TARGET_VERIFY in self.base.modes:
                D = self.p.max_draft
                reqs = [(P, D), (3, D), (P // 2, D), (1, D), (L - D, D), (6, D)]
                case = self.case(ForwardMode.TARGET_VERIFY, reqs, steps=steps, kv_dtype=kv, cuda_graph_level=int(level))
                self.add(f"graph-fp8_kv-{kv}-TARGET_VERIFY", graph_case_check(self.target, case), case.describe())

    def add_negative_checks(self) -> None:
        caps, b, target = self.caps, self.base, self.target
        if b.variant_modes:
            mode = b.variant_modes[-1]
            case = self.case(mode, self.fixed_requests(mode))
            for name, run in bad_input_checks(target, case).items():
                self.add(f"bad_input-{name}", run, case.describe())
        for mode in TOKEN_MODES:
            if mode not in caps.forward_modes:
                case = self.case(mode, self.fixed_requests(mode), custom_mask=caps.supports(Feature.CUSTOM_MASK))
                self.add(
                    f"refuse-mode-{mode.name}",
                    refusal_check(target, case, f"forward mode {mode.name}"),
                    case.describe(),
                )
        if not b.variant_modes:
            return
        mode = b.variant_modes[0]
        reqs = self.fixed_requests(mode)
        for dtype in _DTYPE_ORDER:
            if dtype not in caps.q_dtypes:
                case = self.case(mode, reqs, dtype=dtype, kv_dtype=dtype)
                self.add(
                    f"refuse-dtype-{dtype}", refused_or_correct_check(target, case, f"q dtype {dtype}"), case.describe()
                )
        ps = _undeclared((1, 16, 64, 3, 5), caps.page_sizes)
        if ps is not None:
            case = self.case(mode, self.page_requests(mode, ps), page_size=ps)
            self.add(
                f"refuse-page_size-{ps}", refused_or_correct_check(target, case, f"page size {ps}"), case.describe()
            )
        d = _undeclared((64, 128, 256, 96, 48, 40, 24), caps.head_dims) if b.arch == ARCH_MHA else None
        if d is not None:
            case = self.case(mode, reqs, head_dim=d)
            self.add(f"refuse-head_dim-{d}", refused_or_correct_check(target, case, f"head_dim {d}"), case.describe())
        if b.arch == ARCH_MHA:
            for layout in ("NHD", "HND"):
                if layout not in caps.kv_layouts:
                    case = self.case(mode, reqs, kv_layout=layout)
                    self.add(
                        f"refuse-kv_layout-{layout}",
                        refusal_check(target, case, f"kv_layout {layout}"),
                        case.describe(),
                    )
        for arch in (ARCH_MHA, ARCH_MLA):
            if arch not in caps.archs:
                case = self.case(
                    mode, reqs, arch=arch, head_dim=self.p.head_dim if arch == ARCH_MHA else self.p.mla_head_dim
                )
                self.add(
                    f"refuse-arch-{arch}",
                    refused_or_correct_check(target, case, f"attention arch {arch}"),
                    case.describe(),
                )

    def add_hostile_checks(self) -> None:
        """The hostile-batch section (`attn_core.testing.hostile`), on the declared modes it needs, in both
        validation modes: `hostile-<name>` at "full", `hostile-basic-<name>` at the default "basic"; and
        its engine-path part (`attn_core.testing.hostile_steps`: stale requests, the graph runner, graph
        replays, the draft wrapper)."""
        caps, modes = self.caps, self.base.modes
        other = next((d for d in _DTYPE_ORDER if d != self.base.dtype), None)
        paged = next((ps for ps in self.page_sizes() if ps > 1), None)
        enc = self.encoder_requests(ForwardMode.EXTEND) if Feature.CROSS_ATTENTION in caps.features else None
        cascade = self.p.max_prefix // 2 + 1 if Feature.CASCADE in caps.features and self.base.arch == ARCH_MHA else 0
        for hostile in hostile_cases(modes, caps.features, caps.archs, other, paged, enc, cascade):
            kw = dict(hostile.case)
            reqs = kw.pop("requests", None) or self.fixed_requests(hostile.mode)
            case = self.case(hostile.mode, reqs, **kw)
            for validation in HOSTILE_MODES:
                cid = f"hostile-{hostile.name}" if validation == "full" else f"hostile-{validation}-{hostile.name}"
                check = hostile_check(self.target, case, hostile, validation)
                self.add(cid, check, f"{hostile.what}: {case.describe()}")
        for name, what, mode, check in engine_path_checks(self.target, caps, modes):
            case = self.case(mode, self.fixed_requests(mode), cuda_graph_level=int(caps.cuda_graph))
            self.add(f"hostile-{name}", check(self.target, case), f"{what}: {case.describe()}")

    def add_masked_checks(self) -> None:
        """Masked keys add nothing whatever their values (`attn_core.testing.masked`): Inf / NaN in the
        K / V of new tokens earlier tokens must not see (extend-like modes, verify masks), and with a
        sliding window in the cached keys older than every window (DECODE)."""
        if self.base.kv_dtype in FP8_KV_DTYPES:
            return  # e4m3 has no Inf: the check runs on a 16/32-bit cache
        for mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY):
            if mode in self.base.modes:
                case = self.case(mode, self.fixed_requests(mode))
                self.add(f"masked_nonfinite-{mode.name}", masked_nonfinite_check(self.target, case), case.describe())
        half = "float16"  # kernels often take other paths in 16 bits (tensor-core tiles); bf16: the same paths
        if ForwardMode.EXTEND in self.base.modes and half in self.caps.q_dtypes and half != self.base.dtype:
            kv = half if half in self.caps.kv_dtypes else self.base.kv_dtype
            case = self.case(ForwardMode.EXTEND, self.fixed_requests(ForwardMode.EXTEND), dtype=half, kv_dtype=kv)
            self.add(f"masked_nonfinite-{half}-EXTEND", masked_nonfinite_check(self.target, case), case.describe())
        if Feature.SLIDING_WINDOW in self.caps.features and ForwardMode.DECODE in self.base.modes:
            D = ForwardMode.DECODE
            case = self.case(D, self.fixed_requests(D), sliding_window=self.p.windows[0])
            check = masked_nonfinite_check(self.target, case, window_keys=True)
            self.add("masked_nonfinite-window-DECODE", check, case.describe())

    def add_engine_kv_checks(self) -> None:
        """The engine-owned-memory section (`attn_core.testing.engine_memory`): every engine layout whose pool
        layout the backend declares in `engine_kv_layouts`, several engine-shaped steps each (K/V written by
        attn's write step; on the first layout also by forward, and with a sliding window where declared);
        hostile engines; a pool layout not declared refused at construction."""
        caps, b = self.caps, self.base
        if ARCH_MHA not in caps.archs or b.arch != ARCH_MHA:
            return
        p = self.p
        base = EngineCase(
            "vllm_lbhnc",
            num_q_heads=p.num_q_heads,
            num_kv_heads=p.num_kv_heads,
            head_dim=pick_head_dim(caps, ARCH_MHA, p),
            page_size=engine_page_size(caps.page_sizes),
            dtype=b.dtype,
            device=p.device,
            seed=self.seed,
        )
        declared = [name for name, lay in ENGINE_LAYOUTS.items() if lay.kv_layout in caps.engine_kv_layouts]
        for i, name in enumerate(declared):
            case = replace(base, layout=name, seed=self.seed + i)
            self.add(f"engine_kv-{name}", engine_case_check(self.target, case), case.describe())
        if declared:
            first = replace(base, layout=declared[0])
            case = replace(first, write_by="forward")
            self.add(f"engine_kv-{declared[0]}-forward_writes", engine_case_check(self.target, case), case.describe())
            if caps.supports(Feature.SLIDING_WINDOW):
                case = replace(first, sliding_window=p.windows[-1])
                self.add(
                    f"engine_kv-{declared[0]}-sliding_window", engine_case_check(self.target, case), case.describe()
                )
            for name, run in engine_hostile_checks(self.target, first).items():
                self.add(f"engine_kv-hostile-{name}", run, first.describe())
        for layout in ("NHD", "HND"):
            if layout not in caps.engine_kv_layouts:
                name = next(n for n, lay in ENGINE_LAYOUTS.items() if lay.kv_layout == layout)
                case = replace(base, layout=name)
                self.add(f"refuse-engine_kv-{layout}", engine_refusal_check(self.target, case), case.describe())


def _undeclared(candidates: tuple[int, ...], declared) -> Optional[int]:
    """The first candidate outside `declared` (None: any value is declared, or all candidates are)."""
    if declared is None:
        return None
    return next((c for c in candidates if c not in declared), None)


def build_checks(target: KitTarget, profile: KitProfile, seed: int = 0) -> list[Check]:
    """Every check the kit runs for `target` under `profile`."""
    return PlanBuilder(target, profile, seed).build()


def random_case(target: KitTarget, profile: KitProfile, mode: ForwardMode, draw: Draw, seed: int = 0) -> AttnCase:
    """One random case of `mode` whose composition comes from `draw` (the hypothesis test's source)."""
    return PlanBuilder(target, profile, seed).random_case(ForwardMode.parse(mode), draw, seed)


__all__ = ["Base", "PlanBuilder", "build_checks", "choose_base", "mla_split", "numeric_check", "random_case"]

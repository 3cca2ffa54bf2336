"""The kit's checks of non-causal attention in the paged path: encoder-only layers (`Feature.NON_CAUSAL`,
`AttentionLayer(attn_type="encoder_only")`) and per-request bidirectional spans (`Feature.BIDIRECTIONAL_SPAN`,
`ForwardBatch.bidirectional_spans` on `attn_type="decoder_bidirectional"` layers), each against the
float64 reference in every declared extend-like mode and DECODE, over several steps, at a page size > 1;
spans on plain decoder layers (ignored), a span cut by the step (refused, `InvalidBatchError`, nothing
written); undeclared, each is refused with `UnsupportedFeatureError` before any KV write.

Check ids: `non_causal-<MODE>`, `non_causal-steps-<MODE>`, `non_causal-page_size-<P>-<MODE>`,
`non_causal-lse-<MODE>`, `bidirectional_span-<MODE>`, `bidirectional_span-steps-<MODE>`,
`bidirectional_span-page_size-<P>-<MODE>`, `bidirectional_span-decoder_layers-<MODE>`,
`bad_input-bidirectional_span_cut`, `refuse-non_causal`, `refuse-bidirectional_span`.
"""

from __future__ import annotations

from attn_core.contract.capabilities import Feature
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.negative import _expect, _forward, refusal_check

#: the modes the checks run in, where declared (TARGET_VERIFY without a custom mask: a mask decides alone)
MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


def request_spans(requests) -> tuple[tuple[int, int], ...]:
    """One span per (prefix, extend) request, in turn: over the prefix's tail and every new token, inside
    the new tokens, inside the prefix (no query in it), none, after the request's keys (a later image).

    Example: [(5, 4), (2, 6), (8, 1), (3, 2), (0, 3)] → ((2, 9), (3, 7), (0, 4), (0, 0), (5, 12))."""
    out = []
    for i, r in enumerate(requests):
        p, e = r[0], r[1]
        seq = p + e
        kind = i % 5
        if kind == 0:
            out.append((max(0, p - 3), seq))
        elif kind == 1:
            out.append((p + 1, p + 1 + e - 2) if e >= 3 else (p, seq))
        elif kind == 2:
            out.append((0, p // 2))
        elif kind == 3:
            out.append((0, 0))
        else:
            out.append((seq + 2, seq + 9))
    return tuple(out)


def add_noncausal_checks(builder) -> None:
    """Add the checks of the module docstring to `builder` (an `attn_core.testing.plan.PlanBuilder`)."""
    caps, b, p = builder.caps, builder.base, builder.p
    declared = caps.features
    modes = [m for m in MODES if m in b.modes]
    pages = [ps for ps in builder.page_sizes() if ps > 1]
    page = (16 if 16 in pages else pages[0]) if pages else None
    mode = b.variant_modes[0] if b.variant_modes else None
    extend = ForwardMode.EXTEND if ForwardMode.EXTEND in b.modes else mode
    no_mask = dict(custom_mask=False)

    def requests(m: ForwardMode):
        return builder.fixed_requests(m)

    def steps_requests(m: ForwardMode):
        return requests(m) + [(p.max_prefix // 2, 1 if m.is_decode() else 2), (5, 1)]

    steps = ((0, 2, 4), (1, 3, 5))
    if Feature.NON_CAUSAL in declared:
        for m in modes:
            builder.numeric(f"non_causal-{m.name}", builder.case(m, requests(m), attn_type="encoder_only", **no_mask))
        if extend is not None:
            case = builder.case(extend, steps_requests(extend), attn_type="encoder_only", steps=steps)
            builder.numeric(f"non_causal-steps-{extend.name}", case)
            if page is not None:
                case = builder.case(
                    extend, builder.page_requests(extend, page), page_size=page, attn_type="encoder_only"
                )
                builder.numeric(f"non_causal-page_size-{page}-{extend.name}", case)
            if Feature.LSE_OUTPUT in declared:
                case = builder.case(extend, requests(extend), attn_type="encoder_only", return_lse=True)
                builder.numeric(f"non_causal-lse-{extend.name}", case)
    elif mode is not None:
        case = builder.case(mode, requests(mode), attn_type="encoder_only")
        builder.add(
            "refuse-non_causal",
            refusal_check(builder.target, case, "non-causal (encoder-only) layers"),
            case.describe(),
        )

    bidir = dict(attn_type="decoder_bidirectional")
    if Feature.BIDIRECTIONAL_SPAN in declared:
        for m in modes:
            if m.is_target_verify():
                continue  # spans with drafts: refused under a custom mask; without one, covered by EXTEND-like modes
            reqs = requests(m)
            builder.numeric(f"bidirectional_span-{m.name}", builder.case(m, reqs, spans=request_spans(reqs), **bidir))
        if extend is not None:
            reqs = steps_requests(extend)
            case = builder.case(extend, reqs, spans=request_spans(reqs), steps=steps, **bidir)
            builder.numeric(f"bidirectional_span-steps-{extend.name}", case)
            if page is not None:
                reqs = builder.page_requests(extend, page)
                case = builder.case(extend, reqs, page_size=page, spans=request_spans(reqs), **bidir)
                builder.numeric(f"bidirectional_span-page_size-{page}-{extend.name}", case)
            reqs = requests(extend)
            case = builder.case(extend, reqs, spans=request_spans(reqs))  # decoder layers: spans change nothing
            builder.numeric(f"bidirectional_span-decoder_layers-{extend.name}", case)
            cut = tuple((r[0], r[0] + r[1] + 1) if i == 0 else (0, 0) for i, r in enumerate(reqs))
            case = builder.case(extend, reqs, spans=cut, **bidir)

            def cut_span(case=case) -> str:
                return _expect(
                    "cut",
                    case,
                    (InvalidArgumentError,),
                    "a span cut by the step",
                    lambda env: _forward(builder.target, env),
                )

            builder.add("bad_input-bidirectional_span_cut", cut_span, case.describe())
    elif mode is not None:
        reqs = requests(mode)
        case = builder.case(mode, reqs, spans=request_spans(reqs), **bidir)
        builder.add(
            "refuse-bidirectional_span", refusal_check(builder.target, case, "bidirectional spans"), case.describe()
        )


__all__ = ["MODES", "add_noncausal_checks", "request_spans"]

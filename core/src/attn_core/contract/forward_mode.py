"""What kind of step a batch is. Torch-free so capabilities can name modes."""

from __future__ import annotations

import enum


class ForwardMode(enum.IntEnum):
    """The kind of forward step.

    EXTEND: new tokens (prefill, chunked prefill, prefix hits) attend to the cached prefix and causally to
    each other. DECODE: one new token per request. MIXED: an extend batch that also carries decode
    requests (extend length 1). IDLE: this rank has no tokens (data-parallel padding). TARGET_VERIFY: the
    draft tokens of each request are scored under a per-request custom (tree) mask. DRAFT_EXTEND: the
    draft model extends over the accepted tokens. DUMMY_FIRST: a placeholder batch with no tokens that
    starts an overlapped pipeline. SPLIT_PREFILL: a prefill run in layer slices.
    """

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()
    DUMMY_FIRST = enum.auto()
    SPLIT_PREFILL = enum.auto()

    def __str__(self) -> str:
        """The name: `str(ForwardMode.DECODE) == "DECODE"` (an IntEnum would print 2)."""
        return self.name

    def __format__(self, spec: str) -> str:
        """`f"{mode}"` is the name; a numeric format spec formats the value (`f"{mode:d}"` == "2")."""
        return (
            self.name.__format__(spec) if not spec or spec[-1:] not in "bcdoxXneEfFgG%" else int(self).__format__(spec)
        )

    def is_extend(self) -> bool:
        """Every mode whose new tokens go through the extend (multi-token) path."""
        return self in _EXTEND_LIKE

    def is_decode(self) -> bool:
        return self in _DECODE

    def is_mixed(self) -> bool:
        return self in _MIXED

    def is_idle(self) -> bool:
        return self in _IDLE

    def is_decode_or_idle(self) -> bool:
        return self in _DECODE_OR_IDLE

    def is_target_verify(self) -> bool:
        return self in _TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self in _DRAFT_EXTEND

    def is_dummy_first(self) -> bool:
        return self in _DUMMY_FIRST

    def is_split_prefill(self) -> bool:
        return self in _SPLIT_PREFILL

    def is_extend_or_draft_extend_or_mixed(self) -> bool:
        return self in _EXTEND_DRAFT_EXTEND_MIXED

    def is_no_tokens(self) -> bool:
        """Modes that carry no tokens: the backend returns an empty output."""
        return self in _NO_TOKENS

    def is_cuda_graph(self) -> bool:
        """Modes an engine may run inside a captured CUDA graph."""
        return self in _CUDA_GRAPH

    @classmethod
    def parse(cls, value: str | int | ForwardMode) -> ForwardMode:
        """Accept a member, its name (any case) or its value."""
        if isinstance(value, ForwardMode):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown forward mode {value!r}; expected one of {[m.name for m in cls]}") from None
        return cls(value)


_EXTEND_LIKE = frozenset(
    {
        ForwardMode.EXTEND,
        ForwardMode.MIXED,
        ForwardMode.TARGET_VERIFY,
        ForwardMode.DRAFT_EXTEND,
        ForwardMode.SPLIT_PREFILL,
    }
)
# The predicates test membership of these module-level sets: they run per layer, and looking a member up on
# the enum class (`ForwardMode.DECODE`) costs about 0.1 µs each time, a frozenset lookup a tenth of that.
_DECODE = frozenset({ForwardMode.DECODE})
_MIXED = frozenset({ForwardMode.MIXED})
_IDLE = frozenset({ForwardMode.IDLE})
_DECODE_OR_IDLE = frozenset({ForwardMode.DECODE, ForwardMode.IDLE})
_TARGET_VERIFY = frozenset({ForwardMode.TARGET_VERIFY})
_DRAFT_EXTEND = frozenset({ForwardMode.DRAFT_EXTEND})
_DUMMY_FIRST = frozenset({ForwardMode.DUMMY_FIRST})
_SPLIT_PREFILL = frozenset({ForwardMode.SPLIT_PREFILL})
_EXTEND_DRAFT_EXTEND_MIXED = frozenset({ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED})
_NO_TOKENS = frozenset({ForwardMode.IDLE, ForwardMode.DUMMY_FIRST})
_CUDA_GRAPH = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE})

"""The CUDA-graph bookkeeping every graph-capable backend repeats: which (forward mode, batch size) it
captured, what it keeps for each, and the typed errors around capture and replay.

A backend's `init_cuda_graph_state(max_bs, max_num_tokens)` makes a `GraphCaptures` (which checks the two
sizes); `capture_cuda_graph_metadata(step)` asks `check_capture(step)` (a mode the backend does not
capture, a batch past the sizes) before building anything, then `add`s what it built (its metadata, its
plans over the graph's buffers); `replay_cuda_graph_metadata(step)` gets it back with `captured(step)`
(a typed error for a size never captured, or for new tokens other than the captured count) and may
`update` it. `captures_of(graphs, name)` refuses a capture or replay before `init_cuda_graph_state`.
The entries are the backend's own (any type); nothing here touches the device.

Worked example:
    graphs = GraphCaptures("mybackend", max_bs=8, max_num_tokens=32)       # in init_cuda_graph_state
    graphs.check_capture(step)                                             # DECODE, bs 4, 4 tokens: fine
    graphs.add(step, metadata)                                             # capture
    metadata = graphs.captured(replay_step)                                # a replay of DECODE bs 4
    graphs.captured(CudaGraphStep(ForwardMode.DECODE, bs=2, ...))          # InvalidArgumentError("bs", ...)
"""

from __future__ import annotations

from typing import Generic, Iterable, Optional, TypeVar

from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep

E = TypeVar("E")

#: the modes graph-capable backends capture (`CudaGraphLevel.UNIFORM_BATCH` and the decode-only levels)
DECODE_AND_VERIFY = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY})


class GraphCaptures(Generic[E]):
    """The graphs one backend (`name`, for its errors) captured for batches of up to `max_bs` requests and
    `max_num_tokens` new tokens, and its entry for each (see the module docstring). `modes`: the forward
    modes it captures (default DECODE and TARGET_VERIFY).

    Raises `InvalidArgumentError` naming "max_bs/max_num_tokens" unless max_num_tokens >= max_bs >= 1."""

    def __init__(self, name: str, max_bs: int, max_num_tokens: int, modes: Iterable[ForwardMode] = DECODE_AND_VERIFY):
        if max_bs < 1 or max_num_tokens < max_bs:
            raise InvalidArgumentError(
                "max_bs/max_num_tokens", "max_bs >= 1 and max_num_tokens >= max_bs", (max_bs, max_num_tokens)
            )
        self.name = name
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.modes = frozenset(modes)
        self._entries: dict[tuple[ForwardMode, int], tuple[int, E]] = {}

    def check_capture(self, step: CudaGraphStep) -> None:
        """Typed errors for a capture this state cannot hold: a mode outside `modes`
        (`UnsupportedFeatureError`), a batch past max_bs requests or max_num_tokens tokens
        (`InvalidArgumentError` naming "bs/num_tokens")."""
        if step.forward_mode not in self.modes:
            names = " and ".join(sorted(m.name for m in self.modes))
            raise UnsupportedFeatureError(self.name, f"CUDA graphs for {step.forward_mode.name} ({names} only)")
        num_tokens = step.num_tokens if step.num_tokens is not None else step.bs
        if step.bs > self.max_bs or num_tokens > self.max_num_tokens:
            raise InvalidArgumentError(
                "bs/num_tokens",
                f"bs <= {self.max_bs} and num_tokens <= {self.max_num_tokens} (init_cuda_graph_state)",
                (step.bs, step.num_tokens),
            )

    def add(self, step: CudaGraphStep, entry: E) -> E:
        """Keep `entry` for `step`'s (mode, batch size) and its new-token count (replacing an earlier
        capture of the same size); returns `entry`."""
        num_tokens = step.num_tokens if step.num_tokens is not None else step.bs
        self._entries[(step.forward_mode, step.bs)] = (num_tokens, entry)
        return entry

    def captured(self, step: CudaGraphStep) -> E:
        """The entry captured for a replay's (mode, batch size). `InvalidArgumentError` naming "bs" for a
        size not captured in that mode, naming "num_tokens" when the replay gives another new-token count
        than the capture (None: the captured one)."""
        hit = self._entries.get((step.forward_mode, step.bs))
        if hit is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {step.forward_mode.name}", step.bs)
        num_tokens, entry = hit
        if step.num_tokens not in (None, num_tokens):
            raise InvalidArgumentError("num_tokens", f"{num_tokens} as captured for bs={step.bs}", step.num_tokens)
        return entry

    def num_tokens(self, step: CudaGraphStep) -> int:
        """The new-token count captured for `step`'s (mode, batch size) (`captured`'s errors otherwise)."""
        self.captured(step)
        return self._entries[(step.forward_mode, step.bs)][0]

    def update(self, step: CudaGraphStep, entry: E) -> E:
        """Replace the entry of a captured (mode, batch size), keeping its token count; returns `entry`."""
        num_tokens = self.num_tokens(step)
        self._entries[(step.forward_mode, step.bs)] = (num_tokens, entry)
        return entry


def captures_of(graphs: Optional[GraphCaptures[E]], name: str) -> GraphCaptures[E]:
    """`graphs`, or `InvalidArgumentError` naming "init_cuda_graph_state" when the backend `name` has none
    yet (a capture or replay before `init_cuda_graph_state`)."""
    if graphs is None:
        raise InvalidArgumentError("init_cuda_graph_state", f"called before CUDA-graph capture/replay ({name})", None)
    return graphs

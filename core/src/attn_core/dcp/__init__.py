"""Decode context parallelism: a request's KV interleaved over the ranks of a group, decode and
speculative-verify attention merged across them. `layout` (where tokens live), `requests` (per-rank
allocation and steps, eager or graph-shaped), `attention` (the sharded attention step: DECODE eager or
inside a CUDA graph, TARGET_VERIFY eager)."""

from attn_core.dcp.attention import EXCHANGES, dcp_attention, dcp_decode_attention, merge_partials
from attn_core.dcp.layout import DcpLayout
from attn_core.dcp.requests import DCP_GRAPH_INPUTS, DCP_LOCAL_MASK, DcpRequestPool, DcpStep, build_dcp_step

__all__ = [
    "DCP_GRAPH_INPUTS",
    "DCP_LOCAL_MASK",
    "EXCHANGES",
    "DcpLayout",
    "DcpRequestPool",
    "DcpStep",
    "build_dcp_step",
    "dcp_attention",
    "dcp_decode_attention",
    "merge_partials",
]

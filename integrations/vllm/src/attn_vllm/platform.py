"""`AttnCpuPlatform`: vLLM's CPU platform, except that it hands out the CUSTOM attention backend when
asked for it (vLLM's own CPU platform replaces any requested backend with CPU_ATTN)."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum


class AttnCpuPlatform(CpuPlatform):
    """`CpuPlatform` with `AttentionBackendEnum.CUSTOM` honoured (attn-vllm registers it)."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if selected_backend == AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
            return AttentionBackendEnum.CUSTOM.get_path()
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

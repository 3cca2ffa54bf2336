"""Kernel tile choices and the decode split policy, picked per head dim and device (no autotuning).

Hand-picked for Hopper (H100/H200) on the docs/design.md §8 shapes; tiny tiles under the interpreter keep
CPU tests fast. Deterministic mode takes the same tiles (they depend on the model, never the batch)
and a fixed split policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.memory.fp8 import is_fp8
from attn_triton.kernels.decode import DecodeConfig
from attn_triton.kernels.extend import ExtendConfig
from attn_triton.kernels.mla_decode import MLAConfig, gluon_hopper_available
from attn_triton.kernels.verify import VerifyConfig

#: fp8 (e4m3) cache, fp16/bf16 q, head dim <= 128. Why: a key tile is half the bytes of bf16's, and the kernel
#: turns each byte into fp16 with 1.5 integer ops (`e4m3_as_f16`; V read as int32 words) before the same two
#: fp16 dots, so what bounds a program is its latency: the row is bound by the bytes each SM keeps in flight.
#: H100 sweep (docs/dev/perf-notebook.md, "fp8 KV cache decode", 16 tiles in three runs): 64-key tiles with 2 warps
#: and 3 stages were fastest (225-229 us at bs64 x 4096 against 254-256 us for the former 4-warp, 2-stage tile
#: and 247-250 us for FlashInfer's fp8 decode): as compiled for sm_90 by Triton 3.6, 192 registers and 54 KiB of
#: shared memory, 4 programs an SM, each with three 64-key K/V tiles in flight per 2 warps; a fourth stage
#: (70 KiB, 3 programs an SM) or 128-key tiles lose 30-50 %. (Triton 3.9 lays this tile's K out with some
#: byte-wise shared-memory reads, the 4-warp tile with none; the timings are Triton 3.6's.)
FP8_DECODE_CONFIG = DecodeConfig(block_n=64, block_h=16, num_warps=2, num_stages=3)


@dataclass(frozen=True)
class SplitPolicy:
    """Decode splits: request r gets clamp(ceil(len_r / min_split_len), 1, max_splits) splits.

    `max_splits` is chosen per batch size from the device's multiprocessor count so that
    bs * kv_head_blocks * max_splits programs fill about `waves` waves; deterministic mode fixes it.
    With `ctas_per_sm` > 0 (the MLA kernel's `MLAConfig.ctas_per_sm`) the count comes from
    `wave_splits` instead (deterministic mode keeps its fixed splits either way).
    """

    min_split_len: int = 256
    waves: float = 2.0
    cap: int = 32
    deterministic_max_splits: int = 16
    deterministic_min_split_len: int = 512

    def max_splits(
        self, bs: int, programs_per_request: int, num_sms: int, deterministic: bool, ctas_per_sm: int = 0
    ) -> int:
        if deterministic:
            return self.deterministic_max_splits
        if ctas_per_sm > 0:
            return wave_splits(bs * programs_per_request, num_sms * ctas_per_sm, self.cap, self.waves)
        want = int(num_sms * self.waves) // max(1, bs * programs_per_request)
        return max(1, min(self.cap, want))

    def min_len(self, deterministic: bool) -> int:
        return self.deterministic_min_split_len if deterministic else self.min_split_len


#: splitting at all must shorten the estimated kernel time by more than this share (splits add the merge
#: launch, ~15 us at bs64 x 128 heads on an H100, and one more q load and finalize per program)
SPLIT_GAIN = 0.05


def wave_splits(programs: int, slots: int, cap: int, waves: float = 2.0) -> int:
    """Splits per request for `programs` programs (requests x head blocks) on a GPU that holds `slots`
    programs at once (multiprocessors x programs per SM): at most `cap`, and at most as many as make
    about `waves` waves of programs (more, shorter programs pay their q load, finalize and merge rows
    for little).

    Each program of s splits does 1/s of its request's keys, so the launch takes about
    ceil(programs * s / slots) / s waves of unsplit work. One split (no merge launch) is kept unless the
    best estimate is more than SPLIT_GAIN below its own; otherwise the fewest splits reaching the best
    estimate win. Unlike the fill-two-waves rule it sees the
    tail of a partial wave: 128 programs on 132 slots keep one split (SplitPolicy takes 2, i.e. 256
    programs in 1.94 waves plus the merge).

    >>> wave_splits(128, 132, 32)  # bs64 x 2 head blocks on an H100, 1 program per SM
    1
    >>> wave_splits(2, 132, 32)  # bs1: as many splits as allowed
    32
    >>> wave_splits(64, 132, 32)  # bs32: 2 splits make 128 programs, one wave
    2
    >>> wave_splits(80, 132, 32)  # bs40: 3 splits (240 programs, 2 waves of a third of the keys)
    3
    >>> wave_splits(256, 264, 32)  # bs64 x 4 head blocks of 32 rows (the SM90 default), 2 per SM
    1
    """
    slots = max(1, slots)

    def cost(s: int) -> float:
        return -(-programs * s // slots) / s

    most = max(1, min(cap, -(-int(waves * slots) // max(1, programs))))
    best = min(range(1, most + 1), key=lambda s: (cost(s), s))
    return best if cost(best) < cost(1) * (1.0 - SPLIT_GAIN) else 1


def decode_config(
    head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    mla: bool,
    kv_dtype: Optional[torch.dtype] = None,
) -> DecodeConfig:
    """Stage-1 tiles of the split decode kernel for q `dtype` over a `kv_dtype` cache (None: `dtype`)."""
    if device.type != "cuda":
        return DecodeConfig(block_n=16, block_h=16, num_warps=1, num_stages=1)
    if (
        kv_dtype is not None
        and is_fp8(kv_dtype)
        and not mla
        and dtype != torch.float32
        and max(head_dim, v_head_dim) <= 128
    ):
        return FP8_DECODE_CONFIG
    if mla:
        return DecodeConfig(block_n=16 if dtype == torch.float32 else 32, block_h=16, num_warps=4, num_stages=2)
    if max(head_dim, v_head_dim) > 128:
        return DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2)
    if dtype == torch.float32:
        return DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2)
    # H200 sweep (docs/dev/perf-notebook.md): 128-key tiles, 8 warps, 3 stages won on every docs/design.md §8 decode row
    return DecodeConfig(block_n=128, block_h=16, num_warps=8, num_stages=3)


def hopper_kernels_available(device: torch.device) -> bool:
    """Whether the Gluon Hopper kernels (`kernels/mla_wgmma.py`, `kernels/extend_wgmma.py`) can run on
    `device`: a CUDA (not ROCm) GPU of compute capability 9.x, with Triton >= 3.6 (`gluon_hopper_available`)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] == 9
        and gluon_hopper_available()
    )


def extend_config(head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device, mla: bool) -> ExtendConfig:
    """Tiles of the extend kernels on `device` (see `extend_config_for`)."""
    if device.type != "cuda":
        return ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)  # interpreter: small and quick
    return extend_config_for(head_dim, v_head_dim, dtype, mla, hopper_kernels_available(device))


def extend_config_for(head_dim: int, v_head_dim: int, dtype: torch.dtype, mla: bool, hopper: bool) -> ExtendConfig:
    """Tiles of the extend kernels on a CUDA GPU, `hopper` when the Gluon Hopper kernels can run there
    (`hopper_kernels_available`).

    >>> extend_config_for(128, 128, torch.bfloat16, False, True).wgmma_block_n  # the Hopper kernel's 128-key tiles
    128
    >>> extend_config_for(128, 128, torch.bfloat16, False, False).wgmma_block_n  # the portable kernel only
    0
    """
    if mla:
        small = dtype == torch.float32
        return ExtendConfig(block_m=16 if small else 32, block_n=16 if small else 32, num_warps=4, num_stages=1)
    if max(head_dim, v_head_dim) > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if dtype == torch.float32:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    # H200 sweep (docs/dev/perf-notebook.md): 128x64 tiles with 4 warps, 3 stages were fastest on the extend rows;
    # H100 sweep (docs/dev/perf-notebook.md, 2026-11-23): lazy rescaling with slack 4 (2^4 bounds p in the bf16/fp16
    # P operand) took 1-4 % off every extend row (the 128x128 fp32 accumulator multiply of most tiles)
    # SM90 (`hopper`): the launches the Hopper kernel takes (kernels/extend_wgmma.py, `extend.uses_wgmma`) run on it
    # with 128-key tiles in 3 buffers (the most that fit beside q): on the H100, in CUDA graphs, 8-12 % faster than
    # the portable kernel on every extend row, and faster than its 64-key x 4 tiles (docs/dev/perf-notebook.md,
    # "The Hopper extend kernel with a producer partition and TMA"); the other launches keep the portable tiles
    # the (consumer, producer) register split: 208 / 88 a thread beat 224 / 56 and 216 / 72 on every extend row
    # of an H100 sweep (4-10 %; docs/dev/perf-notebook.md, "The Hopper extend kernel's register split")
    wgmma_block_n = 128 if hopper else 0
    return ExtendConfig(
        block_m=128,
        block_n=64,
        num_warps=4,
        num_stages=3,
        lazy_rescale=4,
        wgmma_block_n=wgmma_block_n,
        wgmma_stages=3,
        wgmma_regs=208,
    )


def mla_config(dtype: torch.dtype, device: torch.device) -> MLAConfig:
    """Tiles of the absorbed-MLA kernel (`kernels/mla_decode.py`) on `device` (see `mla_config_for`)."""
    if device.type != "cuda":
        return MLAConfig(block_h=16, block_n=16, num_warps=1, num_stages=1)  # interpreter: small and quick
    major = torch.cuda.get_device_capability(device)[0]
    return mla_config_for(dtype, major, hip=torch.version.hip is not None)


def mla_config_for(dtype: torch.dtype, major: int, hip: bool = False) -> MLAConfig:
    """Tiles of the absorbed-MLA kernel for a GPU of compute capability `major` (ROCm: `hip`).

    Why these shapes: the q heads (and, in verify, the draft tokens) go on the M dimension of the
    dots, so every latent tile loaded is reused by all BLOCK_H rows. The bound is the register file: a
    program keeps a float32 accumulator of BLOCK_H x kv_lora_rank (64 x 512 = 128 KiB), and the q block
    (nope 512 + rope 64 channels) and the BLOCK_N x 576 latent tiles (64 x 576 bf16 = 72 KiB) take the
    shared memory.

    SM90 in 16 bits runs the Hopper kernel (`kernels/mla_wgmma.py`, Gluon): 64 rows, two warp-specialized
    warpgroups that take 32-key tiles in turn (each computes its tiles' whole score blocks and softmax
    steps while the other's tensor-core work runs) and split the accumulator by columns (128 registers
    a thread, no spills); q and four latent buffers in shared memory (221 KiB: 1 program per SM, hence
    the wave-aware splits for 1 program per SM). On an H100 (docs/dev/perf-notebook.md, "The warp-specialized Hopper
    MLA kernel"; CUDA graphs, attn-triton over FlashInfer's MLA run at 128 heads, 512 + 64, bf16, page 64)
    it took 0.93 / 1.28 / 1.25 / 1.26 x at bs1 x 8192 / bs64 x 4096 / bs128 x 2048 / verify with 4
    drafts, where its predecessor (64 x 64-key tiles, both warpgroups in the same phase, the scores
    split by keys) took 1.02 / 1.67 / 1.61 / 1.56 and the portable kernel's best tiles (32 x 64 keys, 4
    warps, 3 stages, 2 programs per SM, lazy rescaling) 1.35 / 2.81 / 2.90 / 2.96: Triton's own layouts
    put those 32 rows on Ampere-style MMAs with q in registers (255 registers and spills), and at 64 rows
    computed every score in both warpgroups.
    float32, other GPUs and Triton < 3.6 (no Gluon Hopper API) use the portable kernel; other GPUs' tiles
    are reasoned, not swept.

    >>> mla_config_for(torch.bfloat16, 9)
    MLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=4, ctas_per_sm=1, lazy_rescale=0, wgmma=True)
    >>> mla_config_for(torch.bfloat16, 8).block_h
    32
    """
    if dtype == torch.float32:  # twice the bytes per tile, no bf16/fp16 tensor-core path: smaller tiles
        return MLAConfig(block_h=32, block_n=16, num_warps=4, num_stages=2)
    if major == 9 and not hip:
        # SM90: the Hopper kernel, 1 program of 8 warps per SM and the decode splits for that occupancy
        # (one split, no merge launch, once the batch fills the GPU)
        if gluon_hopper_available():
            return MLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=4, ctas_per_sm=1, wgmma=True)
        # Triton < 3.6: the portable kernel's best tiles of the H100 sweep (2 programs of 4 warps per SM,
        # lazy rescaling with slack 8)
        return MLAConfig(block_h=32, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, lazy_rescale=8)
    # SM80/SM89 and other GPUs: mma's M is 16, so 32 rows already use the tensor cores; the 32 x 512
    # accumulator over 4 warps is 128 registers per thread, leaving room for the q block and 2 stages
    # of a 32-row latent tile within Ampere's shared memory
    return MLAConfig(block_h=32, block_n=32, num_warps=4, num_stages=2)


def verify_config(
    head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device, sm_major: Optional[int] = None
) -> VerifyConfig:
    """Tiles of the MHA/GQA verify kernel (rows = q heads of one KV head x draft tokens), by the CUDA
    compute capability's major version (`sm_major`; asked of the device when None).

    The kernel streams each request's K/V once per KV head with a 16..64-row tile, the shape of the
    decode kernel's GQA tile (memory-bound, small M), so the GPU choices start from the decode sweep.
    On an H100 they read K/V at 99 % / 83 % of the copy bandwidth with 4 / 8 drafts (docs/dev/perf-notebook.md); no
    other verify tile has been swept (`benchmarks/triton_vs_peers.py --only verify --verify-configs`)."""
    if device.type != "cuda":
        # interpreter: 16-row tiles make the tests cut groups into head blocks; tiny tiles keep CPU runs fast
        return VerifyConfig(block_m_max=16, block_n=16, num_warps=1, num_stages=1)
    wide = max(head_dim, v_head_dim) > 128 or dtype == torch.float32
    if sm_major is None:  # ROCm reports gfx9xx as major 9 with 64 KiB of LDS: it takes the small tiles below
        sm_major = 0 if torch.version.hip else torch.cuda.get_device_capability(device)[0]
    if sm_major >= 9:
        # SM90 (228 KiB shared memory): 3 stages of 128-key K and V tiles (64 KiB a stage at d128 bf16; 161 KiB
        # in all with 64 rows, as compiled for sm_90), the decode sweep's winner; 64 rows hold GQA 8 x 8 drafts
        # or 4 x 16 in one program
        if wide:
            return VerifyConfig(block_m_max=64, block_n=64, num_warps=4, num_stages=2)
        return VerifyConfig(block_m_max=64, block_n=128, num_warps=8, num_stages=3)
    # SM80/SM86 and older (100-164 KiB shared memory; ROCm 64 KiB): 64-key tiles, 2 stages (32 KiB a stage at
    # d128 bf16; 57 KiB in all as compiled for sm_80, test_triton_compile_sm90.py)
    if wide:
        return VerifyConfig(block_m_max=32, block_n=32, num_warps=4, num_stages=2)
    return VerifyConfig(block_m_max=64, block_n=64, num_warps=4, num_stages=2)

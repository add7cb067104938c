"""ops.block_attention: block-causal attention of a chunk of new tokens against a per-row KV cache.

One op serves every sampler forward: prefill of whole prompt blocks (cache empty), one denoising block
(chunk = the current block), and a finished block folded with the next one (chunk = 2 blocks). It first
writes the chunk's K/V into the cache at each row's offset (lengths are NOT advanced: the caller commits
once a block is final), then attends:

    query i of row b (absolute position p_i = cache_lens[b] + i, i < chunk_lens[b]) sees
      every cached key (position < cache_lens[b]) and
      chunk key j < chunk_lens[b] when p_j // block_size <= p_i // block_size.

Rows i >= chunk_lens[b] of the output are zero.

On CUDA tensors in bf16/fp16 with head_dim 64 or 128 the op runs `_C.block_attention` (csrc/block_attn.cu,
kernels/block_attn.cuh): one launch writes the chunk into the cache and attends with tensor cores, splitting
the key range over CTAs (flash-decoding, plus a log-sum-exp merge launch) when batch x kv heads cannot fill
the GPU. It reads no length on the host, so it can be captured in a CUDA graph; a row whose lengths are out
of range writes nothing and outputs zeros (the host check, `check_lengths`, raises first unless turned off).
Other dtypes / head dims, CPU tensors and cache views the kernel cannot move in 16-byte units (kernel_supports) use
the reference.

The kernel has two tensor-core variants of the same algorithm: "mma" (mma.sync, per warp; measured on an H100)
and "wgmma" (sm_90a warpgroup MMAs with K/V read straight from shared memory, for the compute-bound shapes:
block 32 at large batch, prefill). "auto" is "mma" until the wgmma variant has run on hardware: pick one with
the `variant` argument or LRF_BLOCK_ATTN_VARIANT=mma|wgmma|auto in the environment.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ._common import (FLOAT_DTYPES, aligned16, check_float, check_int, check_no_overlap, check_tensor, cuda_kernel,
                      host_checks_allowed)
from .kv_cache import kv_cache_write, kv_cache_write_reference

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_HEAD_DIMS = (64, 128)
VARIANTS = {"auto": 0, "mma": 1, "wgmma": 2}  # the `variant` codes of _C.block_attention
VARIANT_ENV = "LRF_BLOCK_ATTN_VARIANT"  # the variant when the caller names none


def kernel_variant(variant: str | None = None) -> int:
    """The `_C.block_attention` variant code of `variant` (None: $LRF_BLOCK_ATTN_VARIANT, default "auto")."""
    name = variant if variant is not None else os.environ.get(VARIANT_ENV, "auto")
    if name not in VARIANTS:
        src = "variant" if variant is not None else VARIANT_ENV
        raise ValueError(f"{src} must be one of {', '.join(VARIANTS)}, got {name!r}")
    return VARIANTS[name]


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None) -> bool:
    """True when `_C.block_attention` handles q's dtype and head dim and the caches' layout (it still needs CUDA
    tensors and a CUDA build). The kernel moves cache rows in 16-byte units and writes them in place, so a cache
    view whose data pointer or byte strides are not multiples of 16 (or whose last dim is strided) takes the
    reference instead (q / k / v the launcher copies when misaligned: they are only read)."""
    if q.dtype not in KERNEL_DTYPES or q.shape[-1] not in KERNEL_HEAD_DIMS:
        return False
    return all(c is None or aligned16(c) for c in (k_cache, v_cache))


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    chunk_lens: torch.Tensor,
    block_size: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Pure-PyTorch block attention (writes the caches, then masked SDPA over them). Shapes as `block_attention`.

    On CUDA the cache write goes through the kv_cache_write op (its kernel, or without kernels its reference:
    neither syncs with the host), so this reference path can still be captured in a CUDA graph.
    """
    if q.is_cuda:
        kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens, check_lengths=False)
    else:
        kv_cache_write_reference(k_cache, v_cache, k, v, cache_lens, chunk_lens)
    bsz, c, hq, d = q.shape
    hkv = k_cache.shape[2]
    cap = k_cache.shape[1]
    cl = cache_lens.to(torch.int64).view(bsz, 1, 1)
    nl = chunk_lens.to(torch.int64).view(bsz, 1, 1)
    # a row whose lengths are out of range was not written (kv_cache_write): it attends to nothing and its output
    # is zero, as the kernel's (reached only with check_lengths=False)
    row_ok = (cl >= 0) & (nl >= 0) & (nl <= c) & (cl + nl <= cap)  # [B, 1, 1]
    if not q.is_cuda and bsz:  # only the filled prefix matters; on CUDA keep shapes static (no host sync)
        cap = max(1, min(cap, int((cl + nl).max())))
    i = torch.arange(c, device=q.device).view(1, c, 1)
    t = torch.arange(cap, device=q.device).view(1, 1, cap)
    p = cl + i  # [B, C, 1] absolute query positions
    allow = row_ok & (i < nl) & ((t < cl) | ((t < cl + nl) & (t // block_size <= p // block_size)))  # [B, C, cap]
    kc = k_cache[:, :cap].transpose(1, 2)  # [B, Hkv, cap, D]
    vc = v_cache[:, :cap].transpose(1, 2)
    if hq != hkv:
        kc = kc.repeat_interleave(hq // hkv, dim=1)
        vc = vc.repeat_interleave(hq // hkv, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=allow[:, None], scale=softmax_scale)
    o = o.transpose(1, 2)  # [B, C, Hq, D]
    return torch.where(allow.any(-1)[..., None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))


@torch.library.custom_op("lightningrl_fast::block_attention", mutates_args=("k_cache", "v_cache"))
def _block_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    chunk_lens: torch.Tensor,
    block_size: int,
    softmax_scale: float,
    variant: int = 0,
) -> torch.Tensor:
    kernel = cuda_kernel("block_attention", q, k_cache) if kernel_supports(q, k_cache, v_cache) else None
    if kernel is not None:
        return kernel(q, k, v, k_cache, v_cache, cache_lens, chunk_lens, block_size, softmax_scale, 0, variant)
    return block_attention_reference(q, k, v, k_cache, v_cache, cache_lens, chunk_lens, block_size, softmax_scale)


@_block_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, cache_lens, chunk_lens, block_size, softmax_scale, variant=0):
    return torch.empty_like(q)


def check_cache_lengths(cache_lens: torch.Tensor, chunk_lens: torch.Tensor, chunk: int, capacity: int) -> None:
    """Raise ValueError unless 0 <= cache_lens, 0 <= chunk_lens <= chunk and cache_lens + chunk_lens <=
    capacity for every row (reads the lengths on the host: a device sync for CUDA tensors)."""
    if bool(((cache_lens < 0) | (chunk_lens < 0) | (chunk_lens > chunk)).any()):
        raise ValueError(f"cache_lens/chunk_lens must be >= 0 and chunk_lens <= chunk length {chunk}")
    over = cache_lens.to(torch.int64) + chunk_lens > capacity
    if bool(over.any()):
        row = int(over.nonzero()[0, 0])
        raise ValueError(
            f"row {row}: cache_lens + chunk_lens = {int(cache_lens[row]) + int(chunk_lens[row])} exceeds the KV cache "
            f"capacity {capacity}"
        )


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    chunk_lens: torch.Tensor,
    block_size: int,
    softmax_scale: float | None = None,
    check_lengths: bool | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """Block-causal attention of a chunk against the KV cache; writes the chunk's K/V into the cache.

    q [B, C, Hq, D]; k, v [B, C, Hkv, D]; k_cache, v_cache [B, L, Hkv, D] (all one float dtype, one device);
    cache_lens, chunk_lens [B] int32 with cache_lens + chunk_lens <= L; Hq % Hkv == 0.
    Returns [B, C, Hq, D] in q's dtype (rows beyond chunk_lens are zero). softmax_scale (finite) defaults to D^-0.5.
    The caches are written in place: they must not share memory with each other or with q / k / v, nor have rows
    that share memory (an expanded view): ValueError.
    check_lengths: validate the lengths on the host and raise ValueError (a device sync for CUDA lengths);
    None = unless a CUDA graph is being captured or torch.compile traces. Hot loops that build the lengths
    themselves (the sampler) pass False; the kernel then zeroes the output of an out-of-range row.
    variant: the CUDA kernel's tensor-core path, "auto" / "mma" / "wgmma" (sm_90 only); None reads
    $LRF_BLOCK_ATTN_VARIANT (default "auto"). The reference path ignores it.
    """
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    code = kernel_variant(variant)
    bsz, c, hq, d = q.shape
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=dev)
    hkv, cap = k_cache.shape[2], k_cache.shape[1]
    check_tensor("k_cache", k_cache, shape=(bsz, None, None, d))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(q.dtype,), device=dev)
    check_tensor("k", k, shape=(bsz, c, hkv, d), dtypes=(q.dtype,), device=dev)
    check_tensor("v", v, shape=(bsz, c, hkv, d), dtypes=(q.dtype,), device=dev)
    check_tensor("cache_lens", cache_lens, shape=(bsz,), dtypes=(torch.int32,), device=dev)
    check_tensor("chunk_lens", chunk_lens, shape=(bsz,), dtypes=(torch.int32,), device=dev)
    if hq == 0 or hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the cache's kv heads ({hkv})")
    if d == 0:
        raise ValueError(f"q must have a positive head_dim, got shape {list(q.shape)}")
    block_size = check_int("block_size", block_size, lo=1)
    scale = check_float("softmax_scale", softmax_scale) if softmax_scale is not None else d**-0.5
    check_no_overlap([("k_cache", k_cache), ("v_cache", v_cache)], [("q", q), ("k", k), ("v", v)])
    cache_lens, chunk_lens = cache_lens.contiguous(), chunk_lens.contiguous()  # the kernel reads them densely
    if check_lengths is None:
        check_lengths = host_checks_allowed(dev)
    if check_lengths:
        check_cache_lengths(cache_lens, chunk_lens, c, cap)
    return _block_attention_op(q, k, v, k_cache, v_cache, cache_lens, chunk_lens, block_size, scale, code)

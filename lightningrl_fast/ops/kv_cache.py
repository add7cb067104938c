"""KV-cache write: copy each row's new chunk of keys/values into its cache, in place.

The pattern every op module follows (ARCHITECTURE.md):
  * `kv_cache_write_reference` — pure PyTorch, any device and float dtype: the test oracle and the CPU path.
  * `kv_cache_write` — the public function: validates inputs, then calls the custom op
    `torch.ops.lightningrl_fast.kv_cache_write`.
  * the custom op dispatches to `_C.kv_cache_write` (csrc/kv_cache.cu) for CUDA tensors when the extension
    has its CUDA kernels, else to the reference; `register_fake` makes it traceable (torch.compile).

Out-of-range lengths (a row with cache_lens + chunk_lens > L, or a negative length, or chunk_lens > C) are
an error. Reading CUDA lengths on the host costs a device sync, which a CUDA graph capture forbids and a
decode loop should not pay per layer, so the check has two layers:
  * host check (raises ValueError): by default whenever it is allowed, i.e. not while capturing a CUDA
    graph and not while torch.compile traces; `check_lengths=False` turns it off for hot loops.
  * device safety net, always on: a bad row writes nothing (never out of bounds) and sets
    `error_flag[0] = 1` when an int32 `error_flag` tensor is given; the caller checks it at its own sync
    point (e.g. once per decoding step).
"""

from __future__ import annotations

import torch

from lightningrl_fast.ops._common import (FLOAT_DTYPES, check_no_overlap, check_tensor, cuda_kernel, host_checks_allowed,
                                          same_device)

__all__ = ["kv_cache_write", "kv_cache_write_reference"]


def kv_cache_write_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_lens: torch.Tensor,
    chunk_lens: torch.Tensor,
    error_flag: torch.Tensor | None = None,
) -> None:
    """Reference of `kv_cache_write` (same arguments; no input validation). Vectorized over the batch, two ways:
    on CUDA at static shapes with no host synchronization (`_write_static`: a decode step on the reference ops can
    be captured in a CUDA graph), elsewhere only the pairs that copy (`_write_pairs`: a few times faster on the
    CPU, where a host read costs nothing)."""
    start = cache_lens.to(torch.int64)
    n = chunk_lens.to(torch.int64)
    row_ok = (start >= 0) & (n >= 0) & (n <= k.shape[1]) & (start + n <= k_cache.shape[1])
    (_write_static if k_cache.is_cuda else _write_pairs)(k_cache, v_cache, k, v, start, n, row_ok)
    if error_flag is not None:  # element 0 = index (0, ..., 0), the kernel's data_ptr(), in any layout (view(-1) fails
        # on a non-contiguous flag)
        error_flag.as_strided((1,), (1,)).masked_fill_((~row_ok).any().view(1), 1)


def _write_pairs(k_cache, v_cache, k, v, start, n, row_ok) -> None:
    """The (row, token) pairs that copy, gathered with one `nonzero` (a host sync on CUDA)."""
    take = (torch.arange(k.shape[1], device=k.device) < n[:, None]) & row_ok[:, None]  # [B, C]
    b_idx, t_idx = take.nonzero(as_tuple=True)
    pos = start[b_idx] + t_idx
    k_cache[b_idx, pos] = k[b_idx, t_idx]
    v_cache[b_idx, pos] = v[b_idx, t_idx]


def _write_static(k_cache, v_cache, k, v, start, n, row_ok) -> None:
    """Every (row, chunk token) pair writes one cache position, the ones that copy nothing (past the row's chunk
    length, or a row whose lengths are out of range) included, each the value its target must END with: a chunk
    token where the target is inside the row's written range [cache_len, cache_len + chunk_len), the cache's own
    value elsewhere. So writes that land on one position (a pair that copies nothing is clamped into the cache) all
    carry the same value, and their order does not matter. No host read; static shapes."""
    B, L, C = k_cache.shape[0], k_cache.shape[1], k.shape[1]
    if L == 0 or C == 0 or B == 0:
        return
    pos = (start[:, None] + torch.arange(C, device=k.device)).clamp(0, L - 1)  # [B, C] target positions
    rel = pos - start[:, None]  # [B, C] the chunk token a target inside the written range takes
    inside = (rel >= 0) & (rel < n[:, None]) & row_ok[:, None]  # [B, C]
    rows = torch.arange(B, device=k.device)[:, None].expand(B, C)
    src = rel.clamp(0, C - 1)
    for cache, new in ((k_cache, k), (v_cache, v)):
        keep = inside.view(B, C, *([1] * (cache.dim() - 2)))
        cache[rows, pos] = torch.where(keep, new[rows, src], cache[rows, pos])


@torch.library.custom_op("lightningrl_fast::kv_cache_write", mutates_args=("k_cache", "v_cache", "error_flag"))
def _kv_cache_write_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_lens: torch.Tensor,
    chunk_lens: torch.Tensor,
    error_flag: torch.Tensor | None,
) -> None:
    kernel = cuda_kernel("kv_cache_write", k_cache)  # None: no CUDA tensor or no CUDA build of _C
    if kernel is not None:
        kernel(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag)
    else:
        kv_cache_write_reference(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag)


@_kv_cache_write_op.register_fake
def _(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag) -> None:
    return None


def kv_cache_write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_lens: torch.Tensor,
    chunk_lens: torch.Tensor,
    *,
    error_flag: torch.Tensor | None = None,
    check_lengths: bool | None = None,
) -> None:
    """Write k[b, :chunk_lens[b]] into k_cache[b, cache_lens[b] : cache_lens[b] + chunk_lens[b]] (and v), in place.

    Args:
        k_cache, v_cache: [B, L, Hkv, D], bf16/fp16/fp32 (fp64 too); last dim contiguous (other strides free).
        k, v: [B, C, Hkv, D], the caches' dtype.
        cache_lens: [B] int32, tokens already in each row's cache (not advanced: the caller commits).
        chunk_lens: [B] int32, valid tokens of each row's chunk, 0 <= chunk_lens <= C.
        error_flag: optional int32 tensor (>= 1 element, same device): element 0 is set to 1 when a row is
            out of range (such rows write nothing). Never cleared here.
        check_lengths: check the lengths on the host and raise ValueError (a device sync for CUDA lengths).
            None = check unless capturing a CUDA graph or tracing with torch.compile.

    All tensors on one device. Positions outside the written ranges are never touched. The caches must not share
    memory with each other or with k / v, nor have rows that share memory (an expanded view): ValueError.
    """
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    B, L, H, D = k_cache.shape
    check_tensor("v_cache", v_cache, shape=(B, L, H, D), dtypes=(k_cache.dtype,))
    check_tensor("k", k, shape=(B, None, H, D), dtypes=(k_cache.dtype,))
    C = k.shape[1]
    check_tensor("v", v, shape=(B, C, H, D), dtypes=(k_cache.dtype,))
    check_tensor("cache_lens", cache_lens, shape=(B,), dtypes=(torch.int32,))
    check_tensor("chunk_lens", chunk_lens, shape=(B,), dtypes=(torch.int32,))
    device = same_device(("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                         ("cache_lens", cache_lens), ("chunk_lens", chunk_lens))
    if error_flag is not None:
        check_tensor("error_flag", error_flag, dtypes=(torch.int32,), device=device)
        if error_flag.numel() < 1:
            raise ValueError("error_flag must have at least one element")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if D > 1 and cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {cache.stride()}")
    check_no_overlap([("k_cache", k_cache), ("v_cache", v_cache)],
                     [("k", k), ("v", v), ("cache_lens", cache_lens), ("chunk_lens", chunk_lens)])
    k, v = (t if D <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    cache_lens, chunk_lens = cache_lens.contiguous(), chunk_lens.contiguous()

    if check_lengths is None:
        check_lengths = host_checks_allowed(device)
    if check_lengths:
        _check_lengths(cache_lens, chunk_lens, C, L)
    torch.ops.lightningrl_fast.kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag)


def _check_lengths(cache_lens: torch.Tensor, chunk_lens: torch.Tensor, C: int, L: int) -> None:
    start, n = cache_lens.to(torch.int64), chunk_lens.to(torch.int64)
    bad = (start < 0) | (n < 0) | (n > C) | (start + n > L)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"kv_cache_write: row {b} does not fit: cache_lens[{b}]={int(start[b])}, chunk_lens[{b}]={int(n[b])}; "
            f"need cache_lens >= 0, 0 <= chunk_lens <= C={C} and cache_lens + chunk_lens <= L={L} (cache capacity)"
        )

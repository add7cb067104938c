"""[rollout] Batched block-diffusion decoding with a static KV cache, folded commits and TPF accounting.

`generate(model, prompts, cfg) -> Rollout` decodes every prompt (REFERENCE §2):
  * blocks of B tokens are aligned at absolute position 0; a prefill forward writes each prompt's full
    blocks into the cache (in row chunks of at most `_PREFILL_TOKENS` prompt positions, so its activations
    stay bounded; rows whose prompts share those blocks, an RL group's G samples, compute them once and copy
    the cache rows); the prompt's tail shares the first generation block, whose other positions start as the
    mask token;
  * one denoising step = one forward of each row's current block against its cache, then
    `ops.threshold_unmask` (top-1 + threshold, or SDAR's quota rule; greedy / temperature / top-k / top-p);
  * a finished block's clean K/V enter the cache by FOLDING it into the next forward: that row's query
    chunk is [finished block ; next block] (block-causal), so the commit costs no extra forward.
    `fold_commit=False` runs SDAR's separate commit forward instead; under greedy decoding both give the
    same tokens (tested);
  * rows progress independently (each at its own block, its own step), all in the same forward;
  * a row stops when the block holding its first EOS is finished, or at `max_new_tokens`.

Finished rows: their chunk length becomes 0 (attention skips them) and, at the periodic host check, the
working set is COMPACTED once a bucket size (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) that holds the active rows is at
most half of it: the active rows move to the front in place, padded with finished rows up to that size, so
finished sequences stop costing projection/MLP compute too. On CUDA each working-set size has its own
captured graph.

`Decoder(model)` owns the static buffers, the KV cache and the captured steps and keeps them across calls, so
a loop over batches (the CLIs, a rollout split into chunks) captures each working-set size once; the plain
`generate()` function uses a throwaway one.

The model's q/k/v and gate/up weights are packed first (`SDARForCausalLM.pack_decode_weights`: the
parameters become views of one storage per group, so the trainer keeps updating the same tensors) and each
decode forward runs two GEMMs for them instead of five.

On CUDA the per-step work (chunk gather -> forward -> unmask -> state update) runs without any host
synchronization; the "all finished?" test reads one flag every `sync_every` steps and at the loop's last
step. `fold_commit=False` is an exception: it reads one flag every step (is any row's separate commit forward
due?). Packed steps are the other. With `cuda_graphs` the step is captured once per working-set size (and packed
size; on the model's device, current or not) and replayed. The random stream is Philox keyed by `seed` with a
per-step offset, and each row draws the noise of its index in the request (`noise_rows`), not of its place in the
working set, so the same seed gives the same tokens whatever the compaction did: compactions happen at the host
checks (every step on the CPU and for packed steps, else every `sync_every` steps), and neither `sync_every`,
`pack` nor `compact` changes sampled tokens (beyond the GEMMs' rounding on CUDA).

Packed steps (`pack`): the step's query chunk is [n, 2B] (a row folding a commit needs both blocks), but most rows
need only their current block, and finished rows nothing. On CUDA shapes are static, so the projections and the
MLP would run on all 2nB positions: up to twice the GEMM work of the ~nB tokens a step really has (block 32: a
row folds a commit on one step of its ~5-10 per block). A packed step reads the number of chunk tokens on the host
(one int per step), rounds it up to a few sizes (`_pack_rows`: at most 25% padding) and runs the forward on
that many token slots, the rows' chunk tokens back to back (`SDARForCausalLM.hidden_cached(token_capacity=)`);
each packed size is a graph of its own. The read costs a launch gap per step, which only pays off where the
forward is long: `pack="auto"` packs on CUDA when the working set holds >= `_PACK_MIN_TOKENS` (256) rows x block
tokens (where the GEMMs start to be compute-bound on an H100; smaller steps stream weights and keep the sync-free
path), and always packs the prefill and the separate commit forwards, whose token counts the host knows.
`"on"` packs every step on any device (the tests' way to run the packed path on the CPU), `"off"` never. The same
read gives the number of positions the step unmasks from (the current blocks' masked positions of the rows still
decoding), and a packed step runs the LM head on those alone: `ops.threshold_unmask` reads their logits through its
`logit_rows` map, since it never reads another position's. Over a block's steps about half of its positions are
still masked, so the LM head's GEMM and its logits (write and read) halve: the head is ~8% of an SDAR-8B forward's
FLOPs, ~18% of SDAR-1.7B's. The forward stays captured (one graph per working-set size and packed size, writing the
block's hidden states into a buffer of the decoder's); the LM head and the unmask run eagerly at that exact row count
(their ~20 launches are issued while the GPU runs the forward, and the step ends in the host read anyway). Each
row computes what the unpacked step computes (on the CPU the tests find the same tokens, greedy and sampled; on
CUDA the GEMMs run at another size and may round differently).

The mask token is taken out of the distribution (logit -inf) before picks and confidences, so a position is
never "unmasked" to it; SDAR's reference `block_diffusion_generate` keeps it in the softmax, so where a model
puts mass on it there the confidences are lower and a position near tau may wait a step longer. The trainer's
log-probs leave it out the same way, so rollouts and training agree.

Recorded per generated token: the step that unmasked it (`step_map`, counted per row from 0), its sampled
log-prob and its confidence. TPF = tokens up to and including the first EOS / distinct steps that
unmasked them. `forwards` counts the forwards a row took part in (prefill and commit forwards included).

The request's settings and checks and the Rollout it returns are in sampler_io.py (also importable from here).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass

import torch

from .model import KVCache, SDARForCausalLM
from .ops._common import PDL_ENV, check_int, pdl_allowed
from .ops.unmask import threshold_unmask
from .profiling import nvtx_range
from .sampler_io import (PACK_MODES, PromptProblem, Rollout, SamplerConfig, block_size_of, cat_rollouts,
                         finish_rollout, prompt_fit_problem, prompt_problem, validate_request)

# the request and result types live in sampler_io.py; they are importable from here too
__all__ = ["Decoder", "generate", "SamplerConfig", "Rollout", "cat_rollouts", "prompt_problem", "prompt_fit_problem",
           "PromptProblem", "PACK_MODES"]

_PREFILL_TOKENS = 16384  # prompt positions (rows x longest full-block prefix) per prefill forward
_MAX_GRAPHS = 128  # captured steps a Decoder keeps (working-set sizes x packed sizes x step parameters)
_PACK_MIN_TOKENS = 256  # pack="auto": working sets of at least this many rows x block tokens pack their steps


@dataclass
class _State:
    """The working set: one row per still-decoding sequence. Updated strictly in place (CUDA-graph safe)."""

    seq: torch.Tensor  # [n, Ltot] int64
    masked: torch.Tensor  # [n, Ltot] bool
    step_map: torch.Tensor  # [n, Ltot] int32
    logp: torch.Tensor  # [n, Ltot] float32
    conf: torch.Tensor  # [n, Ltot] float32
    cur_block: torch.Tensor  # [n] int64
    last_block: torch.Tensor  # [n] int64
    cache_len: torch.Tensor  # [n] int32 committed positions
    pending: torch.Tensor  # [n] bool: previous block finished, its commit rides on the next forward
    done: torch.Tensor  # [n] bool
    steps: torch.Tensor  # [n] int32 denoising steps so far
    blk_steps: torch.Tensor  # [n] int32 steps in the current block
    forwards: torch.Tensor  # [n] int64
    row_ids: torch.Tensor  # [n] int64 index into the caller's prompt list
    seed: torch.Tensor  # [1] int64
    offset: torch.Tensor  # [1] int64

    def per_row(self) -> dict[str, torch.Tensor]:
        """The fields with one entry per row (all but seed and offset)."""
        return {k: v for k, v in vars(self).items() if k not in ("seed", "offset")}


def _quota(st: _State, cfg: SamplerConfig, bs: int) -> torch.Tensor:
    """Minimum positions to unmask this step per row (0 for finished rows)."""
    if cfg.rule == "threshold":
        q = torch.ones_like(st.blk_steps)
    else:
        s = cfg.steps_per_block or bs
        q = bs // s + (st.blk_steps < bs % s).int()
        q = torch.where(st.blk_steps >= s - 1, torch.full_like(q, bs), q)  # the last scheduled step finishes
    return torch.where(st.done, torch.zeros_like(q), q)


def _denoise_step(model, st: _State, cache: KVCache, cfg: SamplerConfig, bs: int, eos_ids: torch.Tensor,
                  token_capacity: int | None = None) -> None:
    """One forward + unmask for every row of the working set; all updates in place, no host sync.
    `token_capacity`: the forward's packed token slots (>= the rows' chunk tokens; None: not packed)."""
    _unmask_step(model, st, cfg, bs, eos_ids, _forward_step(model, st, cache, bs, token_capacity))


def _forward_step(model, st: _State, cache: KVCache, bs: int, token_capacity: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's forward: every row's query chunk against its cache (a pending block's commit folded in);
    returns the current block's last hidden states [n, B, H] (into `out` when given). No host sync."""
    n, ltot = st.seq.shape
    ar = torch.arange(2 * bs, device=st.seq.device)
    start = (st.cur_block - st.pending.long()) * bs  # [n] first position of the query chunk
    idx = (start[:, None] + ar).clamp_max(ltot - 1)  # [n, 2B]
    chunk = st.seq.gather(1, idx)  # [n, 2B]
    chunk_lens = (_chunk_blocks(st) * bs).int()  # [n] 0, B or 2B (a packed step's size counts the same blocks)
    hidden = model.hidden_cached(chunk, cache, start.int(), chunk_lens, bs, check_lengths=False,
                                 token_capacity=token_capacity)  # [n, 2B, H]
    off = st.pending.long()[:, None] * bs + ar[:bs]  # [n, B] the current block inside the chunk
    h = torch.gather(hidden, 1, off[..., None].expand(-1, -1, hidden.shape[-1]), out=out)  # [n, B, H]
    st.cache_len.copy_((st.cur_block * bs).int())  # a pending block is committed by this forward
    st.pending.zero_()
    return h


def _scanned(st: _State, bs: int) -> torch.Tensor:
    """[n, B] bool: the current block's masked positions of the rows still decoding: exactly what the next unmask
    scans (masked, quota > 0: a row still decoding gets quota >= 1 while its block has a masked position; the quota
    rule's 0 for steps_per_block > B falls on steps past the block's B, when one position a step has finished it)."""
    bidx = st.cur_block[:, None] * bs + torch.arange(bs, device=st.seq.device)  # [n, B]
    return st.masked.gather(1, bidx) & ~st.done[:, None]


def _unmask_step(model, st: _State, cfg: SamplerConfig, bs: int, eos_ids: torch.Tensor, h: torch.Tensor,
                 lm_rows: int | None = None) -> None:
    """The LM head on the current block's hidden states `h` [n, B, H], the unmask, the rows' state. No host sync.

    lm_rows None: the LM head on all n x B positions. lm_rows m (a packed step's host read: `_scanned`'s count, exact
    for this step): on those m positions only, [m, H] -> [m, V], and `threshold_unmask` reads them through its
    `logit_rows` map (the unmask never reads a position it does not scan); a block's masked positions are about
    half of its n x B over its steps, so this halves the LM head's GEMM and the logits' memory traffic."""
    n = h.shape[0]
    ar = torch.arange(bs, device=st.seq.device)
    logit_rows = None
    if lm_rows is None:
        logits = model.decode_logits(h)  # [n, B, V] (ops.linear: the skinny-GEMM kernel when enabled)
    else:
        flat = _scanned(st, bs).reshape(-1)  # [nB]
        order = torch.argsort((~flat).to(torch.uint8), stable=True)[: max(lm_rows, 1)]  # [m] scanned positions first
        logit_rows = (flat.cumsum(0) - 1).clamp_min(0).view(n, bs)  # [n, B] a scanned position's row in `order`
        logits = model.decode_logits(h.reshape(n * bs, -1)[order])  # [m, V]
    logits[..., model.config.mask_token_id] = float("-inf")  # never "unmask" to the mask token

    bidx = st.cur_block[:, None] * bs + ar  # [n, B] absolute positions of the current block
    tok, msk = st.seq.gather(1, bidx), st.masked.gather(1, bidx)
    smap, lp, cf = st.step_map.gather(1, bidx), st.logp.gather(1, bidx), st.conf.gather(1, bidx)
    block_done, eos_seen = threshold_unmask(
        logits, tok, msk, smap, lp, cf, st.steps, _quota(st, cfg, bs), eos_ids, st.seed, st.offset,
        threshold=cfg.threshold, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, greedy=cfg.greedy,
        noise=cfg.noise, noise_rows=st.row_ids,  # a row's noise follows the request's row, wherever it sits
        logit_rows=logit_rows,
    )
    for full, part in ((st.seq, tok), (st.masked, msk), (st.step_map, smap), (st.logp, lp), (st.conf, cf)):
        full.scatter_(1, bidx, part)

    active = ~st.done
    st.forwards.add_(active.long())
    st.steps.add_(active.int())
    st.blk_steps.add_(active.int())
    finished = block_done & active
    row_done = finished & (eos_seen | (st.cur_block >= st.last_block))
    st.done.logical_or_(row_done)
    advance = finished & ~row_done
    st.pending.copy_(advance)
    st.cur_block.add_(advance.long())
    st.blk_steps.masked_fill_(advance, 0)
    st.offset.add_(1)


def _commit_step(model, st: _State, cache: KVCache, bs: int, token_capacity: int | None = None) -> None:
    """SDAR-style separate commit: re-run each row's just-finished block to write its clean K/V."""
    start = (st.cur_block - 1).clamp_min(0) * bs
    idx = start[:, None] + torch.arange(bs, device=st.seq.device)
    chunk_lens = torch.where(st.pending, bs, 0).int()
    model.hidden_cached(st.seq.gather(1, idx), cache, start.int(), chunk_lens, bs, check_lengths=False,
                        token_capacity=token_capacity)
    st.forwards.add_(st.pending.long())
    st.cache_len.add_(chunk_lens)
    st.pending.zero_()


class _GraphedStep:
    """The denoising step (a packed step: its forward) captured in a CUDA graph for one working-set size (falls back
    to eager on failure).

    The first call runs eagerly (warm-up and real work); capture then records the step without running it,
    so the decoding state is never advanced twice. Every graph of one `Decoder` draws on one memory pool (a new
    one after `Decoder._drop_graphs`) and is captured on one side stream `stream` (a pool shared between
    captures wants the same stream): they never run concurrently and keep no output alive between replays (the
    step updates the decoder's static buffers in place), so the pool holds the largest step's temporaries
    instead of their sum.

    Warm-up, capture and replay run with `stream`'s device (the model's) current: a capture on a stream of
    another device would record none of the step's kernels (they go to the model's device) and run them.

    A capture that fails while the CUDA kernels run with programmatic dependent launch on (csrc/launch.h; not yet
    run under capture on every driver) is retried once with it off for the whole process (LRF_PDL=0, a warning
    says so); when the retry fails too, PDL was not the cause and LRF_PDL gets its old value back. A failure
    without PDL in play (it is off, or the ops run their references: LRF_DISABLE_KERNELS=1 or `_C` without CUDA
    kernels), or a second one, leaves the step eager (a warning too)."""

    def __init__(self, fn, pool, stream: torch.cuda.Stream) -> None:
        self.fn, self.pool, self.stream, self.graph, self.failed = fn, pool, stream, None, False
        self.device = stream.device

    def __call__(self) -> None:
        with torch.cuda.device(self.device):
            if self.graph is not None:
                self.graph.replay()  # on the device's current stream, where the eager work and host reads go
                return
            self.fn()  # the first call runs eagerly: it warms up kernels and allocator, and does real work
            if self.failed:
                return
            pool, pdl_before = self.pool, None
            for attempt in (0, 1):
                prev = torch.cuda.current_stream(self.device)
                graph = None
                try:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                        self.fn()
                    self.graph = graph
                    return
                except Exception as e:  # capture can fail when an op without a CUDA kernel needs a host sync
                    # graph.__exit__ leaves the capture stream current when capture_end raises: restore the old one
                    torch.cuda.set_stream(prev)
                    del graph
                    if attempt == 0 and pdl_allowed() and _kernels_launch(self.device):
                        # programmatic dependent launch under capture has not run on every driver yet: once more
                        # without it (for the whole process), in a pool of its own (the failed capture's is unsure)
                        pdl_before = os.environ.get(PDL_ENV)
                        os.environ[PDL_ENV] = "0"
                        pool = torch.cuda.graph_pool_handle()
                        warnings.warn(f"CUDA graph capture of the denoising step failed ({type(e).__name__}: {e}) "
                                      f"with programmatic dependent launch on; retrying with it off ({PDL_ENV}=0 "
                                      "for this process)", RuntimeWarning, stacklevel=2)
                        continue
                    if attempt == 1:  # not PDL's doing: its switch as it was
                        if pdl_before is None:
                            os.environ.pop(PDL_ENV, None)
                        else:
                            os.environ[PDL_ENV] = pdl_before
                    self.failed = True
                    warnings.warn(f"CUDA graph capture of the denoising step failed ({type(e).__name__}: {e}); "
                                  "decoding continues eagerly", RuntimeWarning, stacklevel=2)
                    return


def _kernels_launch(device: torch.device) -> bool:
    """Whether the step's ops run the CUDA kernels on `device` (the launches PDL applies to), not their references:
    the ops' own dispatch rule (`ops._common.cuda_kernel`: a CUDA build of `_C`, LRF_DISABLE_KERNELS unset)."""
    from .ops._common import cuda_kernel

    return cuda_kernel("threshold_unmask", torch.empty(0, device=device)) is not None


@functools.cache
def _capture_stream(dev: torch.device) -> "torch.cuda.Stream":
    """One capture stream per device for every Decoder of the process (made once, memoized): the first GEMM
    captured on a stream allocates that stream's cuBLAS workspace inside the graph's pool, where it can stay; a
    new stream per Decoder (the RL loop makes one a step) would leave one such workspace behind per stream."""
    return torch.cuda.Stream(dev)


def _host_check_every(cfg: SamplerConfig, dev: torch.device) -> int:
    """Denoising steps between host checks of "all rows finished?" (and compactions): `sync_every` on CUDA,
    where a check waits for the device; every step on the CPU, where it costs nothing."""
    return cfg.sync_every if dev.type == "cuda" else 1


def _chunk_blocks(st: _State) -> torch.Tensor:
    """[n] blocks each row forwards in the next step: 0 finished, 2 folding a commit, else 1."""
    return torch.where(st.done, 0, 1 + st.pending.long())


def _pack_rows(n: int) -> int:
    """Packed step size in block-rows for n rows' worth of chunk tokens: n up to 8, then the next multiple of a
    quarter of n's power of two (10, 12, 14, 16, 20, 24, 28, 32, 40, ...): at most 25% padding, and a working set
    meets few sizes, so few graphs."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _bucket(n: int) -> int:
    """Smallest working-set size >= n among 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 3/2 of them):
    compaction pads to these sizes (with finished rows) so a reused decoder meets the same few graphs again."""
    p = 1
    while p < n:
        if p >= 2 and p + p // 2 >= n:
            return p + p // 2
        p *= 2
    return p


class Decoder:
    """The decoding engine of one model: static state buffers, the KV cache and the captured denoising steps,
    kept across `generate` calls (gpt-fast style) so that a loop over batches (the generate and eval CLIs, a
    rollout split into chunks) captures each working-set size once instead of once per call.

    * Buffers are [capacity rows, capacity positions]; a call with more prompts or longer sequences grows
      them (dropping the graphs, which point at the old ones). The working set of n rows is always the first
      n rows of the buffers, so a step captured for n rows replays in any later call of n rows.
    * Compaction moves the still-active rows to the front in place (the KV cache one layer at a time, so the
      only extra memory is one layer's rows) and pads to a bucket size with finished rows.
    * Graphs are keyed by the step's parameters (block size, rule, tau, temperature, top-k/p, noise, EOS ids),
      the working-set size and the packed size; past `_MAX_GRAPHS` the least recently used one goes. They are all
      dropped when a parameter's storage changes (an assign-load, `.to()`), never when the weights are updated in
      place (the optimizer): replays read the current weights.
    * `release()` frees everything (the RL loop releases its rollout decoder before the training pass).
    """

    def __init__(self, model: SDARForCausalLM) -> None:
        self.model = model
        self._bufs: _State | None = None  # capacity-sized state; the working set is a prefix of rows
        self._cache: KVCache | None = None
        self._layout: tuple | None = None  # (device, dtype, block size) the buffers were made for
        self._hidden: torch.Tensor | None = None  # [rows, B, H] the captured packed forwards' output
        self._graphs: dict[tuple, _GraphedStep] = {}
        self._eos: dict[tuple, torch.Tensor] = {}  # EOS id tensors the graphs read
        self._weights: tuple = ()
        self._pool = self._stream = None  # CUDA graphs: their memory pool and capture stream

    def release(self) -> None:
        """Free the buffers, the KV cache and the graphs (the next call allocates and captures again)."""
        self._bufs = self._cache = self._layout = self._pool = self._stream = self._hidden = None
        self._graphs, self._eos, self._weights = {}, {}, ()

    def _drop_graphs(self) -> None:
        """Drop every captured step and their memory pool: the next capture starts a new pool. A pool whose graphs
        are all gone cannot take another capture while it still holds a block (torch's allocator asserts the pool's
        use count is > 0), and a capture can leave one there for good: the cuBLAS workspace of the capture stream,
        allocated by the first GEMM captured on it. Reusing the pool would make every later capture fail (eager
        decoding, with a warning). The capture stream stays: its workspace exists, so new captures add none."""
        self._graphs, self._pool = {}, None

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, positions) the buffers hold now ((0, 0) before the first call or after `release`)."""
        return (0, 0) if self._bufs is None else tuple(self._bufs.seq.shape)

    def _weights_key(self) -> tuple:
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def _ensure(self, n0: int, ltot: int, bs: int, dev: torch.device, dtype: torch.dtype) -> None:
        layout = (dev, dtype, bs)
        rows, width = self.capacity
        if self._layout == layout and n0 <= rows and ltot <= width:
            return
        # the first allocation fits this call exactly; a longer call grows the width by >= 1/4 (whole blocks), so
        # a loop over batches of varying length reallocates (and recaptures) only a few times
        if self._layout != layout:
            rows = width = 0
        rows = max(n0, rows)
        if ltot > width:
            width = max(ltot, -(-(width + width // 4) // bs) * bs)
        self.release()  # old buffers and the graphs that point at them go before the new ones are made
        mcfg = self.model.config
        if dev.type == "cuda":
            _check_memory(mcfg, rows, width, bs, dtype, dev)
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self._bufs = _State(
            seq=torch.empty(rows, width, **i64), masked=torch.empty(rows, width, dtype=torch.bool, device=dev),
            step_map=torch.empty(rows, width, **i32), logp=torch.empty(rows, width, device=dev),
            conf=torch.empty(rows, width, device=dev), cur_block=torch.empty(rows, **i64),
            last_block=torch.empty(rows, **i64), cache_len=torch.empty(rows, **i32),
            pending=torch.empty(rows, dtype=torch.bool, device=dev),
            done=torch.empty(rows, dtype=torch.bool, device=dev),
            steps=torch.empty(rows, **i32), blk_steps=torch.empty(rows, **i32), forwards=torch.empty(rows, **i64),
            row_ids=torch.empty(rows, **i64), seed=torch.zeros(1, **i64), offset=torch.zeros(1, **i64),
        )
        # zeroed once: the attention reference masks positions past a row's length after reading them, so they
        # must hold finite values (stale ones from an earlier call are fine)
        self._cache = KVCache.allocate(dataclasses.replace(mcfg, block_size=bs), rows, width, dtype=dtype, device=dev)
        self._layout = layout

    def _working_set(self, n: int) -> tuple[_State, KVCache]:
        """The first n rows of the buffers and the cache (views: a step captured on them replays later)."""
        b = self._bufs
        per_row = {k: v[:n] for k, v in b.per_row().items()}
        return _State(**per_row, seed=b.seed, offset=b.offset), KVCache(self._cache.k[:, :n], self._cache.v[:, :n])

    def _compact(self, st: _State, cache: KVCache, keep: torch.Tensor) -> tuple[_State, KVCache]:
        """Move rows `keep` (ascending, [m]) to the front of the buffers in place; the working set becomes m rows."""
        m = keep.numel()
        for k, v in st.per_row().items():
            getattr(self._bufs, k)[:m].copy_(v[keep])  # v[keep] is a fresh tensor: no overlap
        for full, cur in ((self._cache.k, cache.k), (self._cache.v, cache.v)):
            for layer in range(full.shape[0]):  # one layer at a time: the temporary is one layer's m rows
                full[layer, :m].copy_(cur[layer, keep])
        return self._working_set(m)

    def _step_fn(self, st: _State, cache: KVCache, cfg: "SamplerConfig", bs: int, eos_ids: torch.Tensor,
                 cap: int | None):
        return lambda: _denoise_step(self.model, st, cache, cfg, bs, eos_ids, cap)

    def _packed_forward(self, st: _State, cache: KVCache, bs: int, cap: int | None, dev: torch.device,
                        use_graphs: bool) -> torch.Tensor:
        """A packed step's forward (`_forward_step`) -> the current block's hidden states [n, B, H]: with graphs,
        captured per (working-set size, packed size) and written into a buffer of the decoder's that every replay
        reuses (read by the eager LM head right after, before any other replay)."""
        if not use_graphs:
            return _forward_step(self.model, st, cache, bs, cap)
        n = st.seq.shape[0]
        if self._hidden is None:  # one per buffer layout (release() drops it with the graphs that write it)
            self._hidden = torch.empty(self.capacity[0], bs, self.model.config.hidden_size, dtype=self._layout[1],
                                       device=dev)
        out = self._hidden[:n]
        # keyed by what the forward depends on (not the sampling parameters of sig): one capture serves every config
        self._graph(("forward", bs), n, cap, lambda: lambda: _forward_step(self.model, st, cache, bs, cap, out), dev)()
        return out

    def _graph(self, sig: tuple, n: int, cap: int | None, step_fn, dev: torch.device) -> "_GraphedStep":
        """The captured step for (step parameters, working-set size, packed size), capturing it (from `step_fn()`)
        the first time. At `_MAX_GRAPHS` (at least 2) the least recently used one goes: the pool keeps the others, so
        a capture never meets a pool whose graphs are all gone (see `_drop_graphs`), and the freed graph's blocks
        serve later captures."""
        key = (sig, n, cap)
        if key in self._graphs:
            self._graphs[key] = self._graphs.pop(key)  # most recently used last
            return self._graphs[key]
        while len(self._graphs) >= max(2, _MAX_GRAPHS):
            del self._graphs[next(iter(self._graphs))]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:  # release() drops it (the device may change)
            self._stream = _capture_stream(dev)
        self._graphs[key] = _GraphedStep(step_fn(), self._pool, self._stream)
        return self._graphs[key]

    def _prefill(self, st: _State, cache: KVCache, prompts, full_blocks: torch.Tensor, bs: int, pack: bool) -> None:
        """Write each row's whole prompt blocks (`full_blocks` [n0] positions, host) into the cache; set its length.

        Row chunks of <= _PREFILL_TOKENS positions: on CUDA an unpacked forward runs each row over the chunk's
        longest prefix, padding included, and its activations are outside _check_memory. A row whose prefix an
        earlier row has too (an RL group's G samples) computes nothing: it copies that row's cache rows after."""
        model, dev, n0 = self.model, st.seq.device, len(prompts)
        src = _prefix_sources(prompts, full_blocks.tolist())  # [n0] host
        copies = [i for i in range(n0) if src[i] != i]
        run = full_blocks.clone()
        run[copies] = 0  # [n0] positions each row computes
        lens, run_dev = full_blocks.int().to(dev), run.int().to(dev)
        per = max(1, _PREFILL_TOKENS // int(full_blocks.max()))
        for r0 in range(0, n0, per):
            rows = slice(r0, min(r0 + per, n0))
            c = int(run[rows].max())  # this chunk's longest prefix
            if c == 0:
                continue  # no row of the chunk computes a full prompt block
            part = KVCache(cache.k[:, rows], cache.v[:, rows])  # views: each layer's [r, L, Hkv, D] rows
            model.hidden_cached(st.seq[rows, :c], part, st.cache_len[rows], run_dev[rows], bs, check_lengths=False,
                                token_capacity=int(run[rows].sum()) if pack else None)
        for j in range(0, len(copies), 64):  # 64 rows and one layer at a time: a bounded temporary
            part = copies[j : j + 64]
            dst, srcs = torch.tensor(part, device=dev), torch.tensor([src[i] for i in part], device=dev)
            w = int(full_blocks[part].max())  # the longest copied prefix
            for full in (cache.k, cache.v):
                for layer in range(full.shape[0]):
                    full[layer, :, :w].index_copy_(0, dst, full[layer, srcs, :w])
        st.cache_len.copy_(lens)
        st.forwards.add_((lens > 0).long())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], cfg: "SamplerConfig", pad_id: int | None = None) -> "Rollout":
        """Decode `prompts` (lists of token ids); see the module docstring. Returns a `Rollout`."""
        import time

        t0 = time.perf_counter()
        model, mcfg = self.model, self.model.config
        bs = block_size_of(model, cfg)
        validate_request(model, prompts, cfg, bs)
        if pad_id is not None:
            pad_id = check_int("pad_id", pad_id, lo=-(2**63), hi=2**63 - 1)  # a float made Rollout.tokens float
        model.pack_decode_weights()  # q/k/v and gate/up as one GEMM each (a copy the first time, then a check)
        p0 = next(model.parameters())
        dev, dtype = p0.device, p0.dtype
        pad_id = cfg.eos_ids[-1] if pad_id is None else pad_id
        n0 = len(prompts)
        plens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        last_block = (plens + cfg.max_new_tokens - 1) // bs  # [n0]
        ltot = int(last_block.max() + 1) * bs
        self._ensure(n0, ltot, bs, dev, dtype)
        weights = self._weights_key()
        if weights != self._weights:
            self._drop_graphs()  # parameters were replaced: the graphs read stale storage
            self._weights = weights
        width = self.capacity[1]

        seq = torch.full((n0, width), mcfg.mask_token_id, dtype=torch.int64)  # [n0, W]
        for i, p in enumerate(prompts):
            seq[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        pos = torch.arange(width)
        in_prompt = pos[None, :] < plens[:, None]  # [n0, W]
        in_seq = pos[None, :] < ltot  # positions past ltot are never decoded: not masked, step -2
        st, cache = self._working_set(n0)
        st.seq.copy_(seq)
        st.masked.copy_(~in_prompt & in_seq)
        st.step_map.copy_(torch.where(in_prompt, -1, -2).int())
        st.logp.zero_()
        st.conf.zero_()
        st.cur_block.copy_(plens // bs)
        st.last_block.copy_(last_block)
        for t in (st.cache_len, st.pending, st.done, st.steps, st.blk_steps, st.forwards, st.offset):
            t.zero_()
        st.row_ids.copy_(torch.arange(n0))
        st.seed.fill_(cfg.seed)
        eos_key = tuple(cfg.eos_ids)
        if eos_key not in self._eos:
            self._eos[eos_key] = torch.tensor(eos_key, dtype=torch.int64, device=dev)
        eos_ids = self._eos[eos_key]
        total_forwards = 0

        # packing: a step's forward runs on its rows' chunk tokens only (see the module docstring)
        pack = cfg.pack == "on" or (cfg.pack == "auto" and dev.type == "cuda")
        full_blocks = (plens // bs) * bs  # [n0] prompt positions prefilled
        if int(full_blocks.max()) > 0:
            with nvtx_range("prefill"):
                self._prefill(st, cache, prompts, full_blocks, bs, pack)
            total_forwards += 1  # however many row chunks it takes

        out = {k: getattr(st, k).clone() for k in ("seq", "step_map", "logp", "conf", "forwards", "steps")}
        use_graphs = cfg.cuda_graphs and dev.type == "cuda"
        sig = (bs, cfg.rule, cfg.steps_per_block, cfg.threshold, cfg.temperature, cfg.top_k, cfg.top_p, cfg.noise,
               eos_key)
        sync_every = _host_check_every(cfg, dev)
        max_steps = ltot + 1  # each active row unmasks >= 1 position per step
        # a packed step's blocks to forward (rows x 1 or 2) and positions to unmask, read with the previous step's check
        chunk_rows = lm_rows = None
        for step_i in range(1, max_steps + 1):
            n = st.seq.shape[0]
            packing = pack and (cfg.pack == "on" or n * bs >= _PACK_MIN_TOKENS)
            cap = None
            if packing:
                if chunk_rows is None:  # the first step (no check before it)
                    chunk_rows, lm_rows = torch.stack([_chunk_blocks(st).sum(), _scanned(st, bs).sum()]).tolist()
                cap = _pack_rows(chunk_rows) * bs if _pack_rows(chunk_rows) < 2 * n else None
            with nvtx_range("denoise_step"):
                if packing:  # the forward captured, the LM head (on lm_rows positions) and the unmask eager
                    h = self._packed_forward(st, cache, bs, cap, dev, use_graphs)
                    _unmask_step(model, st, cfg, bs, eos_ids, h, lm_rows)
                elif use_graphs:
                    self._graph(sig, n, cap, lambda: self._step_fn(st, cache, cfg, bs, eos_ids, cap), dev)()
                else:
                    _denoise_step(model, st, cache, cfg, bs, eos_ids, cap)
            total_forwards += 1
            if not cfg.fold_commit:
                n_pending = int(st.pending.sum())
                if n_pending:
                    with nvtx_range("commit"):
                        _commit_step(model, st, cache, bs, n_pending * bs if pack else None)
                    total_forwards += 1
            if step_i % sync_every and step_i < max_steps and not packing:  # the last step always checks, a packed
                continue  # one every step: its one read also gives the next step's size (compaction keeps it)
            active = ~st.done  # [n]
            if packing:
                n_active, chunk_rows, lm_rows = torch.stack(
                    [active.sum(), _chunk_blocks(st).sum(), _scanned(st, bs).sum()]).tolist()
            else:
                n_active = int(active.sum())
            if n_active == 0:
                break
            m = _bucket(n_active)
            if cfg.compact and m <= st.seq.shape[0] // 2:
                _save_rows(out, st, st.done)
                # the active rows first, then finished ones as padding up to the bucket size, in row order
                keep = torch.cat([active.nonzero().squeeze(1), st.done.nonzero().squeeze(1)[: m - n_active]])
                st, cache = self._compact(st, cache, keep.sort().values)
        else:
            raise RuntimeError(f"decoding did not finish within {max_steps} steps (a row unmasked nothing in a step)")
        _save_rows(out, st, torch.ones_like(st.done))
        return finish_rollout(prompts, out, plens, ltot, cfg, pad_id, total_forwards, time.perf_counter() - t0)


def _prefix_sources(prompts: list[list[int]], full: list[int]) -> list[int]:
    """For each row, the first row whose prompt has the same prefilled prefix (`full[i]` tokens: the prompt's
    whole blocks): itself when it is the first, or when it has no whole block."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(p[:f]), i) if f else i for i, (p, f) in enumerate(zip(prompts, full))]


def _check_memory(mcfg, rows: int, width: int, bs: int, dtype: torch.dtype, dev: torch.device) -> None:
    """Refuse, with the sizes, a KV cache (+ one step's logits) that cannot fit in the device's free memory."""
    elt = torch.empty((), dtype=dtype).element_size()
    cache = 2 * mcfg.num_hidden_layers * rows * width * mcfg.num_key_value_heads * mcfg.head_dim * elt
    logits = 2 * rows * bs * mcfg.vocab_size * elt  # the eager step's and the captured step's
    logits += rows * bs * mcfg.hidden_size * elt  # the packed steps' hidden-state buffer (Decoder._hidden)
    free, _ = torch.cuda.mem_get_info(dev)
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)  # cached by torch's allocator
    if cache + logits > free:
        gib = 2 ** 30
        raise torch.cuda.OutOfMemoryError(
            f"decoding {rows} sequences of up to {width} positions needs {cache / gib:.2f} GiB of KV cache and "
            f"~{logits / gib:.2f} GiB of logits per step, but {free / gib:.2f} GiB are free on {dev}: decode fewer "
            f"prompts per call (--rollout-batch-size / --eval-batch-size / --batch-size) or lower max_new_tokens")


def generate(model: SDARForCausalLM, prompts: list[list[int]], cfg: SamplerConfig, pad_id: int | None = None) -> Rollout:
    """Decode `prompts` with a one-call `Decoder` (its buffers and graphs are freed on return); a loop over
    batches should keep one `Decoder` instead."""
    return Decoder(model).generate(prompts, cfg, pad_id)


def _save_rows(out: dict, st: _State, which: torch.Tensor) -> None:
    rows = st.row_ids[which]
    for k in out:
        out[k][rows] = getattr(st, k)[which]

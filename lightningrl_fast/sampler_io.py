"""The sampler's request and result: `SamplerConfig` (how to decode), the checks of a decode request
(`validate_request`; `prompt_problem`, the one rule and wording for a prompt the sampler, the generate / eval CLIs
and the trainer share) and `Rollout` (what decoding returns, built from the decoder's buffers by
`finish_rollout`; `cat_rollouts` joins the Rollouts of a batch decoded in chunks).

sampler.py decodes; everything here runs on the host, before the first forward or after the last one. The
names are also importable from `lightningrl_fast.sampler`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from .model import SDARForCausalLM
from .ops._common import check_float, check_int
from .ops.unmask import NOISE_MODES, check_sampling_args

PACK_MODES = ("auto", "on", "off")


@dataclass
class SamplerConfig:
    """How rollouts and evaluations are decoded."""

    block_size: int | None = None  # None: the model config's block_size
    threshold: float = 0.9  # unmask every masked position with confidence >= threshold
    rule: str = "threshold"  # "threshold": top-1 + threshold; "quota": SDAR's B//S per step, topped up
    steps_per_block: int | None = None  # S for the quota rule (default: block_size)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    noise: str = "two_level"  # sampling noise: "two_level" (one pass, default) or "per_token"; both exact
    max_new_tokens: int = 256
    max_length: int | None = None  # cap on prompt + response positions (default: max_position_embeddings)
    eos_ids: tuple[int, ...] = (151645, 151643)
    fold_commit: bool = True  # fold the finished block's commit into the next forward (False: + a host sync a step)
    cuda_graphs: bool = True  # capture the denoising step on CUDA
    sync_every: int = 4  # CUDA: steps between host checks for "all finished"
    compact: bool = True  # shrink the working set once at most half of it is active
    pack: str = "auto"  # forwards on the chunk tokens only: "auto" (CUDA, >= 256 rows x block tokens), "on", "off"
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class Rollout:
    """Decoded sequences. Per-token tensors are [N, R] with R = max_new_tokens (response positions only)."""

    prompt_ids: list[list[int]]
    sequences: torch.Tensor  # [N, Ltot] int64: prompt + decoded blocks (the EOS block's tokens after the EOS are
    #   kept as decoded, the context trace replay needs; mask_id past the last decoded block)
    seq_step_map: torch.Tensor  # [N, Ltot] int32 over `sequences`: -1 prompt, -2 never decoded, else the step
    prompt_lens: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N, R] int64 response tokens; pad_id after the response
    response_mask: torch.Tensor  # [N, R] bool: tokens up to and including the first EOS
    step_map: torch.Tensor  # [N, R] int32: the step that unmasked each token (-1 on padding)
    logp: torch.Tensor  # [N, R] float32 sampled log-prob
    conf: torch.Tensor  # [N, R] float32 confidence
    lengths: torch.Tensor  # [N] int64 response lengths (EOS included)
    tpf: torch.Tensor  # [N] float32 tokens per forward
    forwards: torch.Tensor  # [N] int64 forwards each row took part in
    eos_found: torch.Tensor  # [N] bool
    total_forwards: int = 0  # forwards the engine ran for the whole batch
    seconds: float = 0.0
    finish_reason: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def response_ids(self, i: int) -> list[int]:
        return self.tokens[i, : int(self.lengths[i])].tolist()


def cat_rollouts(parts: list[Rollout], mask_id: int) -> Rollout:
    """One Rollout from the Rollouts of consecutive chunks of a batch (rows in order). The [N, Ltot] fields are
    right-padded to the widest chunk: `sequences` with the mask token, `seq_step_map` with -2 (never decoded)."""
    if not parts:
        raise ValueError("cat_rollouts: no rollouts given")
    if len(parts) == 1:
        return parts[0]
    width = max(p.sequences.shape[1] for p in parts)

    def padded(name: str, value: int) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(getattr(p, name), (0, width - p.sequences.shape[1]), value=value)
                          for p in parts])

    not_per_row = ("prompt_ids", "sequences", "seq_step_map", "total_forwards", "seconds", "finish_reason")
    per_row = {f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Rollout)
               if f.name not in not_per_row}
    return Rollout(
        prompt_ids=[ids for p in parts for ids in p.prompt_ids], sequences=padded("sequences", mask_id),
        seq_step_map=padded("seq_step_map", -2), **per_row, total_forwards=sum(p.total_forwards for p in parts),
        seconds=sum(p.seconds for p in parts), finish_reason=[r for p in parts for r in p.finish_reason],
    )


def ignored_sampling_settings(rule: str, steps_per_block: int | None, temperature: float, top_k: int, top_p: float,
                              decoding: str = "decoding") -> list[str]:
    """Sampler settings the others make do nothing, said by the command lines (train: of `decoding` "rollouts"):
    steps_per_block without the quota rule, top-k / top-p when greedy."""
    out = []
    if steps_per_block is not None and rule != "quota":
        out.append("--steps-per-block does nothing with --rule threshold (it sets the quota rule's steps)")
    if temperature == 0 and (top_k or top_p < 1):
        out.append(f"--top-k / --top-p do nothing with --temperature 0 (greedy {decoding})")
    return out


def block_size_of(model: SDARForCausalLM, cfg: SamplerConfig) -> int:
    """The decoding block size: cfg.block_size (an integer >= 1), None = the model config's."""
    if not isinstance(cfg, SamplerConfig):
        raise TypeError(f"cfg must be a SamplerConfig, got {type(cfg).__name__}")
    if cfg.block_size is None:
        return model.config.block_size
    return check_int("block_size", cfg.block_size, lo=1)  # 0 fell back to the model's block size, silently


def validate_request(model: SDARForCausalLM, prompts, cfg: SamplerConfig, bs: int) -> int:
    vocab, mask_id = model.config.vocab_size, model.config.mask_token_id
    if prompts is not None and not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given")
    # integers, not bools or floats: a float cast the sampler's state to float (a 1.5 max_new_tokens failed deep
    # inside, a 2.5 steps_per_block made an int32 quota a float one)
    check_int("max_new_tokens", cfg.max_new_tokens)
    for name in ("steps_per_block", "sync_every", "max_length"):  # a bool: the ValueError below
        if getattr(cfg, name) is not None and not isinstance(getattr(cfg, name), bool):
            check_int(name, getattr(cfg, name))
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.rule not in ("threshold", "quota"):
        raise ValueError(f"rule must be 'threshold' or 'quota', got {cfg.rule!r}")
    if cfg.steps_per_block is not None and (isinstance(cfg.steps_per_block, bool) or cfg.steps_per_block < 1):
        raise ValueError(f"steps_per_block must be >= 1 (or None: the block size), got {cfg.steps_per_block}")
    for name in ("sync_every", "max_length"):
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be >= 1, got {v}")
    for name in ("threshold", "temperature"):
        check_float(name, getattr(cfg, name), allow_inf=True, allow_nan=True)  # a number (TypeError); range below
    if not (math.isfinite(cfg.threshold) and math.isfinite(cfg.temperature)):
        raise ValueError(f"threshold and temperature must be finite, got {cfg.threshold}, {cfg.temperature}")
    eos = cfg.eos_ids
    if not isinstance(eos, (list, tuple)) or any(isinstance(e, bool) or not isinstance(e, int) for e in eos):
        raise TypeError(f"eos_ids must be a tuple of int token ids, got {eos!r}")  # floats made the tokens float
    if not eos or any(not 0 <= e < vocab for e in eos):
        raise ValueError(f"eos_ids {cfg.eos_ids} must be non-empty and inside the vocabulary [0, {vocab})")
    if cfg.top_k < 0 or not 0 < cfg.top_p <= 1:
        raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {cfg.top_k}, {cfg.top_p}")
    if cfg.pack not in PACK_MODES:
        raise ValueError(f"pack must be one of {PACK_MODES}, got {cfg.pack!r}")
    if cfg.noise not in NOISE_MODES:
        raise ValueError(f"noise must be one of {NOISE_MODES}, got {cfg.noise!r}")
    # what threshold_unmask will check at every step (an integer top_k, a temperature with an fp32 inverse)
    check_sampling_args(cfg.threshold, cfg.temperature, cfg.top_k, cfg.top_p, cfg.noise)
    check_int("seed", cfg.seed, lo=-(2**63), hi=2**63 - 1)  # the Philox key is int64
    max_len = cfg.max_length or model.config.max_position_embeddings
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)):
            raise TypeError(f"prompt {i} must be a list of int token ids, got {type(p).__name__}")
        not_int = [t for t in p if isinstance(t, bool) or not isinstance(t, int)]
        if not_int:
            raise TypeError(f"prompt {i} has token id(s) that are not ints: {not_int[:5]}")
        problem = prompt_problem(p, vocab, mask_id, cfg.max_new_tokens, bs, cfg.max_length,
                                 model.config.max_position_embeddings)
        if problem is not None:
            raise ValueError(f"prompt {i} {problem.text}")
    return max_len


class PromptProblem(NamedTuple):
    """Why a prompt cannot be decoded. kind: "empty", "vocab" (ids outside the vocabulary), "mask" (the mask token
    id inside the prompt) or "fit" (`prompt_fit_problem`); text: a predicate for "the prompt ..." / "prompt 3 ..."."""
    kind: str
    text: str


def prompt_problem(ids: Sequence[int], vocab_size: int, mask_id: int, max_new_tokens: int, block_size: int,
                   max_length: int | None, max_positions: int) -> PromptProblem | None:
    """The sampler's checks of one prompt's int token ids, in its order, or None when it decodes: the one rule and
    wording for the sampler, the generate / eval CLIs and the trainer's up-front checks (each names its prompt its
    own way: `prompt 3`, `file:line: the prompt`, `example 'id': the prompt`)."""
    if len(ids) == 0:
        return PromptProblem("empty", "is empty (no tokens)")
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        return PromptProblem("vocab", f"has token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab_size})")
    if mask_id in ids:
        return PromptProblem("mask", f"contains the mask token id {mask_id} (position {list(ids).index(mask_id)})")
    fit = prompt_fit_problem(len(ids), max_new_tokens, block_size, max_length, max_positions)
    return None if fit is None else PromptProblem("fit", f"does not fit: {fit}")


def prompt_fit_problem(prompt_len: int, max_new_tokens: int, block_size: int, max_length: int | None,
                       max_positions: int) -> str | None:
    """Why a prompt of `prompt_len` tokens cannot be decoded with these settings, or None when it fits (the last
    of `prompt_problem`'s checks, which every caller goes through). The cache holds max_length
    (default: the model's max_position_embeddings) positions for prompt + max_new_tokens; blocks are aligned at
    position 0 and decoded whole, so the last one may end past prompt + max_new_tokens, but not past the model's
    positions (nor past max_length when that is larger)."""
    max_len = max_length or max_positions
    need = prompt_len + max_new_tokens
    if need > max_len:
        return (f"{prompt_len} prompt tokens + max_new_tokens {max_new_tokens} = {need} positions, more than the "
                f"{max_len} the cache holds ({'max_length' if max_length else 'max_position_embeddings'})")
    end = ((need - 1) // block_size + 1) * block_size
    if end > max(max_len, max_positions):
        return (f"{prompt_len} prompt tokens + max_new_tokens {max_new_tokens}: with block_size {block_size} the last "
                f"block ends at position {end}, past the model's max_position_embeddings {max_positions} (blocks "
                f"start at position 0)")
    return None


def finish_rollout(prompts, out, plens, ltot: int, cfg: SamplerConfig, pad_id: int, total_forwards: int,
            seconds: float) -> Rollout:
    seq, smap = out["seq"][:, :ltot].cpu(), out["step_map"][:, :ltot].cpu()  # the decoder's buffers may be wider
    n0, r = seq.shape[0], cfg.max_new_tokens
    idx = plens[:, None] + torch.arange(r)  # [n0, R]
    tokens = seq.gather(1, idx)
    step_map = smap.gather(1, idx)
    logp, conf = out["logp"].cpu().gather(1, idx), out["conf"].cpu().gather(1, idx)
    is_eos = torch.isin(tokens, torch.tensor(cfg.eos_ids))
    eos_found = is_eos.any(1)
    first = torch.where(eos_found, is_eos.int().argmax(1), torch.full((n0,), r - 1))
    resp = torch.arange(r)[None, :] <= first[:, None]
    lengths = resp.sum(1)
    tpf = torch.empty(n0)
    for i in range(n0):
        steps = step_map[i][resp[i]]
        tpf[i] = int(lengths[i]) / max(1, len(torch.unique(steps)))
    return Rollout(
        prompt_ids=[list(p) for p in prompts], sequences=seq, seq_step_map=smap, prompt_lens=plens,
        tokens=torch.where(resp, tokens, pad_id), response_mask=resp, step_map=torch.where(resp, step_map, -1),
        logp=torch.where(resp, logp, 0.0), conf=torch.where(resp, conf, 0.0), lengths=lengths, tpf=tpf,
        forwards=out["forwards"].cpu(), eos_found=eos_found, total_forwards=total_forwards, seconds=seconds,
        finish_reason=["eos" if e else "length" for e in eos_found.tolist()],
    )

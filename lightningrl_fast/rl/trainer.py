"""[train step] One LightningRL step, top to bottom, in one process on one set of weights.

    prompts -> generate -> score -> filter/refill -> advantages -> log-probs -> loss/backward -> step

Each stage is a plain function taking and returning tensors / small dataclasses. The sampler reads the
very parameters the optimizer updates, so the next rollout uses the new weights with no copy at all.
A step's rollouts are decoded in chunks of `rollout_batch_size` sequences on one `sampler.Decoder` (each
step shape captured once per step), released before the training pass so its KV cache does not stay allocated.
`TrainState` holds what persists across steps (model, frozen reference, optimizer with its state kept
across steps — the public pipeline restarts it every step —, scheduler, data cursor, step counter).
Data parallel (several GPUs, `torchrun`): the same stages on every rank, each on its share of the prompts;
`state.env` says who this process is and rl/distributed.py holds the few collectives (global advantages and
loss totals, gradients summed into their owner rank, ZeRO-1 optimizer shards). With one rank they are no-ops.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from ..model import SDARForCausalLM
from ..ops._common import upload
from ..ops.grpo_loss import fused_linear_grpo_loss
from ..sampler import Decoder, Rollout, SamplerConfig, cat_rollouts
from ..tasks import is_correct_batch
from .advantages import Scored, compute_advantages, keep_groups, score_rollout
from .distributed import (SINGLE, DistEnv, all_gather, all_max, all_sum, broadcast_from_owners, owned, partition,
                          reduce_and_clip)
from .logprobs import (LayoutBatch, MicroBatch, build_layout_batch, check_targets, host_copy, iter_micro_batches,
                       micro_batch_logprobs, streamed_logprobs)
from .optim import make_optimizer


@dataclass
class RLConfig:
    """LightningRL hyper-parameters (defaults: the paper's, REFERENCE §4)."""

    steps: int = 100  # RL steps
    prompts_per_step: int = 128  # groups per step after filtering (dynamic sampling refills)
    group_size: int = 32  # samples per prompt (G)
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 10
    grad_clip: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_beta: float = 0.01  # 0 disables the KL term and the reference model
    reference_offload: bool = False  # keep the frozen reference in host memory, streamed to the GPU per layer
    optimizer_offload: bool = False  # keep the fp32 optimizer state in host memory, streamed to the GPU per step
    nll_weight: float = 0.1  # mu: NLL on verifier-correct samples
    tpf_weight: float = 1.0  # w_tpf in r = z_acc + w_tpf * z_tpf
    adv_mode: str = "decoupled"  # "decoupled" | "sum" (the ablation)
    reduction: str = "seq-tok-tok"
    logprob_mode: str = "block_proxy"  # "block_proxy" | "trace"
    min_tpf_range: float = 0.01  # drop groups whose TPF spread is below this
    filter_groups: bool = True
    max_refill_rounds: int = 2  # extra rollout rounds per step to refill filtered groups
    updates_per_step: int = 1  # optimizer steps (PPO mini-batches) per pass over a rollout batch
    epochs_per_step: int = 1  # passes over each rollout batch (PPO epochs; > 1 reuses rollouts, clipped by eps)
    micro_batch_tokens: int = 16384  # positions of one packed forward/backward (memory knob)
    rollout_batch_size: int = 256  # sequences per generate() call of a rollout (sizes the KV cache: memory knob)
    max_nonfinite_steps: int = 3  # stop after this many non-finite updates in a row
    seed: int = 0

    def validate(self) -> None:
        if self.adv_mode not in ("decoupled", "sum"):
            raise ValueError(f"adv_mode must be 'decoupled' or 'sum', got {self.adv_mode!r}")
        if self.logprob_mode not in ("block_proxy", "trace"):
            raise ValueError(f"logprob_mode must be 'block_proxy' or 'trace', got {self.logprob_mode!r}")
        from ..ops.grpo_loss import _parse_reduction

        _parse_reduction(self.reduction)  # was found at the first step with a mixed group, maybe hours in
        for name in ("steps", "prompts_per_step", "group_size", "updates_per_step", "epochs_per_step",
                     "micro_batch_tokens", "rollout_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: advantages are relative within a group")
        for name in ("lr", "grad_clip"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite number, got {v}")


class Task(Protocol):
    def build_prompt(self, example: Any) -> str: ...
    def is_correct(self, response: str, example: Any) -> bool: ...


@dataclass
class TrainState:
    """Everything that persists across RL steps (and is checkpointed)."""

    model: SDARForCausalLM
    ref_model: SDARForCausalLM | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    cursor: int = 0  # examples consumed from the shuffled training stream (global: the same on every rank)
    nonfinite_in_row: int = 0
    env: DistEnv = SINGLE  # this process's rank in a data-parallel run
    owners: list[int] | None = None  # owner rank of each model parameter (ZeRO-1); None with one rank


def make_state(model: SDARForCausalLM, cfg: RLConfig, env: DistEnv = SINGLE) -> TrainState:
    """Fresh RL state. With several ranks the optimizer holds only this rank's parameters (`distributed.partition`)."""
    cfg.validate()
    ref = None
    if cfg.kl_beta > 0 and cfg.reference_offload:
        ref = host_copy(model)
    elif cfg.kl_beta > 0:
        ref = copy.deepcopy(model).eval()
        ref.requires_grad_(False)
    model.zero_grad(set_to_none=True)  # no gradient left over from a warm-up may leak into the first update
    params = list(model.parameters())
    owners = partition([p.numel() for p in params], env.world) if env.active else None
    opt = make_optimizer(owned(params, owners, env), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                         offload=cfg.optimizer_offload)  # fp32 state, on the GPU or in host memory
    warm = max(1, cfg.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return TrainState(model, ref, opt, sched, env=env, owners=owners)


def example_stream(n_examples: int, cursor: int, count: int, seed: int) -> list[int]:
    """Indices `cursor .. cursor+count` of an endless stream of per-epoch shuffles (resumable exactly)."""
    out = []
    for c in range(cursor, cursor + count):
        epoch, i = divmod(c, n_examples)
        perm = list(range(n_examples))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.append(perm[i])
    return out


# ------------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------------

@dataclass
class Groups:
    """Scored samples of some prompts (G each), concatenated across refill rounds."""

    sequences: list[torch.Tensor] = field(default_factory=list)  # per sample [L_i] int64
    step_maps: list[torch.Tensor] = field(default_factory=list)  # per sample [L_i] int32
    prompt_lens: list[int] = field(default_factory=list)
    resp_lens: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    tpf: list[float] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.accuracy)

    def extend(self, other: "Groups", keep: Sequence[bool]) -> None:
        for name in vars(self):
            getattr(self, name).extend(x for x, k in zip(getattr(other, name), keep) if k)

    def scored(self) -> Scored:
        return Scored(torch.tensor(self.accuracy), torch.tensor(self.tpf), torch.tensor(self.group_ids))


def rollout_stage(model, tokenizer, task: Task, examples: list, cfg: RLConfig, scfg: SamplerConfig, seed: int,
                  group_base: int, decoder: Decoder | None = None) -> tuple[Groups, Rollout]:
    """[generate + score] G samples per example; accuracy from the verifier, TPF from the sampler.

    The examples x G sequences are decoded in chunks of `cfg.rollout_batch_size` on one `Decoder` (captured
    steps reused from chunk to chunk); chunk c > 0 draws from Philox seed `seed + c * 2**40`, so the samples of
    a group split across chunks stay independent. A chunk's responses are detokenized and verified on a
    background thread while the next chunk decodes (as eval.evaluate does): the verifiers' helper processes
    and sandboxes run beside the decode instead of after it. A verifier error is raised here."""
    prompts = [tokenizer.encode(task.build_prompt(ex)) for ex in examples]
    flat = [p for p in prompts for _ in range(cfg.group_size)]
    exs = [examples[i // cfg.group_size] for i in range(len(flat))]
    decoder = decoder if decoder is not None else Decoder(model)
    rb = cfg.rollout_batch_size
    parts, scoring = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-score") as scorer:
        try:
            for r0 in range(0, len(flat), rb):
                parts.append(decoder.generate(flat[r0:r0 + rb], dataclasses.replace(scfg, seed=seed + (r0 // rb) * 2**40)))
                scoring.append(scorer.submit(_verify_chunk, task, tokenizer, parts[-1], exs[r0:r0 + rb]))
            done = [f.result() for f in scoring]  # in chunk order
        except BaseException:  # a decode error, a verifier error or Ctrl-C: drop the chunks not yet verified
            for f in scoring:
                f.cancel()
            raise
    ro = cat_rollouts(parts, model.config.mask_token_id)
    texts = [t for chunk_texts, _ in done for t in chunk_texts]
    correct = [c for _, chunk_ok in done for c in chunk_ok]
    gids = torch.arange(len(examples)).repeat_interleave(cfg.group_size) + group_base
    sc = score_rollout(correct, ro.tpf, ro.eos_found, gids)
    g = Groups(
        sequences=list(ro.sequences), step_maps=list(ro.seq_step_map), prompt_lens=ro.prompt_lens.tolist(),
        resp_lens=ro.lengths.tolist(), accuracy=sc.accuracy.tolist(), tpf=sc.tpf.tolist(),
        group_ids=gids.tolist(), texts=texts,
    )
    return g, ro


def _verify_chunk(task: Task, tokenizer, ro: Rollout, examples: list) -> tuple[list[str], list[bool]]:
    """(response texts, verifier verdicts) of one decoded chunk (runs on the rollout's scoring thread)."""
    texts = [tokenizer.decode(ro.response_ids(i), skip_special=True) for i in range(len(ro))]
    return texts, [bool(c) for c in is_correct_batch(task, texts, examples)]  # parallel where the task has it


def collect_groups(state: TrainState, tokenizer, task: Task, train_examples: list, cfg: RLConfig,
                   scfg: SamplerConfig) -> tuple[Groups, dict]:
    """[generate -> score -> filter -> refill] Rollouts until `prompts_per_step` groups carry signal.

    Dynamic sampling: groups dropped by the TPF-aware filter are replaced by fresh prompts, for at most
    `max_refill_rounds` extra rounds (then the batch is used as it is, possibly smaller).
    Several ranks: each needs its share of `prompts_per_step` groups; every round all ranks draw the sum of the
    remaining needs from the global stream (same cursor everywhere) and each takes its slice; group ids are
    global; rank r > 0 samples from its own Philox seed (rank 0 keeps the single-process seed).
    """
    env = state.env
    kept, first = Groups(), None
    decoder = Decoder(state.model)  # for this step's rounds; freed before the training pass needs the memory
    need = cfg.prompts_per_step // env.world + (env.rank < cfg.prompts_per_step % env.world)
    rounds, drawn, stats = 0, 0, {"rollout_s": 0.0, "tokens": 0, "forwards": 0}
    while rounds <= cfg.max_refill_rounds:
        needs = [int(n) for n in all_gather(env, need)] if env.active else [need]  # every rank's remaining need
        total, off = sum(needs), sum(needs[: env.rank])
        if total == 0:
            break
        idx = example_stream(len(train_examples), state.cursor, total, cfg.seed)[off: off + need]
        state.cursor += total
        drawn += total
        rounds += 1
        if need == 0:
            continue
        t0 = time.perf_counter()
        g, ro = rollout_stage(state.model, tokenizer, task, [train_examples[i] for i in idx], cfg, scfg,
                              seed=cfg.seed * 7919 + state.step * 131 + rounds - 1 + env.rank * 2**48,
                              group_base=drawn - total + off, decoder=decoder)
        stats["rollout_s"] += time.perf_counter() - t0
        stats["tokens"] += int(ro.lengths.sum())
        stats["forwards"] += ro.total_forwards
        first = first or g
        keep = keep_groups(g.scored(), cfg.min_tpf_range) if cfg.filter_groups else torch.ones(len(g), dtype=torch.bool)
        n_keep = int(keep.sum()) // cfg.group_size
        if n_keep > need:  # keep the first `need` groups only
            keep &= torch.tensor(g.group_ids) < sorted(set(torch.tensor(g.group_ids)[keep].tolist()))[need]
            n_keep = need
        kept.extend(g, keep.tolist())
        need -= n_keep
    decoder.release()
    stats["rounds"] = rounds
    stats["first_round"] = first
    return kept, stats


def advantage_stage(groups: Groups, cfg: RLConfig, env: DistEnv = SINGLE) -> torch.Tensor:
    """[advantages] per sample [S]. Several ranks: computed over every rank's samples (the batch z-score is
    global; each group lives on one rank), this rank's slice returned."""
    if not env.active:
        return compute_advantages(groups.scored(), cfg.tpf_weight, cfg.adv_mode)
    parts = all_gather(env, (groups.accuracy, groups.tpf, groups.group_ids))
    every = Scored(*(torch.tensor([x for p in parts for x in p[k]]) for k in range(3)))
    start = sum(len(p[0]) for p in parts[: env.rank])
    return compute_advantages(every, cfg.tpf_weight, cfg.adv_mode)[start: start + len(groups)]


def layout_stage(groups: Groups, block_size: int, mask_id: int, mode: str) -> LayoutBatch:
    """[log-prob inputs] pad the samples to one length and build the training layout."""
    length = max(len(s) for s in groups.sequences)
    n = len(groups)
    seqs = torch.full((n, length), mask_id, dtype=torch.int64)
    smap = torch.full((n, length), -2, dtype=torch.int32)
    for i, (s, m) in enumerate(zip(groups.sequences, groups.step_maps)):
        seqs[i, : len(s)], smap[i, : len(m)] = s, m
    return build_layout_batch(seqs, smap, torch.tensor(groups.prompt_lens), torch.tensor(groups.resp_lens),
                              block_size, mask_id, mode)


def micro_batches(lb: LayoutBatch, rows: Sequence[int], budget: int, device: torch.device,
                  pad_id: int = 0) -> Iterator[MicroBatch]:
    """The samples `rows` of lb packed into forwards of at most `budget` positions (`iter_micro_batches`: each
    built when the loop asks for it), row lengths rounded to a few fixed ones on CUDA (one FlexAttention compile
    per length)."""
    return iter_micro_batches(lb, rows, budget, pad_shapes=torch.device(device).type == "cuda", pad_id=pad_id)


@torch.no_grad()
def logprob_stage(model: SDARForCausalLM, lb: LayoutBatch, budget: int) -> torch.Tensor:
    """[log-probs] no-grad per-token log-probs [T] (old policy or frozen reference), on the model's device."""
    dev = next(model.parameters()).device
    check_targets(lb, model.config.vocab_size)  # once, on the host: the ops below skip their device-side reads
    out = torch.empty(lb.num_tokens, device=dev)
    for mb in micro_batches(lb, range(lb.num_rows), budget, dev, model.config.mask_token_id):
        out[upload(mb.sel, dev)] = micro_batch_logprobs(model, mb.to(dev), check_values=False).float()
    return out.cpu()  # one copy (and host sync) per pass


@torch.no_grad()
def reference_stage(state: TrainState, lb: LayoutBatch, cfg: RLConfig) -> torch.Tensor:
    """[log-probs] the frozen reference's per-token log-probs [T]: on its own device, or (a reference kept in host
    memory while the policy is on a GPU) streamed layer by layer to the policy's device."""
    ref_dev = next(state.ref_model.parameters()).device
    dev = next(state.model.parameters()).device
    if ref_dev == dev:
        return logprob_stage(state.ref_model, lb, cfg.micro_batch_tokens)
    mbs = micro_batches(lb, range(lb.num_rows), cfg.micro_batch_tokens, dev,
                        state.model.config.mask_token_id)
    return streamed_logprobs(state.ref_model, lb, mbs, dev, chunk_tokens=16 * cfg.micro_batch_tokens)


def loss_backward_stage(model, lb: LayoutBatch | None, rows: range, adv_tok, old, ref, correct, cfg: RLConfig,
                        env: DistEnv = SINGLE) -> dict:
    """[loss + backward] micro-batched; the micro-batch losses add up to the mini-batch loss (Seq-Tok-Tok).

    Several ranks: the totals (sequences, tokens, correct sequences, their tokens) are summed over the ranks, so
    the rank losses add up to the global mini-batch loss; a rank with no rows (lb None) only joins that sum."""
    dev = next(model.parameters()).device
    local = (0, 0, 0, 0)
    if len(rows):
        in_rows = (lb.tgt_row >= rows.start) & (lb.tgt_row < rows.stop)
        seq_rows = lb.tgt_row[in_rows]
        present = torch.unique(seq_rows)
        local = (len(present), int(in_rows.sum()), int(correct[present].sum()), int(correct[seq_rows].sum()))
    totals = tuple(int(x) for x in all_sum(env, local))
    agg: dict[str, float] = {}
    if not len(rows) or totals[1] == 0:
        return agg
    sums = []  # per micro-batch [loss, kl, clip_frac share], on the device
    correct_dev = upload(correct, dev)
    check_targets(lb, model.config.vocab_size)  # once, on the host; seq ids are lb's rows by construction
    for host_mb in micro_batches(lb, rows, cfg.micro_batch_tokens, dev, model.config.mask_token_id):
        sel, mb = host_mb.sel, host_mb.to(dev)  # sel [t]: the micro-batch's targets among lb's
        hidden = model.hidden(mb.input_ids, mb.position_ids, mb.layout)  # [1, P, H] the packed samples
        h = hidden[0, mb.read_col]  # [t, H] the states that predict the targets
        agg["positions"] = agg.get("positions", 0) + host_mb.positions
        agg["used"] = agg.get("used", 0) + host_mb.used
        # one fused pass: log-probs, loss and its gradient without [t, V] logits (CUDA kernel; chunked reference
        # elsewhere); old_logp None = on-policy (ratio 1 with its gradient)
        loss, stats, _ = fused_linear_grpo_loss(
            h, model.lm_head.weight, mb.targets, upload(old[sel], dev) if old is not None else None,
            upload(ref[sel], dev) if ref is not None else None, upload(adv_tok[sel], dev),
            upload(lb.tgt_row[sel], dev), lb.num_rows, correct_dev, eps_low=cfg.eps_low,
            eps_high=cfg.eps_high, beta=cfg.kl_beta if ref is not None else 0.0, mu=cfg.nll_weight,
            reduction=cfg.reduction, totals=totals, suppress_token=model.config.mask_token_id, check_values=False)
        loss.backward()
        # loss and kl are this micro-batch's share of the mini-batch value (weighted by the totals): they add up;
        # clip_frac is a mean over the micro-batch's tokens: weighted by its share of the tokens
        share = sel.numel() / totals[1]
        sums.append(torch.stack([torch.as_tensor(x).detach().double().to(dev)
                                 for x in (loss, stats["kl"], share * stats["clip_frac"])]))
    if sums:  # one host sync per mini-batch, not one per micro-batch
        agg.update(zip(("loss", "kl", "clip_frac"), torch.stack(sums).sum(0).tolist()))
    return agg


@torch.no_grad()
def clip_grads_(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """One process: scale the gradients of `params` by min(1, max_norm / ||g||) and return ||g||, the global L2 norm.
    torch's clip_grad_norm_ with each parameter's norm taken in fp32: torch takes it in the gradients' dtype, about
    3 significant digits in bf16 (up to ~0.4% off in the clip factor and the logged grad_norm); for fp32 gradients
    the two are the same operations, bit for bit."""
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    dev = grads[0].device
    low = [g for g in grads if g.dtype in (torch.bfloat16, torch.float16)]
    high = [g for g in grads if g.dtype not in (torch.bfloat16, torch.float16)]
    norms = ((list(torch._foreach_norm(low, 2.0, dtype=torch.float32)) if low else [])  # 0-d, fp32 or wider
             + (list(torch._foreach_norm(high, 2.0)) if high else []))
    total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), 2.0)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for d, gs in by_device.items():  # as torch's: the coefficient on each gradient's device
        torch._foreach_mul_(gs, coef.to(d))
    return float(total)


def optimizer_stage(state: TrainState, cfg: RLConfig) -> tuple[bool, float]:
    """[step] clip, skip non-finite updates (counted), AdamW step. Returns (applied, grad norm).

    Several ranks: gradients summed into each parameter's owner, clipped by the global norm (the skip decision is
    the same on every rank), the owner steps, then broadcasts its new weights."""
    env = state.env
    if env.active:
        params = list(state.model.parameters())
        norm = reduce_and_clip(env, params, state.owners, cfg.grad_clip)
    else:
        params = [p for p in state.model.parameters() if p.grad is not None]
        norm = clip_grads_(params, cfg.grad_clip)
    if not math.isfinite(norm):
        state.optimizer.zero_grad(set_to_none=True)
        state.nonfinite_in_row += 1
        if state.nonfinite_in_row >= cfg.max_nonfinite_steps:
            raise FloatingPointError(f"{state.nonfinite_in_row} non-finite updates in a row (grad norm {norm}); "
                                     "stopping: lower the learning rate or check the data")
        return False, norm
    state.nonfinite_in_row = 0
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    if env.active:
        broadcast_from_owners(env, params, state.owners)
    return True, norm


def train_step(state: TrainState, tokenizer, task: Task, train_examples: list, cfg: RLConfig,
               scfg: SamplerConfig, log: Callable[[str], None] | None = None) -> dict:
    """One RL step; returns its metrics (global over the ranks of a data-parallel run). The stages, in order:"""
    t_start = time.perf_counter()
    env = state.env
    # generate -> score -> filter/refill
    groups, rstats = collect_groups(state, tokenizer, task, train_examples, cfg, scfg)
    first: Groups | None = rstats.pop("first_round")
    sums = all_sum(env, [sum(first.accuracy) if first else 0.0, sum(first.tpf) if first else 0.0,
                         len(first) if first else 0, rstats["tokens"], rstats["forwards"], len(groups),
                         sum(groups.accuracy), sum(groups.tpf)])
    n_first, n_kept = max(1, int(sums[2])), int(sums[5])
    rollout_s, rounds = all_max(env, [rstats["rollout_s"], rstats["rounds"]])
    metrics = {"step": state.step + 1, "acc": sums[0] / n_first, "tpf": sums[1] / n_first,
               "groups_kept": n_kept // cfg.group_size, "rollout_s": rollout_s, "tokens": int(sums[3]),
               "forwards": int(sums[4]), "rounds": int(rounds)}
    if n_kept == 0:  # no update: the step counts, the learning-rate warm-up does not advance
        state.step += 1
        metrics.update(skipped="no group carried signal", step_s=time.perf_counter() - t_start)
        return metrics
    lr = state.scheduler.get_last_lr()[0]  # the rate this step's update uses (the scheduler then moves to the next)
    metrics.update(update_stage(state, groups, cfg, scfg.block_size or state.model.config.block_size))
    state.scheduler.step()
    state.step += 1
    metrics.update(lr=lr, step_s=time.perf_counter() - t_start,
                   kept_acc=sums[6] / n_kept, kept_tpf=sums[7] / n_kept)
    return metrics


def update_stage(state: TrainState, groups: Groups, cfg: RLConfig, block_size: int | None = None) -> dict:
    """[advantages -> log-probs -> loss/backward -> step] on one rollout batch (this rank's groups; the other
    ranks' share the collectives). Returns the update's metrics (loss terms summed over the ranks).

    `block_size`: the block size the rollouts were decoded with (default: the model's); the training layout
    must use it, or the log-probs are taken under another mask than the one the samples were drawn under."""
    model, env = state.model, state.env
    mcfg = model.config
    metrics: dict = {}
    # advantages
    adv = advantage_stage(groups, cfg, env)  # [S] this rank's samples
    correct = torch.tensor(groups.accuracy) > 0  # [S] verifier-correct (and finished)
    # log-probs: layout, old policy (only needed with several updates per rollout batch), frozen reference
    t0 = time.perf_counter()
    bs = block_size or mcfg.block_size
    lb = layout_stage(groups, bs, mcfg.mask_token_id, cfg.logprob_mode) if len(groups) else None
    adv_tok = adv[lb.tgt_row] if lb is not None else None  # [T]
    model.eval()
    several = cfg.updates_per_step * cfg.epochs_per_step > 1
    old = logprob_stage(model, lb, cfg.micro_batch_tokens) if several and lb is not None else None
    ref = (reference_stage(state, lb, cfg) if state.ref_model is not None and lb is not None else None)
    metrics["logprob_s"] = time.perf_counter() - t0
    # loss -> backward -> step: `epochs_per_step` passes, each up to `updates_per_step` mini-batches of whole
    # groups (every rank runs the same number of them: the largest rank's count)
    t0 = time.perf_counter()
    model.train()
    n_groups = len(groups) // cfg.group_size
    per = max(1, -(-n_groups // cfg.updates_per_step)) * cfg.group_size
    n_mb = int(all_max(env, [-(-len(groups) // per)])[0])
    n_updates = n_mb * cfg.epochs_per_step
    applied, losses, gnorm = 0, {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0}, 0.0
    work = {"positions": 0, "used": 0}  # packed positions the forwards ran, and those inside samples
    for _epoch in range(cfg.epochs_per_step):
        for u in range(n_mb):
            rows = range(min(len(groups), u * per), min(len(groups), (u + 1) * per))
            agg = loss_backward_stage(model, lb, rows, adv_tok, old, ref, correct, cfg, env)
            ok, gnorm = optimizer_stage(state, cfg)
            applied += ok
            for k, v in agg.items():
                if k in work:
                    work[k] += v
                else:
                    losses[k] += v / n_updates
    model.eval()
    losses = dict(zip(losses, all_sum(env, list(losses.values()))))  # each rank holds its share of the loss
    if state.ref_model is None:  # kl_beta 0: no reference, no KL measured (absent, not a 0.0 that reads "unmoved")
        del losses["kl"]
    positions, used = all_sum(env, [work["positions"], work["used"]])
    metrics.update(losses, grad_norm=gnorm, updates=applied, train_s=time.perf_counter() - t0,
                   train_positions=int(positions), pack_fill=used / positions if positions else 0.0)
    if applied < n_updates:
        metrics["nonfinite_skipped"] = n_updates - applied
    return metrics

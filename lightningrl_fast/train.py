"""`python -m lightningrl_fast.train`: LightningRL post-training of a block-diffusion LLM, end to end.

No arguments = the embedded default (preset `default`, config.PRESETS):
  1. the synthetic arithmetic task (tasks/synthetic.py: several equally valid phrasings, held-out test split)
     and its character tokenizer;
  2. a tiny SDAR-architecture model warmed up by block-diffusion SFT (rl/sft.train_sft on `task.sft_pair`),
     CACHED in `$LRF_CACHE_DIR` or `~/.cache/lightningrl_fast/sft-<hash>/` (hash of the model, task and SFT
     settings): a second run loads it and skips SFT (`--no-cache` trains it again and stores nothing);
  3. greedy evaluation on the test split over a threshold sweep (accuracy, mean TPF per threshold);
  4. LightningRL steps (rl/trainer.train_step) until `--steps` or `--rl-time-budget`, one progress line and
     one metrics.jsonl record per step, checkpoints every `--save-every` steps;
  5. the same evaluation after RL, the before/after table at the rollout threshold, the sweep table,
     PNG plots, `summary.json` and a final checkpoint (an SDAR folder: `--model out/checkpoint-<step>`).
`--baseline rft` replaces step 4 with the rejection-sampling fine-tune of REFERENCE §7 (greedy decode of
the train prompts at --threshold, keep the correct and well-formed outputs, SFT on them) under the same
wall-clock budget, and prints the same table: the two runs compare at equal CPU time.

Real use: `--model DIR --task math|code --train-data FILE [--eval-data FILE]` (DIR: config.json,
safetensors, tokenizer files). `--resume OUT_OR_CHECKPOINT` continues a run exactly (same next batch, same
RNG; the run's saved config.json is the base, flags override it; --lr/--betas/--weight-decay given then replace the
checkpoint's optimizer settings). Resuming from a checkpoint older than the run's newest moves the later
checkpoints and metrics records to `discarded-<k>/` in the run folder (said on the console). An `--out` folder
holding a previous run, a model checkpoint or lying inside the --model folder is refused (continue a run with
--resume); without --out, each run creates its own runs/<timestamp>[-N] folder. `--val-fraction F` / `--val-data
FILE` give a validation split that `--eval-every` evaluates; `--select-best` keeps the evaluated step that meets
REFERENCE §7's bar best in out/best-model and evaluates it at the end too (rl/selection.py).

Several GPUs: `torchrun --nproc-per-node N -m lightningrl_fast.train ...` runs one process per GPU
(rl/distributed.py: rollouts split by prompt, gradients summed, optimizer state sharded over the ranks,
evaluation split by example); rank 0 prints, logs and writes, every rank computes. `--baseline rft` runs in one
process only.

What a run starts from (task, model and tokenizer, data checked against the model, rollout sampler settings, the
embedded default's cached warm-up) is built by run_setup.build_context; this file runs the phases on it.

Exit status: 0 done; 2 bad configuration (reported before any model loads); 3 training stopped on
non-finite updates (nothing non-finite is saved; the last checkpoint stays valid); 130 interrupted (Ctrl-C);
1 other errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ._cli import finish_before_interrupt, interrupted, plain_warnings
from ._jsonfile import write_text_atomic
from .config import OPTIONS, RUN_CONFIG, ConfigError, TrainConfig, parse_config
from .rl.distributed import SINGLE, DistEnv
from .rl.selection import BEST_DIR, Candidate, Selection, reconcile, save_best
from .run_setup import RunContext, build_context, log
from .tasks import is_correct_batch

# path options of the run's config.json
SAVED_AS_ABSOLUTE = ("model", "train_data", "eval_data", "val_data", "cache_dir")

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_NONFINITE = 0, 1, 2, 3


# ------------------------------------------------------------------------------------------------------------
# evaluation
# ------------------------------------------------------------------------------------------------------------

def evaluate(model, tokenizer, task, examples: Sequence, scfg, thresholds: Sequence[float], batch_size: int,
             max_new_tokens: int | None = None, env: DistEnv = SINGLE) -> dict[str, dict[str, float]]:
    """Greedy decoding of `examples` at each threshold -> {f"{tau:g}": {acc, tpf, ...}}: `eval.evaluate`, reshaped.

    acc: verifier-correct AND finished with EOS (a response hitting the length cap is wrong); tpf: mean
    tokens per forward; fwd_per_answer: mean forwards an answer took (prefill and commits included);
    well_formed (synthetic task): every step of the worked trace is right; finished: fraction that emitted
    EOS; tokens_per_s: generated tokens per second of decoding.
    Several ranks: each decodes every world-th example; `eval.evaluate` gathers the per-example results, so
    every rank gets the numbers of all examples."""
    from .eval import evaluate as evaluate_points

    ec = dataclasses.replace(scfg, temperature=0.0, seed=0, max_new_tokens=max_new_tokens or scfg.max_new_tokens)
    taus = sorted(set(float(t) for t in thresholds))
    res = evaluate_points(model, tokenizer, task, list(examples), taus, ec, batch_size=batch_size, env=env)
    out: dict[str, dict[str, float]] = {}
    for p in res["points"]:
        rec = {"acc": p["accuracy"], "tpf": p["mean_tpf"], "fwd_per_answer": p["forwards_per_answer"],
               "finished": p["finished"], "n": p["n"],
               "tokens_per_s": p["tokens_per_s"], "seconds": p["decode_s"]}
        if "well_formed" in p:
            rec["well_formed"] = p["well_formed"]
        out[f"{p['threshold']:g}"] = rec
    return out


# ------------------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------------------

def _sweep_thresholds(cfg: TrainConfig, scfg) -> list[float]:
    return sorted(set(cfg.eval.eval_thresholds) | {scfg.threshold})


def _eval_sweep(ctx: RunContext, label: str, say) -> dict:
    if not ctx.eval_examples:
        say(f"eval {label}: skipped (no evaluation examples; give --eval-data)")
        return {}
    t0 = time.perf_counter()
    res = evaluate(ctx.model, ctx.tokenizer, ctx.task, ctx.eval_examples, ctx.scfg, _sweep_thresholds(ctx.cfg, ctx.scfg),
                   ctx.cfg.eval.eval_batch_size, ctx.cfg.eval.eval_max_new_tokens, env=ctx.env)
    k = f"{ctx.scfg.threshold:g}"
    say(f"eval {label}: {len(ctx.eval_examples)} examples, greedy, tau {k}: acc {res[k]['acc']:.3f} "
        f"TPF {res[k]['tpf']:.2f} ({time.perf_counter() - t0:.1f}s for {len(res)} threshold(s))")
    return res


def _step_eval(ctx: RunContext) -> tuple[str, dict[str, float]]:
    """The greedy evaluation of --eval-every at the rollout threshold: on the validation split when the run has
    one ("val"), else on the held-out set ("eval"). Returns (metric prefix, {acc, tpf[, well_formed]})."""
    split = "val" if ctx.val_examples else "eval"
    tau = ctx.scfg.threshold
    ev = evaluate(ctx.model, ctx.tokenizer, ctx.task, ctx.val_examples or ctx.eval_examples, ctx.scfg, [tau],
                  ctx.cfg.eval.eval_batch_size, ctx.cfg.eval.eval_max_new_tokens, env=ctx.env)[f"{tau:g}"]
    return split, {k: ev[k] for k in ("acc", "tpf", "well_formed") if k in ev}


def _write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=True) + "\n")


def _report(ctx: RunContext, before: dict, after: dict, label: str, history: list, evals: list, say,
            selected: dict | None = None, eval_label: str = "eval (greedy)", kept_eval: dict | None = None) -> dict:
    """Tables on the console and PNG plots; `selected`: --select-best's record (a column of its own when the
    kept step is not the last one); `kept_eval`: the kept validation evaluation, starred in the training plot."""
    from .rl.logging import before_after_table, plot_sweep, plot_training, sweep_table

    cfg = ctx.cfg
    tau = ctx.scfg.threshold
    plots = {}
    kept = {f"kept step {selected['step']}": selected["eval"]} if selected and selected["eval"] is not after else {}
    if before and after:
        say("")
        say(sweep_table({"before": before, label: after, **kept}, title="threshold sweep (greedy, held-out)"))
        say("")
        say(before_after_table(before, after, tau, labels=("before", label), extra_rows=kept or None))
    if cfg.run.plots:
        if history:
            p = plot_training(history, ctx.out / "training.png", log=say, evals=evals, eval_label=eval_label,
                              kept=kept_eval)
            if p:
                plots["training"] = str(p)
        if before and after:
            p = plot_sweep({"before": before, label: after, **kept}, ctx.out / "sweep.png", log=say)
            if p:
                plots["sweep"] = str(p)
        if plots:
            say("plots: " + ", ".join(plots.values()))
    return plots


def run_rl(ctx: RunContext, say: Callable[[str], None] = log) -> int:
    from .rl.checkpointing import NonFiniteModelError, load_checkpoint, save_checkpoint_ranks, set_aside_later
    from .rl.distributed import barrier, broadcast, check_training_memory
    from .rl.logging import RunLogger, read_metrics
    from .rl.trainer import make_state, train_step

    cfg, rl, env = ctx.cfg, ctx.cfg.rl, ctx.env
    kl = rl.kl_beta > 0
    check_training_memory(ctx.model, ctx.device, env.world, reference=kl and not rl.reference_offload,
                          optimizer_offload=rl.optimizer_offload, reference_offload=kl and rl.reference_offload,
                          ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", env.world)))
    state = make_state(ctx.model, rl, env)
    extra: dict[str, Any] = {}
    metrics_len = None
    reference_dir, reference_fp = ctx.reference_dir, ctx.reference_fingerprint
    if ctx.resume_from is not None:
        loaded = load_checkpoint(ctx.resume_from, state, config=rl, env=env)
        extra, metrics_len = loaded.extra, loaded.metrics_len
        reference_dir, reference_fp = loaded.reference_dir, loaded.reference_fingerprint
        say(f"resume: step {state.step}, data cursor {state.cursor} from {loaded.path}")
        if env.main:  # resumed from an older checkpoint: what it would replace goes aside, not away
            dest, moved, n_rec = set_aside_later(ctx.out, loaded.path, metrics_len)
            if dest is not None:
                say(f"resume: the run had gone past step {state.step}: moved {', '.join(moved) or 'no checkpoint'} "
                    f"and {n_rec} later metrics record(s) to {dest} (the resumed run replaces them)")
        barrier(env)
    if env.main:  # a metrics.jsonl the run cannot continue is reported before minutes of evaluation
        read_metrics(ctx.out, strict=True)
    before = extra.get("eval_before") or _eval_sweep(ctx, "before RL", say)
    elapsed = float(extra.get("rl_elapsed_s", 0.0))
    budget = cfg.run.rl_time_budget
    select = cfg.eval.select_best and bool(ctx.val_examples)
    sel = Selection.from_dict(extra["selection"], cfg.eval.select_margin) if extra.get("selection") else None
    if select and sel is not None:  # resumed: the kept step's weights must still be in out/best-model
        sel = broadcast(env, reconcile(ctx.out, sel, say) if env.main else None)
    sel = sel if sel is not None else Selection(cfg.eval.select_margin)
    logger = RunLogger(ctx.out, total_steps=rl.steps, progress=cfg.run.progress, truncate_to=metrics_len,
                       initial_step=state.step, write=env.main)

    def ckpt_extra() -> dict:
        return {"eval_before": before, "rl_elapsed_s": elapsed, "train_config": cfg.to_dict(), "phase": "rl",
                **({"selection": sel.to_dict()} if select else {})}

    def save() -> Path:
        with finish_before_interrupt(f"checkpoint-{state.step}"):
            return save_checkpoint_ranks(env, ctx.out, state, ckpt_extra(), config=rl,
                                         keep=cfg.checkpoint.keep_checkpoints, tokenizer=ctx.tokenizer,
                                         reference_dir=reference_dir, reference_fingerprint=reference_fp,
                                         metrics_len=logger.n_logged)

    def validate(m: dict[str, Any] | None) -> None:
        """--eval-every's evaluation of the current weights; with --select-best, offer them to the selection
        (rank 0 saves them when they become the kept step). `m`: the step's metrics record (None: before RL)."""
        nonlocal last_validated
        split, ev = _step_eval(ctx)
        if m is not None:
            m.update({f"{split}_{k}": v for k, v in ev.items()})
        kept = select and sel.offer(Candidate(state.step, ev["acc"], ev["tpf"]))
        if kept and env.main:
            with finish_before_interrupt("best-model"):
                save_best(ctx.out, ctx.model, ctx.tokenizer, sel)
        line = f"{'validation' if split == 'val' else 'eval'} (greedy, tau {tau:g}) at step {state.step}: " \
               f"acc {ev['acc']:.3f} TPF {ev['tpf']:.2f}" + ("  [kept: best-model]" if kept else "")
        if m is not None:
            logger.info("  " + line)
        else:
            say(line)
        last_validated = state.step

    tau = ctx.scfg.threshold
    last_validated = -1
    if select and sel.best is None:  # before RL (or the resumed step): the start of the selection
        validate(None)
    say(f"RL: {rl.steps} steps" + (f" or {budget:g}s" if budget else "") + f", {rl.prompts_per_step} prompts x "
        f"{rl.group_size} samples per step, lr {rl.lr:g}, kl_beta {rl.kl_beta:g}, tau {tau:g}, "
        f"{len(ctx.train_examples)} train prompts -> {ctx.out}")
    status = EXIT_OK
    if state.step >= rl.steps:
        say(f"RL: the run is already at step {state.step} (--steps {rl.steps}): nothing to train; raise --steps to "
            "continue it (its final checkpoint and evaluation are written again)")

    def out_of_time() -> bool:  # rank 0's clock decides for every rank (one leaving alone would stall the others)
        return broadcast(env, budget is not None and elapsed >= budget)

    try:
        stop = out_of_time()
        while state.step < rl.steps:
            if stop:
                logger.info(f"RL: time budget {budget:g}s reached after {state.step} steps")
                break
            t0 = time.perf_counter()
            m = train_step(state, ctx.tokenizer, ctx.task, ctx.train_examples, rl, ctx.scfg)
            elapsed += time.perf_counter() - t0
            stop = out_of_time()  # once per step: decides this step's "last" and the next iteration
            m["reward"] = m["acc"] + rl.tpf_weight * m["tpf"]
            m["tokens_per_s"] = m["tokens"] / m["rollout_s"] if m.get("rollout_s") else None
            m["elapsed_s"] = elapsed
            last = select and (state.step >= rl.steps or stop)
            every = cfg.eval.eval_every and state.step % cfg.eval.eval_every == 0
            if (every and (ctx.val_examples or ctx.eval_examples)) or last:  # the selection always sees the last step
                validate(m)
            logger.log_step(m)
            if cfg.checkpoint.save_every and state.step % cfg.checkpoint.save_every == 0 and state.step < rl.steps:
                p = save()
                logger.info(f"  checkpoint: {p}")
    except FloatingPointError as ex:
        logger.close()
        say(f"error: training stopped: {ex}")
        say("nothing was saved from the failing steps; the last checkpoint (if any) is intact: "
            f"{ctx.out / 'latest'}")
        return EXIT_NONFINITE
    finally:
        logger.close()
    if select and last_validated != state.step:  # a resumed run that had already reached --steps
        validate(None)
    final = None
    if cfg.checkpoint.save_final:
        try:
            final = save()
            say(f"checkpoint: {final} (load with --model {final})")
        except NonFiniteModelError as ex:
            say(f"error: {ex}")
            status = EXIT_NONFINITE
    after = _eval_sweep(ctx, "after RL", say)
    selected = _selected_sweep(ctx, sel, after, state.step, say) if select else None
    history = logger.history
    updated = sum(m.get("updates", 0) > 0 for m in history)  # a step's optimizer updates that were applied
    if updated < len(history):
        say(f"RL: {updated} of {len(history)} steps updated the model (the others had no group with a reward signal, "
            "or only non-finite updates: see `skipped` / `nonfinite_skipped` in metrics.jsonl)")
    ekey = "val_acc" if ctx.val_examples else "eval_acc"
    evals = [{"step": m["step"], "acc": m[ekey], "tpf": m[ekey.replace("acc", "tpf")]} for m in history if ekey in m]
    if select and sel.start is not None and all(e["step"] != sel.start.step for e in evals):
        evals.insert(0, dataclasses.asdict(sel.start))  # the evaluation before RL (or at the resumed step)
    if not env.main:
        return status
    plots = _report(ctx, before, after, "after RL", history, evals, say, selected,
                    eval_label="validation (greedy)" if ctx.val_examples else "held-out eval (greedy)",
                    kept_eval=dataclasses.asdict(sel.best) if select and sel.best is not None else None)
    _write_json(ctx.out / "summary.json", {
        "mode": "lightningrl", "steps": state.step, "steps_updated": updated, "rl_elapsed_s": elapsed, "threshold": tau,
        "eval_before": before, "eval_after": after, "final_checkpoint": str(final) if final else None,
        "plots": plots, "metrics": str(ctx.out / "metrics.jsonl"),
        **({"selection": selected} if selected is not None else {}),
    })
    return status


def _selected_sweep(ctx: RunContext, sel: Selection, after: dict, last_step: int, say) -> dict[str, Any]:
    """--select-best at the end: the kept step, its validation numbers and its held-out sweep (the last step's
    when it is the last step; else its weights are loaded from out/best-model into the model, which the run
    no longer trains, and evaluated)."""
    from .rl.checkpointing import load_weights_into
    from .rl.distributed import broadcast_params

    assert sel.best is not None and sel.start is not None
    b = sel.best
    rec: dict[str, Any] = {"step": b.step, "val_acc": b.acc, "val_tpf": b.tpf, "val_acc_before": sel.start.acc,
                           "margin": sel.margin, "model": str(ctx.out / BEST_DIR)}
    if b.step == sel.start.step == 0:
        note = "the model before RL (no evaluated RL step had a higher TPF within the margin of its accuracy)"
    else:
        note = "the last step" if b.step == last_step else f"step {b.step}"
    say(f"select: kept {note} (validation acc {b.acc:.3f} TPF {b.tpf:.2f}; before RL {sel.start.acc:.3f}, "
        f"margin {sel.margin:g}) -> {ctx.out / BEST_DIR}")
    if b.step == last_step:
        rec["eval"] = after
        return rec
    if ctx.env.main:
        load_weights_into(ctx.model, ctx.out / BEST_DIR)
    broadcast_params(ctx.env, ctx.model)
    rec["eval"] = _eval_sweep(ctx, f"of the kept step {b.step}", say)
    return rec


def run_rft(ctx: RunContext, say: Callable[[str], None] = log) -> int:
    """REFERENCE §7 baseline: greedy decode of the train prompts at tau, keep the verifier-correct outputs
    (synthetic task: the whole worked trace is checked), fine-tune on them with the SFT objective, all within
    the RL budget."""
    from .checkpoint import save_model
    from .rl.checkpointing import nonfinite_parameters
    from .rl.distributed import check_training_memory
    from .rl.sft import train_sft
    from .sampler import Decoder

    cfg, b = ctx.cfg, ctx.cfg.baseline
    # one process, no reference: weights, gradients and the optimizer state (or, offloaded, its pinned host copy)
    check_training_memory(ctx.model, ctx.device, 1, reference=False, optimizer_offload=cfg.rl.optimizer_offload)
    budget = cfg.run.rl_time_budget
    tau = ctx.scfg.threshold
    before = _eval_sweep(ctx, "before RFT", say)
    t_start = time.perf_counter()
    examples = ctx.train_examples[: b.rft_max_prompts] if b.rft_max_prompts else ctx.train_examples
    prompts = [ctx.tokenizer.encode(ctx.task.build_prompt(ex)) for ex in examples]
    dec = dataclasses.replace(ctx.scfg, temperature=0.0, seed=0)
    kept: list[tuple[list[int], list[int]]] = []  # (prompt ids, response ids) of the verified-correct outputs
    decoder = Decoder(ctx.model)  # one engine for every batch, released before the fine-tune
    for i in range(0, len(prompts), cfg.eval.eval_batch_size):
        chunk, exs = prompts[i:i + cfg.eval.eval_batch_size], examples[i:i + cfg.eval.eval_batch_size]
        ro = decoder.generate(chunk, dec)
        texts = [ctx.tokenizer.decode(ro.response_ids(j), skip_special=True) for j in range(len(ro))]
        ok = is_correct_batch(ctx.task, texts, list(exs))
        for j in range(len(texts)):
            if ok[j] and bool(ro.eos_found[j]):  # the task's verifier decides (synthetic: the whole trace)
                kept.append((chunk[j], ro.response_ids(j)))
        if budget is not None and time.perf_counter() - t_start > budget:
            say("RFT: time budget reached while decoding")
            break
    decoder.release()
    decode_s = time.perf_counter() - t_start
    say(f"RFT: decoded {len(prompts)} train prompts greedily at tau {tau:g} in {decode_s:.1f}s; "
        f"{len(kept)} correct and kept")
    remaining = None if budget is None else budget - decode_s
    losses: list[float] = []
    if kept and (remaining is None or remaining > 0):
        say(f"RFT: fine-tune {b.rft_steps} steps x {b.rft_batch_size}, lr {b.rft_lr:g}"
            + (f", {remaining:.0f}s left of the budget" if remaining is not None else ""))
        losses = train_sft(ctx.model, lambda rng: rng.choice(kept), steps=b.rft_steps, batch_size=b.rft_batch_size,
                           lr=b.rft_lr, pad_id=ctx.tokenizer.pad_token_id, seed=cfg.rl.seed,
                           warmup=max(1, min(20, b.rft_steps // 10)), log_every=max(1, b.rft_steps // 10), log=say,
                           time_budget_s=remaining, micro_batch_tokens=cfg.rl.micro_batch_tokens,
                           optimizer_offload=cfg.rl.optimizer_offload)
    elapsed = time.perf_counter() - t_start
    say(f"RFT: {len(losses)} fine-tune steps, phase took {elapsed:.1f}s")
    with open(ctx.out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"phase": "rft_decode", "prompts": len(prompts), "correct": len(kept), "kept": len(kept),
                            "seconds": decode_s}) + "\n")
        for i, loss in enumerate(losses):
            f.write(json.dumps({"phase": "rft_sft", "step": i + 1, "loss": loss if math.isfinite(loss) else None}) + "\n")
    status = EXIT_OK
    final = None
    bad = nonfinite_parameters(ctx.model)
    if bad:
        say(f"error: the fine-tuned model has non-finite parameters ({', '.join(bad[:3])}); not saved")
        status = EXIT_NONFINITE
    elif cfg.checkpoint.save_final:
        with finish_before_interrupt("rft-model"):
            final = save_model(ctx.model, ctx.model.config, ctx.out / "rft-model", tokenizer=ctx.tokenizer)
        say(f"model: {final} (load with --model {final})")
    after = _eval_sweep(ctx, "after RFT", say) if status == EXIT_OK else {}
    plots = _report(ctx, before, after, "after RFT", [], [], say)
    _write_json(ctx.out / "summary.json", {
        "mode": "rft", "phase_s": elapsed, "decode_s": decode_s, "kept": len(kept), "sft_steps": len(losses),
        "threshold": tau, "eval_before": before, "eval_after": after, "final_model": str(final) if final else None,
        "plots": plots,
    })
    return status


def run(cfg: TrainConfig, say: Callable[[str], None] = log) -> int:
    """Run a validated config (see the module docstring). Returns the exit status. Under torchrun (WORLD_SIZE
    > 1) every rank runs it: rank 0 prints and writes, the others compute."""
    from .rl import distributed

    try:
        env = distributed.env_from_environment()
        if env.active and cfg.run.baseline == "rft":
            raise ValueError("--baseline rft runs in one process; start it without torchrun")
        env, device = distributed.init(env, distributed.resolve_device(cfg.data.device), cfg.run.dist_timeout_min)
    except ValueError as ex:
        raise ConfigError(str(ex)) from None
    with distributed.joined(env):
        return _run(cfg, say if env.main else (lambda _msg: None), env, device)


def _run(cfg: TrainConfig, say: Callable[[str], None], env: DistEnv, device: torch.device) -> int:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    random.seed(cfg.rl.seed)
    torch.manual_seed(cfg.rl.seed)
    t0 = time.perf_counter()
    ctx = build_context(cfg, say, env, device)
    # the resolved config (a resumed run's changes included): `--config out/config.json` repeats the run and
    # `--resume out` starts from it
    saved = cfg.to_dict()
    saved["data"]["out"] = str(ctx.out)
    saved["checkpoint"]["resume"] = None
    for key in SAVED_AS_ABSOLUTE:  # a resume from another working directory finds the same files
        o = OPTIONS[key]
        if saved[o.section][o.name] not in (None, "none"):
            saved[o.section][o.name] = str(Path(saved[o.section][o.name]).absolute())
    if env.main:
        _write_json(ctx.out / RUN_CONFIG, saved)
    n_params = sum(p.numel() for p in ctx.model.parameters())
    ranks = f" x {env.world} ranks" if env.active else ""
    say(f"run: {ctx.out} | device {ctx.device}{ranks} | {n_params / 1e6:.2f} M parameters "
        f"({next(ctx.model.parameters()).dtype}) | task {cfg.data.task}: {len(ctx.train_examples)} train / "
        f"{len(ctx.eval_examples)} eval" + (f" / {len(ctx.val_examples)} validation" if ctx.val_examples else "")
        + f" examples | block {ctx.scfg.block_size or ctx.model.config.block_size}, "
        f"max new tokens {ctx.scfg.max_new_tokens}")
    status = run_rft(ctx, say) if cfg.run.baseline == "rft" else run_rl(ctx, say)
    say(f"done in {time.perf_counter() - t0:.1f}s -> {ctx.out}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    with plain_warnings():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return run(cfg)
    except ConfigError as ex:  # found once the environment is known (torchrun variables, devices)
        print(f"error: {ex}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _load_errors() as ex:  # data/checkpoint problems found while loading, a GPU too small for the run
        if interrupted(ex):
            print("interrupted", file=sys.stderr)
            return 130
        print(f"error: {ex}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as ex:
        if interrupted(ex):  # Ctrl-C turned into another error by a library (e.g. inside torch.save)
            print("interrupted", file=sys.stderr)
            return 130
        raise


def _load_errors() -> tuple[type[BaseException], ...]:
    from .checkpoint import CheckpointError
    from .rl.distributed import HostMemoryError
    from .rl.logging import MetricsFileError
    from .tasks.data import DataFormatError

    return (FileNotFoundError, CheckpointError, DataFormatError, MetricsFileError, torch.cuda.OutOfMemoryError,
            HostMemoryError)


if __name__ == "__main__":
    sys.exit(main())

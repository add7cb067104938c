"""What a training run starts from: `build_context(cfg) -> RunContext` (the task, the model and its tokenizer,
the train / evaluation / validation examples checked against the model, the rollout SamplerConfig, the run
folder), and the embedded default's pieces (the synthetic task, the tiny model's config and its block-diffusion
SFT warm-up, cached by a hash of what it depends on).

train.py runs the RL loop (or the RFT baseline) on a RunContext; nothing here trains except the warm-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .config import ConfigError, TrainConfig, cache_root
from .rl.distributed import SINGLE, DistEnv

SFT_CACHE_VERSION = 4  # bump when the SFT recipe changes in a way the cache key cannot see


def log(msg: str) -> None:
    print(msg, flush=True)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and checkpoint_dtype is not None:
            return checkpoint_dtype
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_synthetic_task(cfg: TrainConfig):
    from .tasks.synthetic import SyntheticArithmetic

    e = cfg.embedded
    # The split hash seed is fixed (0): the held-out test set is the same whatever --seed (or --val-fraction) is.
    return SyntheticArithmetic(num_operands=e.num_operands, max_operand=e.max_operand, test_fraction=e.test_fraction,
                               val_fraction=cfg.data.val_fraction)


def default_max_new_tokens(cfg: TrainConfig, task: Any, block_size: int) -> int:
    if cfg.sampler.max_new_tokens is not None:
        return cfg.sampler.max_new_tokens
    if hasattr(task, "max_response_tokens"):
        n = task.max_response_tokens()
        return -(-n // block_size) * block_size + block_size
    return 256


def embedded_model_config(cfg: TrainConfig, tokenizer: Any):
    from .model import SDARConfig

    e = cfg.embedded
    return SDARConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=e.hidden_size, intermediate_size=e.intermediate_size,
        num_hidden_layers=e.num_layers, num_attention_heads=e.num_heads, num_key_value_heads=e.num_kv_heads,
        head_dim=e.head_dim, block_size=e.model_block_size, mask_token_id=tokenizer.mask_token_id,
        max_position_embeddings=256, torch_dtype="float32", tie_word_embeddings=True,
    )


def sft_cache_key(cfg: TrainConfig, mcfg: Any) -> str:
    e = cfg.embedded
    spec = {
        "version": SFT_CACHE_VERSION,
        "model": mcfg.to_dict(),
        "task": {"name": "synthetic", "num_operands": e.num_operands, "max_operand": e.max_operand,
                 "test_fraction": e.test_fraction},
        "sft": {"steps": e.sft_steps, "batch_size": e.sft_batch_size, "lr": e.sft_lr, "warmup": e.sft_warmup,
                "time_budget": e.sft_time_budget},
        "seed": cfg.rl.seed,
    }
    if cfg.data.val_fraction:  # the warm-up never sees the validation prompts (keys without one are unchanged)
        spec["task"]["val_fraction"] = cfg.data.val_fraction
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def embedded_sft_model(cfg: TrainConfig, task: Any, device: torch.device, dtype: torch.dtype,
                       say: Callable[[str], None] = log):
    """The SFT warm-up model of the embedded default: from the cache, or trained (and cached)."""
    from .checkpoint import load_model, save_model
    from .model import build_model
    from .rl.sft import train_sft

    tok = task.tokenizer
    mcfg = embedded_model_config(cfg, tok)
    e = cfg.embedded
    folder = cache_root(cfg) / f"sft-{sft_cache_key(cfg, mcfg)}"
    if e.cache and (folder / "config.json").is_file():
        try:
            model, _ = load_model(folder, dtype=dtype, device=device)
            model.zero_grad(set_to_none=True)
            say(f"SFT warm-up: loaded from the cache {folder}")
            return model, folder
        except Exception as ex:  # a broken cache entry is rebuilt
            say(f"SFT warm-up: cache entry {folder} unreadable ({ex}); training again")
    model = build_model(mcfg, device=device, dtype=torch.float32, seed=cfg.rl.seed)
    model.gradient_checkpointing = cfg.run.gradient_checkpointing
    n_params = sum(p.numel() for p in model.parameters())
    say(f"SFT warm-up: {n_params / 1e6:.2f} M parameters, {e.sft_steps} steps x {e.sft_batch_size} pairs, "
        f"lr {e.sft_lr:g}" + (f", budget {e.sft_time_budget:g}s" if e.sft_time_budget else ""))
    train = task.train
    t0 = time.perf_counter()
    losses = train_sft(model, lambda rng: task.sft_pair(rng.choice(train), rng), steps=e.sft_steps,
                       batch_size=e.sft_batch_size, lr=e.sft_lr, pad_id=tok.pad_token_id, seed=cfg.rl.seed,
                       warmup=e.sft_warmup, log_every=max(1, e.sft_steps // 10), log=say,
                       time_budget_s=e.sft_time_budget)
    secs = time.perf_counter() - t0
    say(f"SFT warm-up: {len(losses)} steps in {secs:.1f}s, final loss {sum(losses[-20:]) / max(1, len(losses[-20:])):.4f}")
    # train_sft leaves the last step's gradients on the parameters: the first RL backward would add to them
    model.zero_grad(set_to_none=True)
    model = model.to(dtype=dtype).eval()
    if e.cache:
        save_model(model, mcfg, folder, tokenizer=tok)
        (folder / "sft_info.json").write_text(json.dumps({"steps": len(losses), "seconds": secs, "losses": losses[-100:]}))
        say(f"SFT warm-up: cached in {folder}")
    return model, (folder if e.cache else None)


@dataclasses.dataclass
class RunContext:
    cfg: TrainConfig
    out: Path
    device: torch.device
    model: Any
    tokenizer: Any
    task: Any
    train_examples: list
    eval_examples: list
    scfg: Any  # rollout SamplerConfig (eos ids from the tokenizer, block size resolved)
    reference_dir: Path | None  # where the initial policy lives (None: saved into out/reference when needed)
    reference_fingerprint: str | None  # of reference_dir, taken when the model was loaded
    resume_from: Path | None
    env: DistEnv = SINGLE  # this process's rank (data-parallel runs)
    val_examples: list = dataclasses.field(default_factory=list)  # validation split (--val-data / --val-fraction)


def load_task_examples(path: str, fmt: str | None, limit: int | None, say, task: str | None = None) -> list:
    from .tasks import load_examples
    from .tasks.data import DataFormatError

    res = load_examples(path, fmt=fmt, limit=limit)
    wrong = [e for e in res.examples if task is not None and e.kind != task]
    if wrong:
        raise DataFormatError(f"{path}: {len(wrong)} of {len(res.examples)} examples are {wrong[0].kind!r} problems, "
                              f"not {task!r} (e.g. {wrong[0].id}); pick the matching --task")
    say(f"data: {len(res)} examples from {path} (format {res.fmt}" + (f", {res.skipped} malformed rows skipped)" if res.skipped else ")"))
    return list(res.examples)


def fit_examples(examples: list, task: Any, tokenizer: Any, model_cfg: Any, max_new_tokens: int, max_length: int | None,
                 label: str, say: Callable[[str], None], block_size: int | None = None) -> list:
    """Encode every templated prompt once, before the first rollout: a prompt the tokenizer cannot encode, that
    encodes to the mask token or to ids outside the model's vocabulary, is an error naming its example (it would
    stop the run at whatever step drew it); a prompt that does not fit the model's positions with `max_new_tokens`
    of response (the sampler's rule, sampler.prompt_problem, with the decoded block size) is dropped, with a
    count (an error when none is left)."""
    from .sampler import prompt_problem
    from .tasks.data import DataFormatError

    bs = block_size or model_cfg.block_size
    mask_id, vocab = model_cfg.mask_token_id, model_cfg.vocab_size
    kept, too_long = [], []
    for ex in examples:
        name = getattr(ex, "id", None) or f"#{len(kept) + len(too_long)}"
        try:
            ids = tokenizer.encode(task.build_prompt(ex))
        except (ValueError, TypeError) as e:  # TypeError: the Rust tokenizer on text it cannot take
            raise DataFormatError(f"{label} example {name}: its prompt cannot be encoded by the tokenizer: {e}") from None
        problem = prompt_problem(ids, vocab, mask_id, max_new_tokens, bs, max_length, model_cfg.max_position_embeddings)
        if problem is not None and problem.kind != "fit":
            hint = {"mask": "; remove the literal mask token from the text",
                    "vocab": " (a tokenizer that does not match the model?)"}.get(problem.kind, "")
            raise DataFormatError(f"{label} example {name}: the prompt {problem.text}{hint}")
        if problem is not None:
            too_long.append((name, f"the prompt {problem.text}"))
        else:
            kept.append(ex)
    if too_long:
        msg = (f"{label}: {len(too_long)} of {len(examples)} prompts do not fit the model's positions with "
               f"{max_new_tokens} new tokens (e.g. example {too_long[0][0]}: {too_long[0][1]})")
        if not kept:
            raise DataFormatError(msg + "; none is left: lower --max-new-tokens or use shorter prompts")
        say(f"warning: {msg}: dropped")
    return kept


def _check_positions(cfg: TrainConfig, model_cfg: Any, folder: str | Path, say: Callable[[str], None]) -> Any:
    """Before the model loads: the decoded block size must fit the model's positions (ConfigError), and a
    --max-length past them is said (rollouts would decode positions the model never saw). Returns model_cfg."""
    pos = model_cfg.max_position_embeddings
    bs = cfg.sampler.block_size or model_cfg.block_size
    if bs > max(pos, cfg.sampler.max_length or 0):
        src = "--block-size" if cfg.sampler.block_size else f"{folder}/config.json block_size"
        raise ConfigError(f"{src} {bs} exceeds the model's max_position_embeddings {pos}")
    if cfg.sampler.max_length and cfg.sampler.max_length > pos:
        say(f"warning: --max-length {cfg.sampler.max_length} is past the model's max_position_embeddings {pos}: "
            "rollouts may decode positions the model was not trained for")
    return model_cfg


def _tokenizer_of(folder: str | Path):
    """The checkpoint's tokenizer; a missing or corrupt tokenizer file is a CheckpointError naming the folder."""
    from .checkpoint import CheckpointError
    from .tokenizer import load_tokenizer

    try:
        return load_tokenizer(folder)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {folder}: {e}") from None


def new_run_folder(base: Path) -> Path:
    """Create `base`, or `base-1`, `base-2`, ... when it exists (exclusive mkdir: concurrent runs get distinct
    folders); returns the folder created."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(10_000):
        cand = base if i == 0 else base.with_name(f"{base.name}-{i}")
        try:
            cand.mkdir()
            return cand
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: no free run folder name (tried {base.name}-1 .. -9999); give --out DIR")


def build_context(cfg: TrainConfig, say: Callable[[str], None] = log, env: DistEnv = SINGLE,
                  device: torch.device | None = None) -> RunContext:
    """Task, model, tokenizer, data and sampler settings of a run. Several ranks: every rank loads the same
    model (rank 0 alone trains or loads the embedded SFT warm-up) and then takes rank 0's weights."""
    from .checkpoint import load_model, read_config
    from ._cli import warn_mask_mismatch
    from .rl.checkpointing import resolve_checkpoint
    from .rl.distributed import broadcast, broadcast_params, resolve_device
    from .sampler import SamplerConfig

    device = device if device is not None else resolve_device(cfg.data.device)
    d = cfg.data
    resume_from = resolve_checkpoint(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
    if d.out:
        out = Path(d.out)
    elif resume_from is not None:
        out = resume_from.parent
    else:
        out = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        if env.main:  # two runs started in the same second must not share (and mix) one folder
            out = new_run_folder(out)
    out = Path(broadcast(env, str(out.absolute())))  # rank 0's clock names the run folder
    out.mkdir(parents=True, exist_ok=True)

    # task
    if d.task == "synthetic":
        task = make_synthetic_task(cfg)
    else:
        from .tasks import get_task

        task = get_task(d.task)

    # model + tokenizer
    reference_dir: Path | None = None
    reference_fp: str | None = None
    if resume_from is not None:
        ck_dtype = _check_positions(cfg, read_config(resume_from), resume_from, say).dtype
        tokenizer = _tokenizer_of(resume_from)  # before the (long) model load
        model, _ = load_model(resume_from, dtype=resolve_dtype(d.dtype, device, ck_dtype), device=device)
        say(f"resume: model from {resume_from}")
    elif d.model is not None:
        ck_dtype = _check_positions(cfg, read_config(d.model), d.model, say).dtype
        tokenizer = _tokenizer_of(d.model)
        model, _ = load_model(d.model, dtype=resolve_dtype(d.dtype, device, ck_dtype), device=device)
        say(f"model: {d.model}")
        if cfg.rl.kl_beta > 0:  # the KL reference is this folder: remember what it held at the start
            from .rl.checkpointing import fingerprint

            reference_dir, reference_fp = Path(d.model).absolute(), fingerprint(d.model)
    elif env.main:
        tokenizer = task.tokenizer
        model, _ = embedded_sft_model(cfg, task, device, resolve_dtype(d.dtype, device, None), say)
    else:  # rank 0 trains (or loads) the warm-up; this rank gets its weights below
        from .model import build_model

        tokenizer = task.tokenizer
        model = build_model(embedded_model_config(cfg, tokenizer), device=device, dtype=torch.float32,
                            seed=cfg.rl.seed).to(dtype=resolve_dtype(d.dtype, device, None)).eval()
    broadcast_params(env, model)  # identical weights on every rank from the start (no-op with one rank)
    model.gradient_checkpointing = cfg.run.gradient_checkpointing
    if env.main:
        warn_mask_mismatch(tokenizer, model.config)

    # data
    if d.task == "synthetic":  # its own split; --val-fraction carves the validation tuples out of train
        train_examples, eval_examples, val_examples = list(task.train), list(task.test), list(task.val)
        if d.val_fraction and not val_examples:
            raise ConfigError(f"--val-fraction {d.val_fraction:g} carves no validation prompt out of the synthetic "
                              f"task's {len(train_examples)} training tuples; raise it")
    else:
        from .rl.selection import split_by_hash
        from .tasks.data import DataFormatError

        # --max-train-examples counts the prompts left for training, after the validation carve
        train_examples = load_task_examples(d.train_data, d.data_format, None if d.val_fraction else d.max_train_examples,
                                        say, d.task)
        eval_examples = load_task_examples(d.eval_data, d.data_format, None, say, d.task) if d.eval_data else []
        val_examples = load_task_examples(d.val_data, d.data_format, None, say, d.task) if d.val_data else []
        if d.val_fraction:
            train_examples, val_examples = split_by_hash(train_examples, d.val_fraction)
            if not train_examples or not val_examples:
                raise DataFormatError(f"{d.train_data}: --val-fraction {d.val_fraction:g} of its "
                                      f"{len(train_examples) + len(val_examples)} examples leaves "
                                      f"{len(train_examples)} to train on and {len(val_examples)} to validate on; "
                                      "both must be non-empty")
            say(f"data: --val-fraction {d.val_fraction:g}: {len(val_examples)} of the training examples held out "
                f"for validation, {len(train_examples)} left to train on")
    if d.max_train_examples:
        train_examples = train_examples[: d.max_train_examples]
    if cfg.eval.eval_limit:
        eval_examples = eval_examples[: cfg.eval.eval_limit]

    # rollout sampler config
    bs = cfg.sampler.block_size or model.config.block_size
    if bs != model.config.block_size:  # the policy is trained for the block size it decodes with
        say(f"block size {bs} (the checkpoint's is {model.config.block_size}): rollouts and training use {bs}, "
            f"and the checkpoints this run writes record block_size {bs}")
        model.config.block_size = bs
    eos = tuple(sorted(i for i in tokenizer.eos_token_ids if i < model.config.vocab_size))
    if not eos:
        raise ValueError(f"the tokenizer's eos ids {sorted(tokenizer.eos_token_ids)} are outside the model's "
                         f"vocabulary ({model.config.vocab_size})")
    scfg = dataclasses.replace(cfg.sampler, eos_ids=eos, max_new_tokens=default_max_new_tokens(cfg, task, bs))
    assert isinstance(scfg, SamplerConfig)
    fit = dict(task=task, tokenizer=tokenizer, model_cfg=model.config, max_length=scfg.max_length, say=say,
               block_size=bs)
    train_examples = fit_examples(train_examples, label="training data", max_new_tokens=scfg.max_new_tokens, **fit)
    if eval_examples:  # decoded with the evaluation's response cap
        eval_examples = fit_examples(eval_examples, label="evaluation data",
                                     max_new_tokens=cfg.eval.eval_max_new_tokens or scfg.max_new_tokens, **fit)
    if val_examples:
        val_examples = fit_examples(val_examples, label="validation data",
                                    max_new_tokens=cfg.eval.eval_max_new_tokens or scfg.max_new_tokens, **fit)
    return RunContext(cfg, out, device, model, tokenizer, task, train_examples, eval_examples, scfg,
                      reference_dir, reference_fp, resume_from, env, val_examples)

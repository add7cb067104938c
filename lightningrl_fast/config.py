"""Run configuration of `python -m lightningrl_fast.train`: dataclasses -> argparse flags + config files.

`TrainConfig` composes one dataclass per concern:

    run        RunConfig        preset, baseline, RL time budget, threads, gradient checkpointing, progress
    data       DataConfig       --model, --train-data, --eval-data, --task, --out, --device, --dtype
    embedded   EmbeddedConfig   the embedded default: tiny SDAR model, synthetic task, cached SFT warm-up
    rl         RLConfig         rl/trainer.RLConfig itself: its fields become flags, defaults taken from it
    sampler    SamplerConfig    sampler.SamplerConfig (rollouts; evaluation is greedy with the same block/tau)
    eval       EvalConfig       threshold sweep, eval every N steps, eval set size
    checkpoint CheckpointConfig --save-every, --resume, --keep-checkpoints
    baseline   BaselineConfig   the rejection-sampling fine-tune baseline (REFERENCE §7)

Every field is one flag (`group_size` -> `--group-size`; booleans get `--x/--no-x`), flat: field names are
unique across sections. Where a value comes from, lowest to highest priority:

    1. the dataclass default (RLConfig / SamplerConfig defaults are the paper's, REFERENCE §4);
    2. the preset (`PRESETS[name]`; `default` applies when no `--model` is given, `none` disables presets);
    3. the config file (`--config FILE`: .toml, .yaml/.yml or .json), flat keys or one table per section
       (`[rl]`, `[sampler]`, ...); dashes or underscores; an unknown key is an error naming the key;
    4. the command-line flags.

`parse_config(argv)` returns a validated `TrainConfig`; every error it finds (bad combinations, missing
files, values out of range, NaN/inf, an `--out` folder that holds a previous run and is not the one `--resume`
continues, a `--model` other than the resumed run's) is a `ConfigError` raised BEFORE any model or dataset is
loaded. A config file with a key given twice (TOML, YAML or JSON) is an error too.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .rl.trainer import RLConfig
from .sampler import SamplerConfig


class ConfigError(ValueError):
    """A configuration the run cannot start with (the message says what to change)."""


def _f(default: Any, help: str, choices: Sequence[Any] | None = None, metavar: str | None = None, **kw: Any) -> Any:
    md: dict[str, Any] = {"help": help}
    if choices is not None:
        md["choices"] = tuple(choices)
    if metavar is not None:
        md["metavar"] = metavar
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md)
    return field(default=default, metadata=md, **kw)


# ----------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------

TASKS_BUILTIN = ("synthetic", "math", "code")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RunConfig:
    """What kind of run."""

    preset: str | None = _f(None, "hyper-parameter preset (config.PRESETS): 'default' (CPU, minutes), 'gpu' "
                                  "(one H100: larger model, more steps), 'smoke' (CI, seconds) or 'none'; "
                                  "absent: 'default' without --model, 'none' with --model",
                            choices=("default", "gpu", "smoke", "none"))
    baseline: str = _f("none", "'none': LightningRL; 'rft': instead of RL, the rejection-sampling fine-tune "
                               "baseline (greedy decode of the train prompts at --threshold, keep the correct "
                               "outputs, SFT on them) for the same wall-clock budget as the RL phase",
                       choices=("none", "rft"))
    rl_time_budget: float | None = _f(None, "wall-clock seconds for the RL phase (rollouts included; also the "
                                            "budget of --baseline rft); the phase ends at --steps or at this "
                                            "budget, whichever comes first; 'none' = no limit")
    gradient_checkpointing: bool = _f(False, "recompute each decoder layer in backward (less memory, ~30% "
                                             "more compute)")
    threads: int = _f(0, "torch CPU threads (torch.set_num_threads); 0 = torch's default")
    progress: str = _f("auto", "per-step progress: 'bar' (tqdm), 'plain' (one line per step), 'auto' (bar "
                               "on a terminal when tqdm is installed, else plain), 'off'",
                       choices=("auto", "bar", "plain", "off"))
    plots: bool = _f(True, "write PNG plots at the end (needs matplotlib; skipped with one line if missing)")
    dist_timeout_min: float = _f(60.0, "data-parallel runs (torchrun, one process per GPU): minutes a rank waits "
                                       "for the others in a collective before the run fails (rank 0 alone runs "
                                       "the embedded SFT warm-up while the others wait)")


@dataclass
class DataConfig:
    """Model, data, output and placement."""

    model: str | None = _f(None, "SDAR checkpoint folder (config.json, safetensors, tokenizer files) to train; "
                                 "absent: the embedded default (a tiny SDAR model warmed up by block-diffusion "
                                 "SFT on the synthetic task, cached on disk)", metavar="DIR")
    task: str = _f("synthetic", "task (prompt + verifier): 'synthetic' (embedded arithmetic, generates its own "
                                "train/test split), 'math' or 'code' (need --train-data)", metavar="TASK")
    train_data: str | None = _f(None, "training prompts file (.jsonl/.json/.parquet[.gz]; GSM8K, MATH500, MBPP, "
                                      "HumanEval or plain rows; see tasks/data.py); required for math/code",
                                metavar="FILE")
    eval_data: str | None = _f(None, "held-out evaluation file (same formats); synthetic: its test split",
                               metavar="FILE")
    data_format: str | None = _f(None, "force the row format of the data files ('none': detected from the first row)",
                                 choices=("gsm8k", "math500", "mbpp", "humaneval", "plain"))
    max_train_examples: int | None = _f(None, "use at most this many training examples")
    out: str | None = _f(None, "output folder (metrics.jsonl, checkpoints, plots); default runs/<timestamp>, "
                               "or the resumed run's folder with --resume", metavar="DIR")
    device: str = _f("auto", "torch device: 'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1'", metavar="DEVICE")
    dtype: str = _f("auto", "parameter dtype: 'auto' (the checkpoint's torch_dtype on CUDA, float32 on CPU), "
                            "'float32', 'bfloat16', 'float16'", choices=DTYPES)


@dataclass
class EmbeddedConfig:
    """The embedded default (no --model): tiny SDAR model, synthetic task, SFT warm-up cached on disk."""

    hidden_size: int = _f(128, "embedded model: hidden size")
    intermediate_size: int = _f(384, "embedded model: SwiGLU intermediate size")
    num_layers: int = _f(3, "embedded model: decoder layers")
    num_heads: int = _f(4, "embedded model: attention (query) heads")
    num_kv_heads: int = _f(2, "embedded model: key/value heads (GQA)")
    head_dim: int = _f(32, "embedded model: head dimension")
    model_block_size: int = _f(8, "embedded model: diffusion block size (config.json block_size)")
    num_operands: int = _f(3, "synthetic task: operands per prompt")
    max_operand: int = _f(9, "synthetic task: operands are drawn from [0, max_operand]")
    test_fraction: float = _f(0.2, "synthetic task: fraction of the operand tuples held out as the test split")
    sft_steps: int = _f(3000, "SFT warm-up: AdamW steps (block-diffusion objective, rl/sft.py)")
    sft_batch_size: int = _f(64, "SFT warm-up: pairs per step")
    sft_lr: float = _f(1e-3, "SFT warm-up: peak learning rate (cosine decay)")
    sft_warmup: int = _f(50, "SFT warm-up: linear warm-up steps")
    sft_time_budget: float | None = _f(None, "SFT warm-up: stop after this many seconds ('none' = no limit)")
    cache: bool = _f(True, "reuse / store the SFT warm-up model in the cache folder (--no-cache: always "
                           "train it, store nothing)")
    cache_dir: str | None = _f(None, "cache folder ('none': $LRF_CACHE_DIR, else ~/.cache/lightningrl_fast)",
                                 metavar="DIR")


@dataclass
class EvalConfig:
    """Greedy evaluation on the held-out set (before RL, every N steps, after)."""

    eval_thresholds: list[float] = _f([0.5, 0.7, 0.9, 0.95], "thresholds of the accuracy-TPF sweep before and "
                                                             "after RL (the rollout --threshold is always added)")
    eval_every: int = _f(0, "evaluate (greedy, at --threshold) every N RL steps; 0 = only before and after")
    eval_limit: int | None = _f(None, "evaluate on at most this many held-out examples")
    eval_batch_size: int = _f(256, "prompts per generate() call during evaluation")
    eval_max_new_tokens: int | None = _f(None, "max new tokens at evaluation (default: --max-new-tokens)")


@dataclass
class CheckpointConfig:
    """Checkpoints: <out>/checkpoint-<step>/ (SDAR model folder + trainer_state.pt), <out>/latest."""

    save_every: int = _f(0, "save a checkpoint every N RL steps (0 = only the final one)")
    keep_checkpoints: int = _f(3, "keep the last K checkpoints (older ones are deleted)")
    resume: str | None = _f(None, "continue a run: its output folder (uses <dir>/latest) or one "
                                  "checkpoint-<step> folder; continues exactly (same next batch, same RNG); "
                                  "the run's saved config.json is the base, flags and --config override it",
                            metavar="DIR")
    save_final: bool = _f(True, "save a checkpoint at the end of the run")


@dataclass
class BaselineConfig:
    """The rejection-sampling fine-tune baseline (`--baseline rft`)."""

    rft_lr: float = _f(2e-4, "RFT baseline: peak learning rate of the fine-tune on the kept outputs")
    rft_batch_size: int = _f(64, "RFT baseline: pairs per fine-tune step")
    rft_steps: int = _f(2000, "RFT baseline: fine-tune steps (cosine schedule length; the time budget may stop "
                              "it earlier)")
    rft_max_prompts: int | None = _f(None, "RFT baseline: decode at most this many train prompts")


# Help for the fields of the dataclasses this module does not own (RLConfig, SamplerConfig). A field that is
# missing here still gets its flag, with a generic help line.
EXTERNAL_HELP: dict[str, str] = {
    # RLConfig
    "steps": "RL steps (the phase also ends at --rl-time-budget)",
    "prompts_per_step": "prompt groups per RL step after filtering (dynamic sampling refills dropped groups)",
    "group_size": "samples per prompt (G, >= 2: advantages are relative within a group)",
    "lr": "AdamW learning rate of the RL phase",
    "betas": "AdamW betas",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear learning-rate warm-up (RL steps)",
    "grad_clip": "gradient-norm clip",
    "eps_low": "PPO clip: rho >= 1 - eps_low",
    "eps_high": "PPO clip: rho <= 1 + eps_high",
    "kl_beta": "weight of the k3 KL to the frozen initial policy (0 disables it and the reference model)",
    "reference_offload": "keep the frozen reference (kl_beta > 0) in host memory and stream it to the GPU one "
                         "layer at a time for the reference log-probs: frees its whole size on the GPU (SDAR-8B "
                         "bf16: 15.3 GiB) for ~2 x its size of host-to-device copies per step",
    "nll_weight": "mu: weight of the NLL on verifier-correct samples",
    "tpf_weight": "w_tpf in r = z_acc + w_tpf * z_tpf (speed reward weight)",
    "adv_mode": "advantage normalization: 'decoupled' (per reward, LightningRL) or 'sum' (the ablation)",
    "reduction": "loss reduction ('seq-tok-tok': mean over sequences of the per-sequence token mean)",
    "logprob_mode": "training log-prob layout: 'block_proxy' ([x_t ; x_0], LightningRL) or 'trace' "
                    "(exact replay of the sampled unmasking trajectory)",
    "min_tpf_range": "TPF-aware filter: drop groups whose TPF spread (max - min) is below this",
    "filter_groups": "drop groups without signal (all wrong, or TPF spread < --min-tpf-range)",
    "max_refill_rounds": "extra rollout rounds per step to refill filtered groups",
    "updates_per_step": "optimizer steps (PPO mini-batches) per pass over a rollout batch",
    "epochs_per_step": "passes over each rollout batch (PPO epochs): > 1 reuses the rollouts for more updates, "
                       "the ratio to the rollout policy clipped by --eps-low/--eps-high",
    "micro_batch_tokens": "positions per training forward/backward (memory knob): samples, each cut to its own "
                          "length, are packed back to back into rows of this many positions; a longer sample runs "
                          "alone",
    "rollout_batch_size": "sequences per generate() call of a rollout (prompts x G are decoded in chunks of this "
                          "many; the KV cache is sized by it: memory knob)",
    "max_nonfinite_steps": "stop (exit non-zero) after this many non-finite updates in a row",
    "seed": "run seed: data order, rollout sampling, SFT warm-up, embedded model init",
    # SamplerConfig (rollouts)
    "block_size": "decoding block size (default: the model's config.json block_size)",
    "threshold": "rollout/eval unmask threshold tau in [0, 1]: every masked position with confidence >= tau "
                 "is unmasked (plus the most confident one)",
    "rule": "unmask rule: 'threshold' (top-1 + threshold) or 'quota' (SDAR's B//S per step)",
    "steps_per_block": "S for the quota rule (default: block size)",
    "temperature": "rollout sampling temperature (0 = greedy); evaluation is always greedy",
    "top_k": "rollout top-k (0 = off)",
    "top_p": "rollout top-p (1 = off)",
    "noise": "how sampling draws its Gumbel noise: 'two_level' (a bucket of 1024 ids by its mass, then a token "
             "in it; one pass over the logits) or 'per_token' (one value per token); both sample exactly",
    "max_new_tokens": "response length cap (responses hitting it count as wrong); default: synthetic: its "
                      "longest answer rounded up to blocks + one block, other tasks: 256",
    "max_length": "cap on prompt + response positions (default: max_position_embeddings)",
    "fold_commit": "fold a finished block's cache commit into the next forward",
    "cuda_graphs": "capture the denoising step as a CUDA graph",
    "sync_every": "CUDA: denoising steps between host checks for 'all finished'",
    "compact": "shrink the decoding working set once at most half of it is still active",
}

# Defaults that differ from the dataclass's own for this CLI.
FIELD_DEFAULT_OVERRIDES: dict[str, Any] = {"max_new_tokens": None}

# SamplerConfig fields that are not flags: set by the trainer (seed per step) or from the tokenizer.
SAMPLER_EXCLUDED = ("seed", "eos_ids")

# ----------------------------------------------------------------------------------------------------------
# Presets: the ONE place for the embedded default's hyper-parameters (flat keys, any section).
# ----------------------------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    # CPU, 2 cores: a 0.59 M parameter model (tied embeddings). RL recipe: rollouts at temperature 0.5 (samples
    # near the mode the greedy evaluation decodes), mu = 1 (the NLL on verified-correct samples sharpens the
    # model onto its own phrasing), lr 1e-4, 2 passes over each rollout batch. Measured with the CLI (README
    # "Results"): strict accuracy / TPF at tau 0.9 from 91.5% / 2.67 to 96.5% / 5.98 in 180 s; RFT: 95.1% / 4.70.
    "default": dict(
        hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
        model_block_size=8, num_operands=3, max_operand=9, test_fraction=0.2,
        sft_steps=2500, sft_batch_size=64, sft_lr=3e-3, sft_warmup=20, sft_time_budget=600.0,
        steps=200, prompts_per_step=16, group_size=8, lr=1e-4, warmup_steps=5, kl_beta=0.01, nll_weight=1.0,
        epochs_per_step=2, tpf_weight=1.0, threshold=0.9, temperature=0.5, max_new_tokens=36, rl_time_budget=180.0,
        eval_thresholds=[0.5, 0.7, 0.9, 0.95], eval_batch_size=256,
        rft_lr=2e-4, rft_batch_size=64, rft_steps=1000,
    ),
    # One H100: larger model, more steps, the default's RL recipe (not yet run on a GPU). head_dim 64, so that
    # the block-attention and q/k-norm kernels run (they take head_dim 64 or 128; the projections have the
    # shapes 8 heads of 32 would give).
    "gpu": dict(
        hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        model_block_size=8, num_operands=3, max_operand=9, test_fraction=0.2,
        sft_steps=8000, sft_batch_size=256, sft_lr=1e-3, sft_warmup=100, sft_time_budget=900.0,
        steps=400, prompts_per_step=64, group_size=16, lr=1e-4, warmup_steps=10, kl_beta=0.01, nll_weight=1.0,
        epochs_per_step=2, tpf_weight=1.0, threshold=0.9, temperature=0.5, max_new_tokens=32, rl_time_budget=900.0,
        eval_thresholds=[0.5, 0.7, 0.9, 0.95], eval_batch_size=1024,
        rft_lr=2e-4, rft_batch_size=256, rft_steps=3000,
    ),
    # CI smoke run: seconds. The 20-step SFT model is nearly uniform: a low rollout threshold gives TPF spread
    # within groups and filtering is off, so the two RL steps do update the weights (nonzero advantages).
    "smoke": dict(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
        model_block_size=8, num_operands=3, max_operand=9, test_fraction=0.2,
        sft_steps=20, sft_batch_size=16, sft_lr=3e-3, sft_warmup=5, sft_time_budget=None,
        steps=2, prompts_per_step=2, group_size=4, lr=1e-4, warmup_steps=1, kl_beta=0.01, nll_weight=0.1,
        tpf_weight=1.0, threshold=0.1, temperature=1.0, max_new_tokens=32, rl_time_budget=None,
        filter_groups=False, eval_thresholds=[0.5, 0.9], eval_limit=16, eval_batch_size=64,
        rft_lr=2e-4, rft_batch_size=16, rft_steps=5, rft_max_prompts=32,
    ),
}

# ----------------------------------------------------------------------------------------------------------
# The composed config
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(max_new_tokens=None))  # type: ignore[arg-type]
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    config_file: str | None = None  # the --config file the values came from (informational)
    sources: dict[str, str] = field(default_factory=dict)  # key -> "default" | "preset:<name>" | "file" | "flag"

    @property
    def embedded_default(self) -> bool:
        """True when the run builds its own model (no --model)."""
        return self.data.model is None

    def to_dict(self) -> dict[str, Any]:
        """{section: {field: value}} with JSON-friendly values (tuples as lists)."""
        out: dict[str, Any] = {}
        for sec in SECTIONS:
            obj = getattr(self, sec)
            out[sec] = {o.name: _jsonable(getattr(obj, o.name)) for o in OPTIONS.values() if o.section == sec}
        return out

    def flat(self) -> dict[str, Any]:
        return {k: _jsonable(getattr(getattr(self, o.section), o.name)) for k, o in OPTIONS.items()}


SECTIONS: dict[str, type] = {
    "run": RunConfig, "data": DataConfig, "embedded": EmbeddedConfig, "rl": RLConfig, "sampler": SamplerConfig,
    "eval": EvalConfig, "checkpoint": CheckpointConfig, "baseline": BaselineConfig,
}
SECTION_TITLES = {
    "run": "run", "data": "model and data", "embedded": "embedded default (no --model)",
    "rl": "LightningRL (rl/trainer.RLConfig)", "sampler": "rollout decoding (sampler.SamplerConfig)",
    "eval": "evaluation", "checkpoint": "checkpoints", "baseline": "RFT baseline (--baseline rft)",
}


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


@dataclass
class Option:
    key: str  # flat key == field name
    section: str
    name: str
    type: Any  # resolved annotation
    default: Any
    help: str
    choices: tuple | None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _source_comments(cls: type) -> dict[str, str]:
    """`field: type = default  # comment` -> {field: comment} from the class source (empty if unavailable):
    a field added to RLConfig/SamplerConfig gets its own comment as help until EXTERNAL_HELP describes it."""
    import inspect
    import re

    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    pat = re.compile(r"^\s+(\w+)\s*:[^=#]+=[^#]*#\s*(.+?)\s*$")
    return {m.group(1): m.group(2) for line in src.splitlines() if (m := pat.match(line))}


def _build_options() -> dict[str, Option]:
    opts: dict[str, Option] = {}
    for sec, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        comments = _source_comments(cls) if sec in ("rl", "sampler") else {}
        for f in dataclasses.fields(cls):
            if sec == "sampler" and f.name in SAMPLER_EXCLUDED:
                continue
            default = FIELD_DEFAULT_OVERRIDES.get(f.name, _default_of(f)) if sec in ("rl", "sampler") else _default_of(f)
            help_ = (f.metadata.get("help") or EXTERNAL_HELP.get(f.name) or comments.get(f.name)
                     or f"{cls.__name__}.{f.name}")
            choices = f.metadata.get("choices")
            if f.name == "adv_mode":
                choices = ("decoupled", "sum")
            elif f.name == "logprob_mode":
                choices = ("block_proxy", "trace")
            elif f.name == "rule":
                choices = ("threshold", "quota")
            elif f.name == "noise":
                choices = ("two_level", "per_token")
            if f.name in opts:
                raise RuntimeError(f"config field {f.name!r} appears in sections {opts[f.name].section!r} and "
                                   f"{sec!r}: flag names must be unique")
            opts[f.name] = Option(f.name, sec, f.name, hints[f.name], default, help_, choices, f.metadata.get("metavar"))
    return opts


OPTIONS: dict[str, Option] = _build_options()


# ----------------------------------------------------------------------------------------------------------
# Types: one converter for flags (strings) and file values (native)
# ----------------------------------------------------------------------------------------------------------

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _scalar(tp: Any, value: Any, key: str, from_text: bool) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-6 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def convert(opt: Option, value: Any, from_text: bool = False) -> Any:
    """`value` (a flag string, a list of them, or a file value) as the option's type; ConfigError if it is not."""
    key = opt.key
    tp, optional = _unwrap_optional(opt.type)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required (got none)")
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if isinstance(value, str) and from_text:
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_scalar(a, v, key, from_text) for a, v in zip(args, value))
        elem = args[0] if args else str
        items = [_scalar(elem, v, key, from_text) for v in value]
        return tuple(items) if origin is tuple else items
    out = _scalar(tp, value, key, from_text)
    if opt.choices is not None and out not in opt.choices:
        raise ConfigError(f"{key}: {out!r} is not one of {', '.join(map(repr, opt.choices))}")
    return out


# ----------------------------------------------------------------------------------------------------------
# argparse
# ----------------------------------------------------------------------------------------------------------

def _fmt_default(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, (list, tuple)):
        return " ".join(map(str, v))
    return str(v)


def _help_text(opt: Option) -> str:
    text = f"{opt.help} (default: {_fmt_default(opt.default)}"
    per = [f"{name}={_fmt_default(p[opt.key])}" for name, p in PRESETS.items() if opt.key in p]
    if per:
        text += "; preset " + ", ".join(per)
    return (text + ")").replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightningrl_fast.train",
        description="LightningRL post-training of a block-diffusion LLM (SDAR format). With no arguments: the "
                    "embedded default (synthetic arithmetic task, tiny model, cached SFT warm-up, evaluation "
                    "before/after, LightningRL steps, plots). Value priority: flags > --config file > "
                    "the resumed run's config (--resume) > --preset > defaults.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", metavar="FILE", help="TOML/YAML/JSON file with any of the fields below (flat "
                                                    "keys or [section] tables); flags override it")
    for sec, title in SECTION_TITLES.items():
        g = p.add_argument_group(title)
        for opt in OPTIONS.values():
            if opt.section != sec:
                continue
            tp, optional = _unwrap_optional(opt.type)
            kw: dict[str, Any] = {"dest": opt.key, "help": _help_text(opt)}
            if tp is bool:
                g.add_argument(opt.flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            origin = typing.get_origin(tp)
            if origin in (list, tuple):
                args = typing.get_args(tp)
                kw["nargs"] = len(args) if origin is tuple and args and args[-1] is not Ellipsis else "+"
                kw["metavar"] = (args[0].__name__ if args else "X").upper()
            else:
                if opt.metavar:
                    kw["metavar"] = opt.metavar
                elif opt.choices:
                    kw["metavar"] = "{" + ",".join(map(str, opt.choices)) + "}"
                else:
                    kw["metavar"] = tp.__name__.upper() + ("|none" if optional else "")
            g.add_argument(opt.flag, **kw)
    return p


# ----------------------------------------------------------------------------------------------------------
# Config files
# ----------------------------------------------------------------------------------------------------------

def read_config_file(path: str | Path) -> dict[str, Any]:
    """Flat {key: value} from a .toml / .yaml / .yml / .json file; unknown keys are a ConfigError."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config {path} is a folder, not a config file")
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"--config {path}: reading YAML needs pyyaml (pip install pyyaml), or use TOML") from None
            raw = yaml.load(text, Loader=_yaml_loader(yaml)) or {}  # safe_load, duplicate keys refused
        elif suffix == ".json":
            raw = json.loads(text, object_pairs_hook=_json_object)  # duplicate keys refused
        else:
            raise ConfigError(f"--config {path}: unknown file type {suffix!r} (use .toml, .yaml, .yml or .json)")
    except ConfigError:
        raise
    except Exception as e:  # syntax errors of the three parsers
        raise ConfigError(f"--config {path}: cannot parse: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a table/mapping, got {type(raw).__name__}")
    flat: dict[str, Any] = {}

    def put(key: Any, value: Any, section: str | None) -> None:
        where = f"[{section}] " if section else ""
        if not isinstance(key, str):
            raise ConfigError(f"--config {path}: key {where}{key!r} is not a name (keys are option names such as "
                              "'group_size')")
        k = key.replace("-", "_")
        if k not in OPTIONS:
            near = difflib.get_close_matches(k, list(OPTIONS) + list(SECTIONS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"--config {path}: unknown key {where}{key!r}{hint}")
        if section is not None and OPTIONS[k].section != section:
            raise ConfigError(f"--config {path}: key {key!r} belongs to section [{OPTIONS[k].section}], not [{section}]")
        if k in flat:
            raise ConfigError(f"--config {path}: key {key!r} is given twice")
        flat[k] = value

    for key, value in raw.items():
        if key in ("config", "config_file"):
            raise ConfigError(f"--config {path}: a config file cannot name another config file ({key!r})")
        if key in SECTIONS and isinstance(value, dict):
            for k2, v2 in value.items():
                put(k2, v2, key)
        elif key in SECTIONS:
            raise ConfigError(f"--config {path}: [{key}] is a section: give it a table of options (e.g. "
                              f"[{key}] with one 'name = value' per line), got {value!r}")
        else:
            put(key, value, None)
    return flat


class DuplicateKeyError(ValueError):
    """A key given twice in one mapping of a YAML/JSON config file (TOML refuses it itself)."""


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"key {k!r} is given twice")
        out[k] = v
    return out


def _yaml_loader(yaml: Any) -> type:
    """yaml.SafeLoader refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise DuplicateKeyError(f"key {key!r} is given twice (line {key_node.start_mark.line + 1})")
                if isinstance(key, (str, int, float, bool)):
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


# ----------------------------------------------------------------------------------------------------------
# parse + validate
# ----------------------------------------------------------------------------------------------------------

def resolve(flags: dict[str, Any], file_values: dict[str, Any] | None = None, config_file: str | None = None,
            resumed_values: dict[str, Any] | None = None) -> TrainConfig:
    """Merge defaults < preset < resumed run's config < file < flags into a TrainConfig (not validated)."""
    file_values = file_values or {}
    resumed_values = resumed_values or {}
    values: dict[str, Any] = {k: o.default for k, o in OPTIONS.items()}
    sources = {k: "default" for k in OPTIONS}
    # preset: explicit (flag > file > resumed run) or implied by the absence of --model
    preset = flags.get("preset", file_values.get("preset", resumed_values.get("preset")))
    model = flags.get("model", file_values.get("model", resumed_values.get("model")))
    if preset is None:
        preset = "default" if model is None else "none"
    if preset != "none":
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(list(PRESETS) + ['none'])}")
        for k, v in PRESETS[preset].items():
            values[k] = convert(OPTIONS[k], v)
            sources[k] = f"preset:{preset}"
    for k, v in resumed_values.items():
        values[k] = convert(OPTIONS[k], v)
        sources[k] = "resumed run"
    for k, v in file_values.items():
        values[k] = convert(OPTIONS[k], v)
        sources[k] = "file"
    for k, v in flags.items():
        if k == "config":
            continue
        values[k] = convert(OPTIONS[k], v, from_text=True)
        sources[k] = "flag"
    values["preset"] = preset
    sections: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
    for k, o in OPTIONS.items():
        sections[o.section][o.name] = values[k]
    cfg = TrainConfig(
        **{sec: SECTIONS[sec](**kw) for sec, kw in sections.items()},  # type: ignore[arg-type]
        config_file=config_file, sources=sources,
    )
    return cfg


MAX_THREADS = 1024  # torch.set_num_threads far above the cores only slows down; ~2e4 and up crash the process
SEED_LIMIT = 2**40  # |--seed|: the trainer derives int64 Philox seeds as seed * 7919 + step * 131 + rank * 2**48


def _nonfinite_values(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(key, value) of every float option (lists and tuples of floats included) holding NaN or inf."""
    import math

    bad = []
    for k, o in OPTIONS.items():
        v = getattr(getattr(cfg, o.section), o.name)
        vals = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, float) and not math.isfinite(x) for x in vals):
            bad.append((k, v))
    return bad


# files a run writes into its output folder: one of them there means the folder holds a run (config.json alone
# does not: a run writes it before its first step)
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "latest", "reference", "rft-model")


def previous_run_outputs(folder: Path) -> list[str]:
    """Names of the outputs of an earlier run in `folder` (its checkpoints included), sorted."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name in RUN_OUTPUTS or p.name.startswith("checkpoint-"))


def _same_folder(a: str | Path, b: str | Path) -> bool:
    return Path(a).absolute().resolve() == Path(b).absolute().resolve()


def _folder_problem(path: Path) -> str | None:
    """Why `path` cannot be (created as) a writable folder, or None: it is a file, or its nearest existing
    ancestor is a file or not writable."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def validate(cfg: TrainConfig, check_paths: bool = True) -> None:
    """Every check that needs no model: ranges, combinations, files and folders. Raises ConfigError."""
    from .tasks import available_tasks

    errs: list[str] = []
    r, d, e, rl, s, ev, ck, b = cfg.run, cfg.data, cfg.embedded, cfg.rl, cfg.sampler, cfg.eval, cfg.checkpoint, cfg.baseline
    # NaN / inf pass every `x < 0` range check below (and would reach torch, the sampler or the loss): refuse them first
    nonfinite = _nonfinite_values(cfg)
    if nonfinite:
        errs += [f"--{k.replace('_', '-')} must be a finite number, got {v}" for k, v in nonfinite]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errs) if len(errs) > 1 else errs[0])
    # RL
    try:
        rl.validate()
    except ValueError as ex:
        errs.append(f"RL config: {ex}")
    for name in ("kl_beta", "nll_weight", "tpf_weight", "eps_low", "eps_high", "min_tpf_range", "weight_decay"):
        if getattr(rl, name) < 0:
            errs.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(rl, name)}")
    for name in ("warmup_steps", "max_refill_rounds"):
        if getattr(rl, name) < 0:
            errs.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(rl, name)}")
    if rl.max_nonfinite_steps < 1:
        errs.append(f"--max-nonfinite-steps must be >= 1, got {rl.max_nonfinite_steps}")
    if not all(0 <= x < 1 for x in rl.betas):
        errs.append(f"--betas must be in [0, 1), got {rl.betas}")
    if rl.eps_low >= 1:
        errs.append(f"--eps-low must be < 1 (the ratio is clipped below at 1 - eps_low > 0), got {rl.eps_low}")
    if not -SEED_LIMIT <= rl.seed <= SEED_LIMIT:
        errs.append(f"--seed must be in [-2**40, 2**40] (the rollout seeds derived from it are int64), got {rl.seed}")
    # sampler
    if not 0.0 <= s.threshold <= 1.0:
        errs.append(f"--threshold must be in [0, 1], got {s.threshold}")
    if s.temperature < 0:
        errs.append(f"--temperature must be >= 0, got {s.temperature}")
    if s.top_k < 0 or not 0 < s.top_p <= 1:
        errs.append(f"--top-k must be >= 0 and --top-p in (0, 1], got {s.top_k}, {s.top_p}")
    for name in ("block_size", "max_new_tokens", "steps_per_block", "max_length"):
        v = getattr(s, name)
        if v is not None and v < 1:
            errs.append(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if s.sync_every < 1:
        errs.append(f"--sync-every must be >= 1, got {s.sync_every}")
    # eval
    if not ev.eval_thresholds:
        errs.append("--eval-thresholds needs at least one value")
    bad = [t for t in ev.eval_thresholds if not 0.0 <= t <= 1.0]
    if bad:
        errs.append(f"--eval-thresholds must be in [0, 1], got {bad}")
    if ev.eval_every < 0:
        errs.append(f"--eval-every must be >= 0, got {ev.eval_every}")
    if ev.eval_batch_size < 1:
        errs.append(f"--eval-batch-size must be >= 1, got {ev.eval_batch_size}")
    for name in ("eval_limit", "eval_max_new_tokens"):
        v = getattr(ev, name)
        if v is not None and v < 1:
            errs.append(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    # run
    if r.rl_time_budget is not None and r.rl_time_budget <= 0:
        errs.append(f"--rl-time-budget must be positive (or none), got {r.rl_time_budget}")
    if not 0 <= r.threads <= MAX_THREADS:
        errs.append(f"--threads must be in [0, {MAX_THREADS}] (0 = torch's default), got {r.threads}")
    if r.dist_timeout_min <= 0:
        errs.append(f"--dist-timeout-min must be positive, got {r.dist_timeout_min}")
    # checkpoints
    if ck.save_every < 0:
        errs.append(f"--save-every must be >= 0, got {ck.save_every}")
    if ck.keep_checkpoints < 1:
        errs.append(f"--keep-checkpoints must be >= 1, got {ck.keep_checkpoints}")
    if ck.resume is not None and r.baseline != "none":
        errs.append("--resume continues an RL run; it cannot be combined with --baseline rft")
    # baseline
    for name in ("rft_batch_size", "rft_steps"):
        if getattr(b, name) < 1:
            errs.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(b, name)}")
    if b.rft_lr <= 0:
        errs.append(f"--rft-lr must be positive, got {b.rft_lr}")
    if b.rft_max_prompts is not None and b.rft_max_prompts < 1:
        errs.append(f"--rft-max-prompts must be >= 1, got {b.rft_max_prompts}")
    # task and data
    known = sorted(set(TASKS_BUILTIN) | set(available_tasks()))
    if d.task not in known:
        errs.append(f"--task {d.task!r} is unknown; choose from {', '.join(known)}")
    elif d.task == "synthetic":
        if d.train_data is not None or d.eval_data is not None:
            errs.append("--task synthetic generates its own train/test split; drop --train-data/--eval-data "
                        "(or pick --task math|code)")
    elif d.train_data is None:
        errs.append(f"--task {d.task} needs --train-data FILE (its training prompts)")
    if d.max_train_examples is not None and d.max_train_examples < 1:
        errs.append(f"--max-train-examples must be >= 1, got {d.max_train_examples}")
    # embedded model
    if cfg.embedded_default:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "model_block_size", "num_operands", "max_operand", "sft_steps", "sft_batch_size"):
            if getattr(e, name) < 1:
                errs.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(e, name)}")
        if e.num_heads >= 1 and e.num_kv_heads >= 1 and e.num_heads % e.num_kv_heads:
            errs.append(f"--num-heads ({e.num_heads}) must be a multiple of --num-kv-heads ({e.num_kv_heads})")
        if e.head_dim % 2:
            errs.append(f"--head-dim must be even (rotary embeddings), got {e.head_dim}")
        if not 0 < e.test_fraction < 1:
            errs.append(f"--test-fraction must be in (0, 1), got {e.test_fraction}")
        if e.sft_lr <= 0:
            errs.append(f"--sft-lr must be positive, got {e.sft_lr}")
        if e.sft_warmup < 1:  # the warm-up factor is (step + 1) / sft_warmup
            errs.append(f"--sft-warmup must be >= 1 (1 = no warm-up), got {e.sft_warmup}")
        if e.sft_time_budget is not None and e.sft_time_budget <= 0:
            errs.append(f"--sft-time-budget must be positive (or none), got {e.sft_time_budget}")
        if d.task != "synthetic":
            errs.append(f"--task {d.task} needs --model DIR (the embedded default model only knows the "
                        "synthetic task's characters)")
    # device
    try:
        import torch

        dev = d.device
        if dev != "auto":
            td = torch.device(dev)
            if td.type == "cuda" and not torch.cuda.is_available():
                errs.append(f"--device {dev}: CUDA is not available on this machine (use --device cpu)")
            elif td.type not in ("cpu", "cuda"):
                errs.append(f"--device {dev}: only cpu and cuda devices are supported")
    except RuntimeError as ex:
        errs.append(f"--device {d.device!r} is not a valid torch device ({ex})")
    # files and folders
    if check_paths:
        for flag, p in (("--train-data", d.train_data), ("--eval-data", d.eval_data)):
            if p is not None and not Path(p).is_file():
                errs.append(f"{flag} {p}: no such file")
        # a resumed run loads its model from the checkpoint: the folder it once started from may be gone
        # (the frozen KL reference is checked against its fingerprint when the checkpoint loads)
        model_from_resumed = ck.resume is not None and cfg.sources.get("model") == "resumed run"
        if d.model is not None and not model_from_resumed:
            mp = Path(d.model)
            if not mp.is_dir():
                errs.append(f"--model {d.model}: no such folder")
            elif not (mp / "config.json").is_file():
                errs.append(f"--model {d.model}: no config.json in the folder (not an SDAR checkpoint)")
        resumed_run = None
        if ck.resume is not None:
            from .rl.checkpointing import resolve_checkpoint

            try:
                resumed_run = resolve_checkpoint(ck.resume).parent
            except (FileNotFoundError, ValueError) as ex:
                errs.append(f"--resume: {ex}")
        if d.out is not None:
            problem = _folder_problem(Path(d.out))
            if problem:
                errs.append(f"--out {d.out} {problem}")
            elif (prev := previous_run_outputs(Path(d.out))) and not (
                    resumed_run is not None and _same_folder(resumed_run, d.out)):
                # a second run there would append to its metrics.jsonl, replace or prune its checkpoints and
                # overwrite its summary and config
                listed = ", ".join(prev[:4]) + (", ..." if len(prev) > 4 else "")
                can_resume = any(n == "latest" or n.startswith("checkpoint-") for n in prev)
                errs.append(f"--out {d.out} holds a previous run ({listed}); "
                            + (f"continue it with --resume {d.out}, or " if can_resume and ck.resume is None else "")
                            + "pick another --out (or remove that folder)")
        if cfg.embedded_default and cfg.embedded.cache and ck.resume is None:
            problem = _folder_problem(cache_root(cfg))
            if problem:
                errs.append(f"the SFT cache folder {cache_root(cfg)} (--cache-dir, $LRF_CACHE_DIR) {problem}; "
                            "pick another --cache-dir or use --no-cache")
    if errs:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errs) if len(errs) > 1 else errs[0])


def parse_config(argv: Sequence[str] | None = None, check_paths: bool = True) -> TrainConfig:
    """argv -> validated TrainConfig (ConfigError on any problem; argparse exits on malformed flags)."""
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    flags = vars(ns)
    config_file = flags.pop("config", None)
    file_values = read_config_file(config_file) if config_file is not None else {}
    resumed_values = _resumed_run_values(flags.get("resume", file_values.get("resume")))
    cfg = resolve(flags, file_values, config_file, resumed_values)
    if cfg.checkpoint.resume is not None and cfg.sources.get("model") in ("flag", "file"):
        # a resume continues from the checkpoint's weights: another --model would be ignored without a word
        saved = resumed_values.get("model")
        if cfg.data.model is None or saved is None or not _same_folder(cfg.data.model, saved):
            raise ConfigError(f"--model {cfg.data.model} conflicts with --resume {cfg.checkpoint.resume}: a resumed run "
                              f"continues from its checkpoint's weights (the run started from "
                              f"{saved if saved is not None else 'the embedded default model'}); drop --model, or "
                              "start a new run from a checkpoint with --model <out>/checkpoint-<step>")
    validate(cfg, check_paths=check_paths)
    return cfg


RUN_CONFIG = "config.json"  # the resolved config a run writes into its output folder


def _resumed_run_values(resume: Any) -> dict[str, Any]:
    """The saved config of the run `--resume` points at (its folder's config.json), minus resume/out: a resumed
    run continues with the same settings unless the file or flags change them."""
    if resume is None:
        return {}
    from .rl.checkpointing import resolve_checkpoint

    try:
        ck = resolve_checkpoint(resume)
    except (FileNotFoundError, ValueError) as ex:
        raise ConfigError(f"--resume: {ex}") from None
    saved = ck.parent / RUN_CONFIG
    if not saved.is_file():
        return {}
    try:
        values = read_config_file(saved)
    except ConfigError as ex:
        msg = str(ex).removeprefix("--config ")
        raise ConfigError(f"--resume {resume}: the run's saved config {msg} (fix or remove that file; flags and "
                          "--config then give the settings)") from None
    for k in ("resume", "out"):
        values.pop(k, None)
    return values


def cache_root(cfg: TrainConfig) -> Path:
    """Where the SFT warm-up models are cached: --cache-dir, $LRF_CACHE_DIR, ~/.cache/lightningrl_fast."""
    if cfg.embedded.cache_dir:
        return Path(cfg.embedded.cache_dir)
    env = os.environ.get("LRF_CACHE_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "lightningrl_fast"

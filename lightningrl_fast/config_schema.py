"""The run configuration's schema: one dataclass per concern (each field with its help text), the presets, the
flat option index (`OPTIONS`: one flag per field) and the one converter of flag and file values.

config.py turns command lines and config files into a validated `TrainConfig` with these; see its docstring for
the sections, the flag names and where a value comes from.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
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
    val_data: str | None = _f(None, "validation prompts file (same formats): what --eval-every evaluates and "
                                    "--select-best selects on, kept apart from --eval-data so that the final "
                                    "evaluation is not chosen on", metavar="FILE")
    val_fraction: float = _f(0.0, "carve this fraction of the training prompts out as the validation split "
                                  "(by a fixed hash of each example's id, so the same prompts whatever the order "
                                  "or --seed; synthetic: of all operand tuples, the test split unchanged); "
                                  "0 = none; not with --val-data")
    data_format: str | None = _f(None, "force the row format of the data files ('none': detected from the first row)",
                                 choices=("gsm8k", "math500", "mbpp", "humaneval", "plain"))
    max_train_examples: int | None = _f(None, "use at most this many training examples (counted after the "
                                              "--val-fraction carve)")
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
    max_operand: int = _f(9, "synthetic task: operands are drawn from [1, max_operand]")
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
    eval_every: int = _f(0, "evaluate (greedy, at --threshold) every N RL steps, on the validation split when "
                            "there is one (--val-data / --val-fraction), else on the held-out set; 0 = only "
                            "before and after")
    select_best: bool = _f(False, "RL: keep, in <out>/best-model, the weights of the validation evaluation (before "
                                  "RL, every --eval-every steps, and the last step) with the highest TPF among "
                                  "those whose validation accuracy is within --select-margin of the one before "
                                  "RL, and evaluate them on the held-out set at the end next to the last step's "
                                  "(needs a validation split and --eval-every; --baseline rft ignores it)")
    select_margin: float = _f(0.01, "--select-best: validation accuracy (a fraction: 0.01 = one point) a selected "
                                    "step may lose against the model before RL")
    eval_limit: int | None = _f(None, "evaluate on at most this many held-out examples")
    eval_batch_size: int = _f(256, "prompts per generate() call during evaluation")
    eval_max_new_tokens: int | None = _f(None, "max new tokens at evaluation (default: --max-new-tokens; the "
                                                "eval CLI's own default for math/code is 512)")


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
    "kl_beta": "weight of the k3 KL to the frozen initial policy (0 disables it, the reference model and the kl "
               "metric)",
    "reference_offload": "keep the frozen reference (kl_beta > 0) in host memory and stream it to the GPU one "
                         "layer at a time for the reference log-probs: frees its whole size on the GPU (SDAR-8B "
                         "bf16: 15.3 GiB) for one copy of its size to the GPU per chunk of 16 x "
                         "--micro-batch-tokens positions of the step's batch",
    "optimizer_offload": "keep the fp32 optimizer state (master weights + Adam moments: 12 bytes per bf16 "
                         "parameter, / the number of ranks) in pinned host memory and stream it through the GPU "
                         "in 16M-element chunks at each optimizer step (RL, and the RFT baseline's fine-tune): frees "
                         "it on the GPU (SDAR-4B on one GPU: 49.3 GiB) for ~24 bytes per parameter of PCIe traffic "
                         "per step (updates bit-identical to the resident optimizer's for bf16/fp16 weights)",
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
    "pack": "run each decoding forward's GEMMs on the rows' real chunk tokens only, not on the static [rows, 2 x "
            "block] chunk (one host read a step): 'auto' (CUDA, working sets of >= 256 rows x block tokens), 'on', "
            "'off'",
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
    # model onto its own phrasing), lr 1e-4, 2 passes over each rollout batch, KL beta 0.05. A validation split
    # (10% of the tuples, out of train) is evaluated every 10 steps and --select-best keeps the fastest step within
    # a point of the starting validation accuracy. kl_beta 0.05 was chosen over 0.01, --tpf-weight 0.5,
    # --epochs-per-step 1 and --lr 5e-5 by the validation split alone (README "Results", 2026-11-28).
    "default": dict(
        hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
        model_block_size=8, num_operands=3, max_operand=9, test_fraction=0.2,
        sft_steps=2500, sft_batch_size=64, sft_lr=3e-3, sft_warmup=20, sft_time_budget=600.0,
        steps=200, prompts_per_step=16, group_size=8, lr=1e-4, warmup_steps=5, kl_beta=0.05, nll_weight=1.0,
        epochs_per_step=2, tpf_weight=1.0, threshold=0.9, temperature=0.5, max_new_tokens=36, rl_time_budget=180.0,
        eval_thresholds=[0.5, 0.7, 0.9, 0.95], eval_batch_size=256, val_fraction=0.1, eval_every=10,
        select_best=True,
        rft_lr=2e-4, rft_batch_size=64, rft_steps=1000,
    ),
    # One H100: larger model, more steps, the default's RL recipe (not yet run on a GPU). head_dim 64, so that
    # the block-attention and q/k-norm kernels run (they take head_dim 64 or 128; the projections have the
    # shapes 8 heads of 32 would give).
    "gpu": dict(
        hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        model_block_size=8, num_operands=3, max_operand=9, test_fraction=0.2,
        sft_steps=8000, sft_batch_size=256, sft_lr=1e-3, sft_warmup=100, sft_time_budget=900.0,
        steps=400, prompts_per_step=64, group_size=16, lr=1e-4, warmup_steps=10, kl_beta=0.05, nll_weight=1.0,
        epochs_per_step=2, tpf_weight=1.0, threshold=0.9, temperature=0.5, max_new_tokens=32, rl_time_budget=900.0,
        eval_thresholds=[0.5, 0.7, 0.9, 0.95], eval_batch_size=1024, val_fraction=0.1, eval_every=10,
        select_best=True,
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
    # key -> "default" | "preset:<name>" | "resumed run" | "file" | "flag"
    sources: dict[str, str] = field(default_factory=dict)

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
            elif f.name == "pack":
                choices = ("auto", "on", "off")
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
        if from_text and elem in (int, float):  # `--eval-thresholds 0.5,0.9` as eval's `--thresholds 0.5,0.9`
            value = [p for v in value for p in (v.replace(",", " ").split() if isinstance(v, str) else [v])]
        items = [_scalar(elem, v, key, from_text) for v in value]
        return tuple(items) if origin is tuple else items
    out = _scalar(tp, value, key, from_text)
    if opt.choices is not None and out not in opt.choices:
        raise ConfigError(f"{key}: {out!r} is not one of {', '.join(map(repr, opt.choices))}")
    return out

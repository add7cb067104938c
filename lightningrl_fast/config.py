"""Run configuration of `python -m lightningrl_fast.train`: command line + config file -> a validated TrainConfig.

This module holds the argparse parser, the config-file readers, the merge of value sources (`resolve`), the
checks (`validate`) and `parse_config`; the dataclasses, presets and the flat option index they work from live
in config_schema.py (re-exported here). `TrainConfig` composes one dataclass per concern:

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
    3. with `--resume`: the resumed run's saved config (its folder's config.json);
    4. the config file (`--config FILE`: .toml, .yaml/.yml or .json), flat keys or one table per section
       (`[rl]`, `[sampler]`, ...); dashes or underscores; an unknown key is an error naming the key;
    5. the command-line flags.

`parse_config(argv)` returns a validated `TrainConfig`; every error it finds (bad combinations, missing
files, values out of range, NaN/inf, an `--out` folder that holds a previous run and is not the one `--resume`
continues, a `--model` other than the resumed run's) is a `ConfigError` raised BEFORE any model or dataset is
loaded. A config file with a key given twice (TOML, YAML or JSON) is an error too.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Sequence

from ._jsonfile import DuplicateKeyError, unique_keys
from .config_schema import (OPTIONS, PRESETS, SECTION_TITLES, SECTIONS, TASKS_BUILTIN, BaselineConfig, CheckpointConfig,
                            ConfigError, DataConfig, EmbeddedConfig, EvalConfig, Option, RunConfig, TrainConfig,
                            _unwrap_optional, convert)
from .rl.trainer import RLConfig
from .sampler import SamplerConfig
from .sampler_io import ignored_sampling_settings

__all__ = ["BaselineConfig", "CheckpointConfig", "ConfigError", "DataConfig", "EmbeddedConfig", "EvalConfig",
           "OPTIONS", "PRESETS", "RLConfig", "RUN_CONFIG", "RunConfig", "SamplerConfig", "TrainConfig", "build_parser",
           "cache_root", "parse_config", "read_config_file", "resolve", "validate"]

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
                                                    "keys, or in the [section] tables named in the group titles, "
                                                    "e.g. [rl] lr = 1e-6; relative paths are taken from the current "
                                                    "folder); flags override it")
    for sec, title in SECTION_TITLES.items():
        g = p.add_argument_group(f"{title} [{sec}]")  # the table a --config file may hold these fields in
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
            raw = json.loads(text, object_pairs_hook=unique_keys)  # duplicate keys refused (TOML refuses them itself)
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


def _yaml_loader(yaml: Any) -> type:
    """yaml.SafeLoader refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise DuplicateKeyError(key, f" (line {key_node.start_mark.line + 1})")
                if isinstance(key, (str, int, float, bool)):
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


# ----------------------------------------------------------------------------------------------------------
# parse + validate
# ----------------------------------------------------------------------------------------------------------

def resolve(flags: dict[str, Any], file_values: dict[str, Any] | None = None, config_file: str | None = None,
            resumed_values: dict[str, Any] | None = None) -> TrainConfig:
    """Merge defaults < preset < resumed run's config < file < flags into a TrainConfig (not validated). With a
    resumed run, an option its saved config does not hold (added to the package after the run was made) takes its
    plain default, the behaviour the run had, rather than the preset's value: a resumed run continues as it was."""
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
    if resumed_values:  # an option the resumed run's config lacks is newer than the run: it keeps the behaviour
        for k, o in OPTIONS.items():  # the run had (the plain default), not what the preset now sets
            if k not in resumed_values and sources[k].startswith("preset:"):
                values[k], sources[k] = o.default, "default (absent from the resumed run's config)"
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
MAX_POSITIONS = 2**24  # block size, response cap, cache length: far past any model's positions, inside int32 math
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


# files of a model checkpoint folder (never a run's output folder, which keeps its weights in checkpoint-<N>/)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _same_folder(a: str | Path, b: str | Path) -> bool:
    return Path(a).absolute().resolve() == Path(b).absolute().resolve()


def _inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or below it (symlinks resolved)."""
    p, f = path.absolute().resolve(), folder.absolute().resolve()
    return p == f or f in p.parents


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
    elif s.temperature > 0:
        from .ops.unmask import check_sampling_args

        try:  # the sampler's own check: 1 / temperature must be a finite float32
            check_sampling_args(0.5, s.temperature, 0, 1.0, s.noise)
        except ValueError as ex:
            errs.append(f"--temperature: {ex}")
    if s.top_k < 0 or not 0 < s.top_p <= 1:
        errs.append(f"--top-k must be >= 0 and --top-p in (0, 1], got {s.top_k}, {s.top_p}")
    for name in ("block_size", "max_new_tokens", "steps_per_block", "max_length"):
        v = getattr(s, name)
        if v is not None and not 1 <= v <= MAX_POSITIONS:
            errs.append(f"--{name.replace('_', '-')} must be in [1, {MAX_POSITIONS}], got {v}")
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
    if not 0 <= ev.select_margin <= 1:
        errs.append(f"--select-margin must be in [0, 1] (a fraction of the validation examples), "
                    f"got {ev.select_margin}")
    has_val = d.val_data is not None or d.val_fraction > 0
    if ev.select_best and r.baseline == "none":
        if not has_val:
            errs.append("--select-best selects on a validation split: give --val-data FILE or --val-fraction F "
                        "(never the held-out --eval-data / test split), or --no-select-best")
        if ev.eval_every < 1:
            errs.append("--select-best chooses among the validation evaluations: give --eval-every N (or "
                        "--no-select-best)")
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
    if not 0 <= d.val_fraction < 1:
        errs.append(f"--val-fraction must be in [0, 1), got {d.val_fraction}")
    elif d.val_data is not None and d.val_fraction > 0:
        errs.append("give the validation split as --val-data FILE or as --val-fraction F, not both")
    elif d.task == "synthetic" and d.val_data is not None:
        errs.append("--task synthetic carves its own validation split (--val-fraction); drop --val-data")
    elif d.task == "synthetic" and 0 < e.test_fraction < 1 and d.val_fraction >= 1 - e.test_fraction:
        errs.append(f"--val-fraction {d.val_fraction} + --test-fraction {e.test_fraction} leave no training prompts "
                    "(their sum must be below 1)")
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
    # device: the CLIs' own check (a valid name, cpu or cuda, a GPU this machine has)
    if d.device != "auto":
        from .rl.distributed import resolve_device

        try:
            resolve_device(d.device)
        except ValueError as ex:
            errs.append(str(ex))
    # files and folders
    if check_paths:
        for flag, p in (("--train-data", d.train_data), ("--eval-data", d.eval_data), ("--val-data", d.val_data)):
            if p is not None and not Path(p).is_file():
                errs.append(f"{flag} {p}: no such file")
        # a resumed run loads its model from the checkpoint: the folder it once started from may be gone
        # (the frozen KL reference is checked against its fingerprint when the checkpoint loads)
        model_from_resumed = ck.resume is not None and cfg.sources.get("model") == "resumed run"
        if d.model is not None and not model_from_resumed:
            mp = Path(d.model)
            from ._cli import is_run_folder

            if not mp.is_dir():
                errs.append(f"--model {d.model}: no such folder")
            elif is_run_folder(mp):  # its config.json holds a run's settings, not a model's
                from .rl.checkpointing import list_checkpoints, resolve_checkpoint

                try:
                    resolve_checkpoint(mp)
                    resumable = True
                except (OSError, ValueError):
                    resumable = False
                models = [str(c) for c in list_checkpoints(mp)[-1:]] + [
                    str(mp / n) for n in ("rft-model", "best-model") if (mp / n / "config.json").is_file()]
                ways = ([f"continue that run with --resume {d.model}"] if resumable else []) + (
                    [f"start a new run from one of its models: --model {' or '.join(models)}"] if models else [])
                errs.append(f"--model {d.model} is a training run's folder (its config.json holds the run's "
                            "settings), not a model" + (": " + ", or ".join(ways) if ways else
                                                        " (it holds no checkpoint or model yet)"))
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
            holds_model = [n for n in MODEL_FILES if (Path(d.out) / n).is_file()]
            if problem:
                errs.append(f"--out {d.out} {problem}")
            elif d.model is not None and _inside(Path(d.out), Path(d.model)):
                errs.append(f"--out {d.out} is inside the --model folder {d.model}: the run's config.json and "
                            "checkpoints would overwrite the model's files; pick another --out")
            elif holds_model:
                errs.append(f"--out {d.out} holds a model checkpoint ({', '.join(holds_model)}); pick another --out")
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
    for text in ineffective_settings(cfg):
        warnings.warn(text, stacklevel=2)


def ineffective_settings(cfg: TrainConfig) -> list[str]:
    """Settings the user gave (flag or file) that the rest of the configuration makes do nothing, or that leave
    RL without a signal: said, not refused (a run config may carry them from an earlier setup)."""
    given = {k for k, v in cfg.sources.items() if v in ("flag", "file")}
    rl, s = cfg.rl, cfg.sampler
    out = []
    if "reference_offload" in given and rl.reference_offload and rl.kl_beta == 0:
        out.append("--reference-offload does nothing with --kl-beta 0 (no KL reference is kept)")
    if "min_tpf_range" in given and not rl.filter_groups:
        out.append("--min-tpf-range does nothing with --no-filter-groups (no group is filtered)")
    truncation = (s.top_k, s.top_p) if {"top_k", "top_p"} & given else (0, 1.0)  # the settings the user gave only
    out += ignored_sampling_settings(s.rule, s.steps_per_block if "steps_per_block" in given else None,
                                     s.temperature, *truncation, decoding="rollouts")
    if "temperature" in given and s.temperature == 0 and rl.group_size > 1 and cfg.run.baseline != "rft":
        out.append(f"--temperature 0: the {rl.group_size} samples of a group decode alike (greedy), so no group "
                   "carries an accuracy or TPF difference" + (" and every group is filtered out: no step will "
                                                              "update the model" if rl.filter_groups else ""))
    return out


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

"""Load and save SDAR checkpoints (config.json + safetensors, single-file or sharded), HF-compatible.

`load_model(path, dtype=None, device="cpu") -> (model, config)`
  1. reads `config.json` into `SDARConfig` (a missing file or required key is named in the error);
  2. builds `SDARForCausalLM` on the meta device (no memory, no init cost);
  3. validates the weight files against the model BEFORE reading any weight: `model.safetensors`, or
     `model.safetensors.index.json` + its shards (corrupt index, missing shard files, tensors missing from
     their shard, missing parameters, unknown tensors and shape mismatches are all reported by name);
  4. streams the weights shard by shard with `safetensors.safe_open`, each tensor converted straight to the
     target dtype/device and assigned into the model with `load_state_dict(assign=True)`: peak memory is the
     model plus one shard at most; a shard with a tensor holding NaN or inf (in the load dtype) is refused,
     naming the shard and the tensors;
  5. re-ties shared parameters (`tie_word_embeddings`: lm_head shares embed_tokens; a tied checkpoint may
     carry `lm_head.weight` or not — when it does and it differs, a warning says it was ignored), calls
     `model.init_buffers(device)` when the model has it (computed buffers such as a RoPE cache), and checks
     nothing is left on the meta device. The model is returned in eval mode.

`save_model(model, config, path, max_shard_bytes=5 GiB, tokenizer=None, code_dir=None)`
  writes config.json (model_type "sdar", architectures ["SDARForCausalLM"], torch_dtype = the weights' dtype,
  unknown keys kept), `model.safetensors` or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`
  (`metadata.total_size`, sorted `weight_map`), safetensors metadata {"format": "pt"}, tied weights once (as
  `model.embed_tokens.weight`, no `lm_head.weight`: the HF convention), the tokenizer files when given, and
  the remote-code modules (*.py of `code_dir`, by default the tokenizer's source folder) that `auto_map` names.
  ATOMIC: everything is written and fsynced into a hidden sibling folder, which then replaces `path` in one
  step (`renameat2(RENAME_EXCHANGE)` on Linux; elsewhere two renames, the previous folder kept as a hidden
  `.name.old-*` sibling until the new one is in place). A save killed at any point leaves the previous
  checkpoint loadable; leftovers of killed saves are cleaned (or restored) by the next save to the same path.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import uuid
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ._jsonfile import fsync_path as _fsync
from ._jsonfile import read_json_file
from .model import SDARConfig, SDARForCausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The JSON types config.json must give the keys SDARConfig reads (checked before it is built, so that a quoted
# number or a "false" string is named here, not met later as a TypeError inside the model or as a wrong model).
_POSITIVE_INT_KEYS = (*REQUIRED_CONFIG_KEYS, "max_position_embeddings", "block_size")
_OPTIONAL_POSITIVE_INT_KEYS = ("num_key_value_heads", "head_dim")  # null: derived from the other keys
_POSITIVE_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
_OPTIONAL_KEY_TYPES = {"mask_token_id": (int,), "tie_word_embeddings": (bool,), "torch_dtype": (str,), "dtype": (str,),
                       "hidden_act": (str,), "rope_scaling": (dict,), "model_type": (str,)}
# safetensors dtypes a floating-point SDAR weight may be stored in (converted to the load dtype)
_FLOAT_STORAGE = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint folder that does not match the model its config describes (message names what and where)."""


# ------------------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------------------

def _siblings(final: Path, kind: str) -> list[Path]:
    """Hidden siblings `.name.<kind>-<pid>-<token>` that save_model creates next to `final`."""
    prefix = f".{final.name}.{kind}-"
    if not final.parent.is_dir():
        return []
    return sorted(p for p in final.parent.iterdir() if p.name.startswith(prefix))


def _backup_hint(folder: Path) -> str:
    olds = _siblings(folder, "old")
    return f" (an interrupted save left the previous checkpoint at {olds[-1]})" if olds else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _config_type_problems(d: dict) -> list[str]:
    """What is wrong with the types / ranges of the config keys SDARConfig reads (empty when nothing)."""
    problems = []
    for k in (*_POSITIVE_INT_KEYS, *_OPTIONAL_POSITIVE_INT_KEYS):
        if k not in d or (d[k] is None and k in _OPTIONAL_POSITIVE_INT_KEYS):
            continue
        if not (_is_int(d[k]) and d[k] > 0):
            problems.append(f"{k!r} must be a positive integer, got {d[k]!r}")
    for k in _POSITIVE_FLOAT_KEYS:
        v = d.get(k)
        if v is None and k == "rope_theta":  # null: the official default
            continue
        if k in d and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            problems.append(f"{k!r} must be a positive finite number, got {v!r}")
    for k, types in _OPTIONAL_KEY_TYPES.items():
        v = d.get(k)
        if v is not None and (not isinstance(v, types) or (types == (int,) and isinstance(v, bool))):
            problems.append(f"{k!r} must be {' or '.join(t.__name__ for t in types)} (or null), got {v!r}")
    return problems


def read_config(path: str | Path) -> SDARConfig:
    """SDARConfig of a checkpoint folder (or of a config.json path), with errors naming the file and key."""
    path = Path(path)
    file = path if path.suffix == ".json" and not path.is_dir() else path / CONFIG_NAME  # a folder may end in .json
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} at {file}" + _backup_hint(file.parent))
    d = read_json_file(file, error=CheckpointError)
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in d]
    if missing:
        raise CheckpointError(f"{file} is missing required key(s): {', '.join(repr(k) for k in missing)}")
    problems = _config_type_problems(d)
    if problems:
        raise CheckpointError(f"{file} has key(s) of the wrong type or range: {'; '.join(problems)}")
    if d.get("model_type") not in (None, "sdar", "qwen3"):
        warnings.warn(f"{file}: model_type {d.get('model_type')!r} is not 'sdar'; loading it as SDAR", stacklevel=2)
    try:
        return SDARConfig.from_dict(d)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e.args[0] if e.args else e}") from None


def _config_dict(config: Any) -> dict:
    if config is None:
        raise ValueError("save_model needs a config (SDARConfig or dict)")
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"config must be an SDARConfig or a dict, got {type(config).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------------------
# the weight files of a folder
# ------------------------------------------------------------------------------------------------------------

def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it, from the index (validated) or model.safetensors."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        wmap = read_json_file(index, error=CheckpointError).get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
            raise CheckpointError(f"{index} has no valid 'weight_map' (an object of tensor name -> shard file)")
        bad = sorted({v for v in wmap.values() if Path(v).name != v})
        if bad:
            raise CheckpointError(f"{index} names shard files outside the folder: {bad}")
        absent = sorted({v for v in wmap.values() if not (folder / v).is_file()})
        if absent:
            raise CheckpointError(f"{index} refers to missing shard file(s) in {folder}: {', '.join(absent)}")
        return {k: folder / v for k, v in wmap.items()}
    single = folder / WEIGHTS_NAME
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: single for k in f.keys()}
        except Exception as e:  # safetensors' header errors (truncated, empty, not a safetensors file)
            raise CheckpointError(f"cannot read safetensors file {single}: {e}") from None
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {folder}" + _backup_hint(folder))


def _by_shard(files: dict[str, Path]) -> dict[Path, list[str]]:
    shards: dict[Path, list[str]] = {}
    for name, file in files.items():
        shards.setdefault(file, []).append(name)
    return dict(sorted(shards.items()))


def _tensor_shapes(files: dict[str, Path], floating: set[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Shapes from the shard headers (no weight is read); checks each tensor is where the index says, and that
    those named in `floating` (the model's parameters) are stored in a floating-point type."""
    shapes = {}
    for shard, names in _by_shard(files).items():
        try:
            with safe_open(str(shard), framework="pt") as f:
                present = set(f.keys())
                lost = sorted(n for n in names if n not in present)
                if lost:
                    raise CheckpointError(f"{shard} lacks tensor(s) the index assigns to it: {', '.join(lost)}")
                for n in names:
                    sl = f.get_slice(n)
                    if n in floating and sl.get_dtype() not in _FLOAT_STORAGE:
                        raise CheckpointError(f"{shard}: tensor {n} is stored as {sl.get_dtype()}, not a "
                                              f"floating-point type ({', '.join(_FLOAT_STORAGE)}): a quantized or "
                                              "corrupt checkpoint")
                    shapes[n] = tuple(sl.get_shape())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' header errors
            raise CheckpointError(f"cannot read safetensors file {shard}: {e}") from None
    return shapes


# ------------------------------------------------------------------------------------------------------------
# model structure helpers
# ------------------------------------------------------------------------------------------------------------

def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """alias name -> canonical name for parameters registered under several names (tied embeddings)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _retie(model: torch.nn.Module, aliases: dict[str, str]) -> None:
    for alias, canonical in aliases.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(canonical))


def _validate(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], folder: Path) -> None:
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    allowed = set(expected) | set(_aliases(model)) | {n for n, _ in model.named_buffers()}
    problems = []
    missing = sorted(set(expected) - set(shapes))
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing)}")
    unexpected = sorted(set(shapes) - allowed)
    if unexpected:
        problems.append(f"unexpected tensor(s) the model does not have: {', '.join(unexpected)}")
    for n in sorted(set(expected) & set(shapes)):
        if shapes[n] != expected[n]:
            problems.append(f"shape mismatch for {n}: the config implies {list(expected[n])}, the checkpoint has "
                            f"{list(shapes[n])}")
    for alias, canonical in _aliases(model).items():
        if alias in shapes and shapes[alias] != expected[canonical]:
            problems.append(f"shape mismatch for tied {alias}: expected {list(expected[canonical])}, "
                            f"found {list(shapes[alias])}")
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not match its config:\n  " + "\n  ".join(problems))


def _open_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


# ------------------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------------------

def _check_finite(tensors: dict[str, torch.Tensor], shard: Path) -> None:
    """CheckpointError naming the tensors of `shard` that hold NaN or inf (as loaded, in the load dtype: a value
    past the dtype's range counts too): such a model decodes nothing but one token and its evaluations read 0%
    without a word. One host read per shard."""
    if not tensors:
        return
    ok = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()
    bad = [n for n, good in zip(tensors, ok) if not good]
    if bad:
        raise CheckpointError(f"{shard}: tensor(s) {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} hold NaN or "
                              "inf values (a diverged or corrupt checkpoint)")


def load_model(path: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> tuple[SDARForCausalLM, SDARConfig]:
    """(model, config) from a checkpoint folder; dtype None = the config's torch_dtype."""
    folder = Path(path)
    config = read_config(folder)
    device = torch.device(device)
    dtype = dtype or config.dtype
    with torch.device("meta"):
        model = SDARForCausalLM(config)
    aliases = _aliases(model)
    files = checkpoint_files(folder)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    _validate(model, _tensor_shapes(files, params), folder)

    wanted = {n for n, _ in model.named_parameters()}
    open_on = _open_device(device)
    tied_extra: dict[str, Path] = {}
    for shard, names in _by_shard(files).items():
        with safe_open(str(shard), framework="pt", device=open_on) as f:
            part = {n: f.get_tensor(n).to(device=device, dtype=dtype) for n in names if n in wanted}
        _check_finite(part, shard)
        tied_extra.update({n: shard for n in names if n in aliases})
        model.load_state_dict(part, strict=False, assign=True)
        del part
    _retie(model, aliases)
    for alias, shard in tied_extra.items():  # a tied checkpoint that also stores lm_head.weight
        with safe_open(str(shard), framework="pt", device=open_on) as f:
            stored = f.get_tensor(alias).to(device=device, dtype=dtype)
        if not torch.equal(stored, model.get_parameter(aliases[alias]).detach()):
            warnings.warn(f"{folder}: tie_word_embeddings is set but the stored {alias} differs from "
                          f"{aliases[alias]}; it was ignored (the tied weight is used)", stacklevel=2)
        del stored

    if hasattr(model, "init_buffers"):
        model.init_buffers(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{folder}: tensors left uninitialized after loading (the model did not compute them): "
                              f"{', '.join(left)}")
    return model.eval(), config


# ------------------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------------------

def _write_shard(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str]) -> None:
    """One safetensors file, fsynced (module-level so tests can interrupt a save here)."""
    save_file(tensors, str(file), metadata=metadata)
    _fsync(file)


def _write_json(obj: Any, file: Path) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _fsync(file)


def _shard_plan(names: list[str], nbytes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in model order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if shards[-1] and size + nbytes[n] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    return shards


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_leftovers(final: Path) -> None:
    """Remove temp folders of dead saves to `final`; restore a backup left between the two fallback renames."""
    for kind in ("old", "tmp"):
        for p in _siblings(final, kind):
            pid = p.name[len(final.name) + len(kind) + 3:].split("-")[0]
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            if kind == "old" and not final.exists():
                os.rename(p, final)
            else:
                shutil.rmtree(p, ignore_errors=True)


def _copy_tokenizer(tokenizer: Any, folder: Path) -> None:
    if hasattr(tokenizer, "save"):
        tokenizer.save(folder)
        return
    src = Path(tokenizer)
    if not src.is_dir():
        raise FileNotFoundError(f"tokenizer folder {src} does not exist")
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{src} holds none of the tokenizer files {TOKENIZER_FILES}")
    for name in found:
        shutil.copyfile(src / name, folder / name)


def auto_map_modules(cfg: dict) -> list[str]:
    """The code files (`name.py`) an `auto_map` (config.json or tokenizer_config.json) names, in order."""
    refs: list[str] = []
    for v in (cfg.get("auto_map") or {}).values():
        refs += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
    mods = [r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs if "." in r]  # "repo--module.Class" too
    return list(dict.fromkeys(mods))


def _code_source(code_dir: str | Path | None, tokenizer: Any) -> Path | None:
    if code_dir is not None:
        return Path(code_dir)
    if tokenizer is None:
        return None
    src = getattr(tokenizer, "source_dir", tokenizer)
    return Path(src) if isinstance(src, (str, Path)) else None


def _copy_code(src: Path | None, folder: Path) -> list[str]:
    """Copy the top-level *.py files of `src` (the remote code of an SDAR folder: configuration_sdar.py,
    modeling_sdar.py, tokenization_qwen2.py and what they import) into `folder`. Returns the modules that the
    saved config.json / tokenizer_config.json name in `auto_map` but that are still missing."""
    if src is not None and src.is_dir():
        for f in sorted(src.glob("*.py")):
            if f.is_file() and not (folder / f.name).exists():
                shutil.copyfile(f, folder / f.name)
    names: list[str] = []
    for cfg_name in (CONFIG_NAME, "tokenizer_config.json"):
        if (folder / cfg_name).is_file():
            names += auto_map_modules(json.loads((folder / cfg_name).read_text(encoding="utf-8")))
    return [n for n in dict.fromkeys(names) if not (folder / n).is_file()]


def save_model(model: torch.nn.Module, config: Any, path: str | Path, max_shard_bytes: int = 5 * 2**30,
               tokenizer: Any = None, code_dir: str | Path | None = None) -> Path:
    """Write an SDAR checkpoint folder atomically (see the module docstring). Returns the folder.

    `code_dir`: the folder whose *.py files (the `trust_remote_code` modules the config's `auto_map` names) are
    copied along, so that the official SDAR code loads the saved folder; by default the tokenizer's source
    folder (the checkpoint it came from). A module named in `auto_map` that is not found gets a warning."""
    final = Path(path).absolute()
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final} exists and is not a folder")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = _config_dict(config if config is not None else getattr(model, "config", None))
    aliases = _aliases(model)
    if bool(aliases) != bool(cfg.get("tie_word_embeddings", False)):
        raise ValueError(f"config tie_word_embeddings={cfg.get('tie_word_embeddings', False)} but the model "
                         f"{'shares' if aliases else 'does not share'} parameters ({aliases or 'none'})")
    params = {n: p.detach() for n, p in model.named_parameters()}  # tied weights once, under the first name
    if not params:
        raise ValueError("the model has no parameters to save")
    meta = [n for n, p in params.items() if p.is_meta]
    if meta:
        raise ValueError(f"cannot save parameters on the meta device: {', '.join(meta[:5])}")
    dtypes = Counter(p.dtype for p in params.values())
    cfg.update(model_type="sdar", architectures=["SDARForCausalLM"], torch_dtype=_dtype_name(dtypes.most_common(1)[0][0]))
    if "dtype" in cfg:  # newer transformers' name of torch_dtype (and the one it prefers): the same value
        cfg["dtype"] = cfg["torch_dtype"]
    nbytes = {n: p.numel() * p.element_size() for n, p in params.items()}
    plan = _shard_plan(list(params), nbytes, max_shard_bytes)

    final.parent.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_json(cfg, tmp / CONFIG_NAME)
        meta_fmt = {"format": "pt"}
        if len(plan) == 1:
            _write_shard({n: params[n].cpu().contiguous() for n in plan[0]}, tmp / WEIGHTS_NAME, meta_fmt)
        else:
            weight_map = {}
            for i, names in enumerate(plan, 1):
                fname = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
                _write_shard({n: params[n].cpu().contiguous() for n in names}, tmp / fname, meta_fmt)
                weight_map.update({n: fname for n in names})
            _write_json({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": dict(sorted(weight_map.items()))},
                        tmp / INDEX_NAME)
        if tokenizer is not None:
            _copy_tokenizer(tokenizer, tmp)
        missing = _copy_code(_code_source(code_dir, tokenizer), tmp)
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        if not final.exists():
            os.rename(tmp, final)
        elif _rename_exchange(tmp, final):
            shutil.rmtree(tmp)  # tmp now holds the previous checkpoint
        else:
            old = final.parent / f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(old, final)  # put the previous checkpoint back
                raise
            shutil.rmtree(old, ignore_errors=True)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if missing:  # no folder in the text (a checkpoint is written in a temporary one): shown once per process
        warnings.warn(f"the model's config.json auto_map names {', '.join(missing)}, which its source folder does "
                      "not hold, so saved checkpoints lack them too: this package loads them without, "
                      "transformers' trust_remote_code loading will fail (save_model's code_dir can supply them)",
                      stacklevel=2)
    return final

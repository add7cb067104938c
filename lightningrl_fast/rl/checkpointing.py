"""[checkpoint] Save and restore the whole RL state, atomically, so that `--resume` continues exactly.

Layout of a run folder `out/`:

    out/checkpoint-<step>/     an SDAR model folder (config.json, model.safetensors, tokenizer files: loadable
                               with checkpoint.load_model and `--model`) plus `trainer_state.pt`
    out/latest                 one line: the name of the newest complete checkpoint folder
    out/reference/             the frozen reference policy (only when kl_beta > 0 and the initial policy does
                               not already live in a folder the caller names, see below)

`trainer_state.pt` (torch.save, read back with weights_only=True): step, data cursor, non-finite counter,
optimizer state (AdamW moments and step counts), scheduler state, RNG states (python, torch CPU, CUDA,
numpy), the RL config dict, the metrics history length (lines of metrics.jsonl at save time, so a resumed
run drops what a killed run logged after its last checkpoint), the reference record and `extra` (any
JSON-serializable dict of the caller: evaluation results, elapsed time, the run config).

Atomicity. Everything is written into a hidden sibling `.checkpoint-<step>.tmp-<pid>-<token>/`, each file
fsynced, then the folder is renamed into place (an existing folder of the same step is swapped out with
renameat2(RENAME_EXCHANGE) where available), then `latest` is rewritten through a temporary file and
`os.replace`, then older checkpoints beyond `keep` are renamed away and deleted. A save killed at any
point leaves `latest` naming a complete checkpoint (the previous one, or the new one once its rename is
done); leftovers of dead saves are removed by the next save. A model with a non-finite parameter is never
written: `NonFiniteModelError` is raised before anything touches the disk.

The frozen reference (KL term, kl_beta > 0) must stay the INITIAL policy across resumes, so it is not taken
from the resumed weights. Decision: each checkpoint records where the initial policy lives and a fingerprint
of its files. `save_checkpoint(..., reference_dir=D)` records D (the `--model` folder the run started from:
no copy of a large model is made); without it, the reference model itself is written once per run to
`out/reference/` (the embedded default's SFT model is tiny). `load_checkpoint` loads the reference weights
from there and refuses a folder whose files changed since (fingerprint mismatch).

Data-parallel runs (rl/distributed.py) shard the optimizer state over the ranks: `save_checkpoint_ranks`
(called by every rank) has each rank r > 0 stage `optimizer-rank<r>.pt` (its shard and RNG states) next to
the run folder, and rank 0 moves those files into its temporary checkpoint folder before the one atomic
rename, so a checkpoint is complete for all ranks or not there at all. `trainer_state.pt` records the number
of ranks and each parameter's owner rank, so a run resumes on any number of ranks (1 included): each rank
gathers the optimizer entries of the parameters it now owns from whichever shards hold them (shards are read
memory-mapped, one at a time). Another number of ranks samples other rollouts than the original run would
have (per-rank seeds), so such a resume continues the run but does not repeat it bit for bit (warned).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .._jsonfile import write_text_atomic
from ..checkpoint import CheckpointError, _fsync, _pid_alive, _rename_exchange, checkpoint_files, save_model
from .distributed import SINGLE, DistEnv, barrier, broadcast
from .trainer import TrainState

TRAINER_STATE = "trainer_state.pt"
LATEST = "latest"
REFERENCE = "reference"
PREFIX = "checkpoint-"
FORMAT_VERSION = 1
STATE_KEYS = ("step", "cursor", "nonfinite_in_row", "optimizer", "scheduler", "rng")  # what a resume needs

__all__ = [
    "NonFiniteModelError", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "list_checkpoints",
    "nonfinite_parameters", "load_weights_into", "save_reference", "fingerprint", "rng_state", "set_rng_state",
    "LoadedCheckpoint", "save_checkpoint_ranks", "shard_file",
]


class NonFiniteModelError(FloatingPointError):
    """The model holds NaN/inf parameters; nothing was saved."""


def _crash_point(stage: str) -> None:
    """No-op; tests replace it to interrupt a save at `stage` (model_written, state_written, renamed, latest_written)."""


# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------

def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of parameters holding NaN or inf."""
    return [n for n, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]


def _step_of(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    tail = name[len(PREFIX):]
    return int(tail) if tail.isdigit() else None


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest step first."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [(s, p) for p in out.iterdir() if (s := _step_of(p.name)) is not None and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def _clean_leftovers(out: Path) -> None:
    """Remove hidden temp/old/deleting folders of saves whose process is gone; restore an orphaned backup."""
    for p in out.iterdir():
        if not p.name.startswith("."):
            continue
        for kind in (".tmp-", ".old-", ".del-"):
            if kind in p.name:
                base, _, tail = p.name.partition(kind)
                pid = tail.split("-")[0]
                if not pid.isdigit() or _pid_alive(int(pid)):
                    break
                final = out / base[1:]
                if kind == ".old-" and p.is_dir() and not final.exists():
                    os.rename(p, final)  # killed between the two fallback renames: put it back
                elif p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                break


def rng_state() -> dict[str, Any]:
    """Python, torch CPU, CUDA (when initialized) and numpy RNG states, in weights_only-loadable types."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        try:
            import numpy as np

            s = state["numpy"]
            np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached"]))
        except ImportError:
            pass


def fingerprint(folder: str | Path) -> str:
    """sha256 over config.json and the weight files (whole files up to 64 MiB, else size + head + tail)."""
    folder = Path(folder)
    h = hashlib.sha256()
    names = sorted(p.name for p in folder.iterdir()
                   if p.name == "config.json" or p.name.endswith(".safetensors") or p.name.endswith(".index.json"))
    for name in names:
        p = folder / name
        size = p.stat().st_size
        h.update(f"{name}:{size}\n".encode())
        with open(p, "rb") as f:
            if size <= 64 * 2**20:
                h.update(f.read())
            else:
                h.update(f.read(4 * 2**20))
                f.seek(size - 4 * 2**20)
                h.update(f.read())
    return h.hexdigest()


def load_weights_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy the weights of an SDAR folder into an existing model in place (its dtype/device), shard by shard.

    Every parameter must be present with the right shape (CheckpointError naming the culprits otherwise).
    """
    folder = Path(folder)
    files = checkpoint_files(folder)
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    missing = sorted(set(params) - set(files))
    unexpected = sorted(set(files) - set(params) - aliases)
    if missing or unexpected:
        raise CheckpointError(f"{folder} does not match the model: missing {missing or 'none'}, "
                              f"unexpected {unexpected or 'none'}")
    shards: dict[Path, list[str]] = {}
    for n, f in files.items():
        if n in params:
            shards.setdefault(f, []).append(n)
    with torch.no_grad():
        for shard, names in sorted(shards.items()):
            with safe_open(str(shard), framework="pt") as f:
                for n in names:
                    t = f.get_tensor(n)
                    p = params[n]
                    if tuple(t.shape) != tuple(p.shape):
                        raise CheckpointError(f"{shard}: {n} has shape {list(t.shape)}, the model {list(p.shape)}")
                    p.copy_(t.to(device=p.device, dtype=p.dtype))


def _check_json(extra: dict[str, Any]) -> None:
    try:
        json.dumps(extra, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: `extra` must be JSON-serializable ({e})") from None


def _config_dict(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    d = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


# ------------------------------------------------------------------------------------------------------------
# reference model
# ------------------------------------------------------------------------------------------------------------

def save_reference(out_dir: str | Path, ref_model: torch.nn.Module, tokenizer: Any = None) -> Path:
    """Write the frozen reference policy to `out_dir/reference/` once (atomic); returns the folder."""
    folder = Path(out_dir) / REFERENCE
    if (folder / "config.json").is_file():
        return folder
    bad = nonfinite_parameters(ref_model)
    if bad:
        raise NonFiniteModelError(f"the reference model has non-finite parameters ({', '.join(bad[:5])}); not saved")
    return save_model(ref_model, ref_model.config, folder, tokenizer=tokenizer)


def _reference_record(out: Path, state: TrainState, reference_dir: str | Path | None, tokenizer: Any,
                      reference_fingerprint: str | None) -> dict | None:
    if state.ref_model is None:
        return None
    if reference_dir is None:
        folder = save_reference(out, state.ref_model, tokenizer)
        reference_fingerprint = None
    else:
        folder = Path(reference_dir)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"reference_dir {folder} holds no config.json")
    folder = folder.absolute()
    try:
        stored = str(folder.relative_to(out.absolute()))  # inside the run folder: relative (the run can move)
        relative = True
    except ValueError:
        stored, relative = str(folder), False
    return {"dir": stored, "relative": relative, "fingerprint": reference_fingerprint or fingerprint(folder)}


# ------------------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------------------

def save_checkpoint(out_dir: str | Path, state: TrainState, extra: dict[str, Any] | None = None, *,
                    config: Any = None, keep: int = 3, tokenizer: Any = None,
                    reference_dir: str | Path | None = None, reference_fingerprint: str | None = None,
                    metrics_len: int | None = None, rank_files: dict[str, Path] | None = None,
                    world_size: int = 1) -> Path:
    """Write `out_dir/checkpoint-<state.step>/` atomically, point `latest` at it, keep the last `keep`.

    config: the RLConfig (stored as a dict); tokenizer: written into the model folder (so it is a complete
    `--model` folder); reference_dir: the folder of the initial policy when kl_beta > 0 (None: the
    reference model is saved once to out_dir/reference); reference_fingerprint: `fingerprint(reference_dir)`
    taken when the run loaded the initial policy (default: computed now; pass it so that a folder modified
    during the run is caught); metrics_len: lines of metrics.jsonl so far; rank_files:
    files (the other ranks' optimizer shards) moved into the folder before it is renamed into place; world_size:
    the number of ranks the optimizer state spans.
    Raises NonFiniteModelError (nothing written) when a parameter is NaN/inf. Returns the folder.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    extra = dict(extra or {})
    _check_json(extra)
    bad = nonfinite_parameters(state.model)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise NonFiniteModelError(f"not saving checkpoint of step {state.step}: non-finite values in "
                                  f"{', '.join(bad[:5])}{more}")
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(out)
    reference = _reference_record(out, state, reference_dir, tokenizer, reference_fingerprint)
    name = f"{PREFIX}{state.step}"
    final = out / name
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out / f".{name}.tmp-{token}"
    payload = {
        "format": FORMAT_VERSION,
        "step": state.step,
        "cursor": state.cursor,
        "nonfinite_in_row": state.nonfinite_in_row,
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "rng": rng_state(),
        "rl_config": _config_dict(config),
        "metrics_len": metrics_len,
        "reference": reference,
        "extra": json.dumps(extra, allow_nan=True),
        "torch_version": str(torch.__version__),
        "world_size": int(world_size),
        "owners": list(state.owners) if state.owners is not None else None,
    }
    try:
        save_model(state.model, state.model.config, tmp, tokenizer=tokenizer)
        _crash_point("model_written")
        with open(tmp / TRAINER_STATE, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        for fname, src in (rank_files or {}).items():
            os.rename(src, tmp / fname)  # staged (and fsynced) by its rank next to the run folder
        _fsync(tmp)
        _crash_point("state_written")
        if not final.exists():
            os.rename(tmp, final)
        elif _rename_exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous folder of this step
        else:
            old = out / f".{name}.old-{token}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        _fsync(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _crash_point("renamed")
    _write_latest(out, name)
    _crash_point("latest_written")
    _prune(out, keep, name)
    return final


def shard_file(rank: int) -> str:
    return f"optimizer-rank{rank}.pt"


def save_checkpoint_ranks(env: DistEnv, out_dir: str | Path, state: TrainState, extra: dict[str, Any] | None = None,
                          **kw: Any) -> Path:
    """`save_checkpoint` for every rank of a data-parallel run (all must call it); with one rank, exactly it.

    Ranks r > 0 write their optimizer shard and RNG states to a staging file in `out_dir`; rank 0 writes the
    model and its trainer state and moves the shards into the same checkpoint folder before the atomic rename.
    Returns the folder on every rank; a failure on rank 0 is raised on every rank."""
    if not env.active:
        return save_checkpoint(out_dir, state, extra, **kw)
    bad = nonfinite_parameters(state.model)  # the weights are the same on every rank: all refuse alike
    if bad:
        raise NonFiniteModelError(f"not saving checkpoint of step {state.step}: non-finite values in "
                                  f"{', '.join(bad[:5])}")
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    token = broadcast(env, uuid.uuid4().hex[:8])

    def staged(rank: int) -> Path:
        return out / f".{PREFIX}{state.step}.shard-{token}-rank{rank}.pt"

    if env.rank > 0:
        with open(staged(env.rank), "wb") as f:
            torch.save({"rank": env.rank, "world_size": env.world, "step": state.step,
                        "optimizer": state.optimizer.state_dict(), "rng": rng_state()}, f)
            f.flush()
            os.fsync(f.fileno())
    barrier(env)
    folder, err, exc = None, None, None
    if env.main:
        try:
            shards = {shard_file(r): staged(r) for r in range(1, env.world)}
            folder = save_checkpoint(out, state, extra, rank_files=shards, world_size=env.world, **kw)
        except Exception as ex:  # told to every rank below, then raised here
            err, exc = f"{type(ex).__name__}: {ex}", ex
        for p in out.glob(f".{PREFIX}*.shard-*-rank*.pt"):  # this save's leftovers (on failure) and older ones
            p.unlink(missing_ok=True)
    folder, err = broadcast(env, (str(folder) if folder else None, err))
    if exc is not None:
        raise exc
    if err is not None:
        raise CheckpointError(f"rank 0 failed to save the checkpoint of step {state.step}: {err}")
    return Path(folder)


def _write_latest(out: Path, name: str) -> None:
    write_text_atomic(out / LATEST, name + "\n", sync_dir=True)


def _prune(out: Path, keep: int, current: str) -> None:
    ckpts = list_checkpoints(out)
    doomed = [p for p in ckpts[:-keep] if p.name != current] if len(ckpts) > keep else []
    for p in doomed:
        gone = out / f".{p.name}.del-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(p, gone)  # out of sight first: a half-deleted folder never looks like a checkpoint
        shutil.rmtree(gone, ignore_errors=True)


def set_aside_later(out_dir: str | Path, resumed: str | Path, metrics_len: int | None
                    ) -> tuple[Path | None, list[str], int]:
    """A run resumed from a checkpoint older than its newest: move what the resumed run would replace or
    contradict into `out/discarded-<k>/` instead of losing it: the later checkpoint folders, and the metrics
    records past the checkpoint's `metrics_len` (as discarded-<k>/metrics.jsonl). `latest` is pointed at the
    resumed checkpoint. Nothing happens when `resumed` is not a checkpoint folder of `out_dir`. Returns (the
    folder or None when nothing was later, checkpoint names moved, records moved). Main rank only."""
    from .logging import METRICS_FILE, read_metrics

    out, resumed = Path(out_dir), Path(resumed)
    step = _step_of(resumed.name)
    if step is None or resumed.parent.resolve() != out.resolve():
        return None, [], 0
    later = [p for p in list_checkpoints(out) if (_step_of(p.name) or 0) > step]
    records = read_metrics(out / METRICS_FILE, strict=True)
    tail = records[metrics_len:] if metrics_len is not None else []
    if not later and not tail:
        return None, [], 0
    k = 1
    while (out / f"discarded-{k}").exists():
        k += 1
    dest = out / f"discarded-{k}"
    dest.mkdir()
    if tail:
        with open(dest / METRICS_FILE, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in tail)
            f.flush()
            os.fsync(f.fileno())
    for p in later:
        os.rename(p, dest / p.name)
    _write_latest(out, resumed.name)
    _fsync(out)
    return dest, [p.name for p in later], len(tail)


# ------------------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------------------

def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder meant by `path`: a checkpoint folder itself, or a run folder (its `latest`, else
    its highest complete checkpoint). FileNotFoundError / ValueError with a readable message otherwise."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such folder")
    if not p.is_dir():
        raise ValueError(f"{p} is not a folder")
    if (p / TRAINER_STATE).is_file():
        return p
    latest = p / LATEST
    if latest.is_file():
        try:
            name = latest.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{latest} is corrupt (not UTF-8 text); it should hold one checkpoint folder name "
                             f"such as {PREFIX}<step>") from None
        if _step_of(name) is None or Path(name).name != name:  # never a path out of this run folder
            raise ValueError(f"{latest} names {name!r}, not a checkpoint folder of this run ({PREFIX}<step>)")
        target = p / name
        if not target.exists():  # killed between the two fallback renames of a same-step re-save
            olds = sorted(q for q in p.iterdir() if q.name.startswith(f".{name}.old-"))
            if olds:
                os.rename(olds[-1], target)
        if (target / TRAINER_STATE).is_file():
            return target
        raise ValueError(f"{latest} names {name!r}, which is not a complete checkpoint folder")
    ckpts = list_checkpoints(p)
    if ckpts:
        return ckpts[-1]
    raise ValueError(f"{p} holds no checkpoint (no {TRAINER_STATE}, no {LATEST} file, no {PREFIX}<step> folder)")


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    extra: dict[str, Any]
    metrics_len: int | None
    rl_config: dict[str, Any] | None
    reference_dir: Path | None
    reference_fingerprint: str | None = None


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The raw trainer_state.pt of a checkpoint (or run) folder; `extra` decoded."""
    ck = resolve_checkpoint(path)
    f = ck / TRAINER_STATE
    others = [q.name for q in list_checkpoints(ck.parent) if q != ck]
    hint = f"; resume from an earlier checkpoint instead ({', '.join(others[-3:])})" if others else ""
    try:
        ts = torch.load(f, map_location="cpu", weights_only=True, mmap=True)  # tensors read on use
    except Exception as e:  # truncated, not a torch zip file, not loadable with weights_only
        raise CheckpointError(f"{f}: cannot read the trainer state, the file is truncated or corrupt "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}){hint}") from None
    if not isinstance(ts, dict):
        raise CheckpointError(f"{f}: holds a {type(ts).__name__}, not a trainer state{hint}")
    if ts.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{f}: unknown format {ts.get('format')!r} (expected {FORMAT_VERSION})")
    missing = [k for k in STATE_KEYS if k not in ts]
    if missing:
        raise CheckpointError(f"{f}: the trainer state lacks {', '.join(missing)}{hint}")
    try:
        ts["extra"] = json.loads(ts["extra"]) if isinstance(ts.get("extra"), str) else (ts.get("extra") or {})
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: its `extra` record is not valid JSON ({e}){hint}") from None
    ts["path"] = ck
    return ts


def _reference_path(ck: Path, rec: dict) -> Path:
    return (ck.parent / rec["dir"]) if rec.get("relative") else Path(rec["dir"])


def _read_shard(ck: Path, rank: int, step: int) -> dict[str, Any]:
    """Rank `rank`'s `optimizer-rank<rank>.pt` of a checkpoint folder (memory-mapped), checked."""
    shard = ck / shard_file(rank)
    if not shard.is_file():
        raise CheckpointError(f"{ck}: the optimizer shard of rank {rank} ({shard.name}) is missing")
    sh = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
    if int(sh.get("rank", -1)) != rank or int(sh.get("step", -1)) != step:
        raise CheckpointError(f"{shard}: holds rank {sh.get('rank')} step {sh.get('step')}, expected rank "
                              f"{rank} step {step}")
    return sh


def _reshard_optimizer(ck: Path, ts: dict[str, Any], saved_world: int, n_params: int,
                       owners: list[int] | None, env: DistEnv) -> dict[str, Any]:
    """This rank's optimizer state dict under the current partition, gathered from the shards of a checkpoint
    saved by another number of ranks (each saved shard lists its parameters in model order). Its tensors are the
    shards' memory-mapped ones, read when the optimizer places them (an offloaded one into its pinned slabs)."""
    saved_owners = ts.get("owners") or [0] * n_params
    if len(saved_owners) != n_params:
        raise CheckpointError(f"{ck}: the optimizer state covers {len(saved_owners)} parameter tensors, the model has "
                              f"{n_params}")
    mine = [i for i in range(n_params) if (owners[i] if owners is not None else 0) == env.rank]
    where = {g: k for k, g in enumerate(mine)}  # global parameter index -> index in this rank's optimizer
    state: dict[int, Any] = {}
    group = None
    for r in range(saved_world):
        sd = ts["optimizer"] if r == 0 else _read_shard(ck, r, int(ts["step"]))["optimizer"]
        held = [i for i in range(n_params) if saved_owners[i] == r]  # shard r's parameters, in its order
        if group is None:
            group = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
        for local, entry in sd["state"].items():
            g = held[int(local)]
            if g in where:  # the loaded (memory-mapped) tensors themselves: the optimizer's load_state_dict copies
                state[where[g]] = dict(entry)  # each into place, so this rank's shard is never held twice in memory
    return {"state": state, "param_groups": [dict(group or {}, params=list(range(len(mine))))]}


def _apply_optimizer_config(state: TrainState, config: Any) -> None:
    """The current config's lr, betas and weight decay over the ones the loaded optimizer and scheduler state
    carry (torch restores them from the checkpoint): a resume with a changed --lr/--betas/--weight-decay runs
    with the new values, at the learning-rate schedule's current factor. Unchanged values change nothing."""
    lr, betas, wd = (getattr(config, k, None) for k in ("lr", "betas", "weight_decay"))
    base_lrs = getattr(state.scheduler, "base_lrs", None)
    for i, group in enumerate(state.optimizer.param_groups):
        if betas is not None:
            group["betas"] = tuple(betas)
        if wd is not None:
            group["weight_decay"] = wd
        if lr is not None and base_lrs is not None and i < len(base_lrs) and base_lrs[i] != lr:
            factor = group["lr"] / base_lrs[i] if base_lrs[i] else 1.0  # the schedule's factor at this step
            base_lrs[i] = lr
            group["initial_lr"] = lr
            group["lr"] = lr * factor


def load_checkpoint(path: str | Path, state: TrainState, *, config: Any = None, restore_rng: bool = True,
                    load_model_weights: bool = True, env: DistEnv = SINGLE) -> LoadedCheckpoint:
    """Restore `state` in place from a checkpoint (or run) folder: model weights, frozen reference (from the
    recorded initial-policy folder, fingerprint-checked), optimizer, scheduler, step, cursor, non-finite
    counter and (restore_rng) the RNG states. `config` (the current RLConfig) is compared with the saved one;
    differences are warned about, and its lr, betas and weight decay replace the restored optimizer's. Returns
    what else the checkpoint holds (extra, metrics length, ...). A trainer_state.pt that is truncated, corrupt or
    lacks a field is a CheckpointError naming the file (and the run's other checkpoints).
    Data parallel: every rank calls it; rank r > 0 takes its optimizer shard and RNG states from
    `optimizer-rank<r>.pt`. A checkpoint saved by another number of ranks is redistributed: each rank gathers the
    entries of the parameters it now owns from the shards (`_reshard_optimizer`), with a warning."""
    ts = read_trainer_state(path)
    ck: Path = ts["path"]
    saved_world = int(ts.get("world_size", 1))
    if saved_world == env.world:
        opt_state, rng = ts["optimizer"], ts["rng"]
        if env.rank > 0:
            sh = _read_shard(ck, env.rank, int(ts["step"]))
            opt_state, rng = sh["optimizer"], sh["rng"]
    else:
        n = len(list(state.model.parameters()))
        opt_state = _reshard_optimizer(ck, ts, saved_world, n, state.owners, env)
        rng = _read_shard(ck, env.rank, int(ts["step"]))["rng"] if 0 < env.rank < saved_world else ts["rng"]
        warnings.warn(f"resuming {ck} (saved by {saved_world} rank(s)) with {env.world} rank(s): the optimizer "
                      "state is redistributed; rollouts are split differently, so the run continues but does not "
                      "repeat the original one bit for bit", stacklevel=2)
    ref_dir, ref_fp = None, None
    if state.ref_model is not None:
        rec = ts.get("reference")
        if rec is None:
            raise CheckpointError(f"{ck} was saved without a reference model (kl_beta was 0), but this run has "
                                  "kl_beta > 0 and needs the initial policy; resume with --kl-beta 0")
        ref_dir = _reference_path(ck, rec)
        if not (ref_dir / "config.json").is_file():
            raise CheckpointError(f"{ck}: the reference (initial policy) folder {ref_dir} is gone")
        ref_fp = rec["fingerprint"]
        if fingerprint(ref_dir) != ref_fp:
            raise CheckpointError(f"{ck}: the reference (initial policy) folder {ref_dir} changed since the run "
                                  "started (its files differ); the KL term would use another model")
    if load_model_weights:
        load_weights_into(state.model, ck)
    if ref_dir is not None:
        load_weights_into(state.ref_model, ref_dir)
    try:
        state.optimizer.load_state_dict(opt_state)
        state.scheduler.load_state_dict(ts["scheduler"])
        state.step, state.cursor, state.nonfinite_in_row = int(ts["step"]), int(ts["cursor"]), int(ts["nonfinite_in_row"])
        if restore_rng:
            set_rng_state(rng)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"{ck / TRAINER_STATE}: its optimizer, scheduler or RNG state does not fit this model "
                              f"or is corrupt ({type(e).__name__}: {e})") from None
    if config is not None:
        _apply_optimizer_config(state, config)
    saved = ts.get("rl_config")
    if config is not None and saved is not None:
        now = _config_dict(config) or {}
        diff = sorted(k for k in set(now) | set(saved) if k != "steps" and now.get(k) != saved.get(k))
        if diff:
            warnings.warn(f"resuming {ck} with a different RL config: "
                          + ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in diff), stacklevel=2)
    return LoadedCheckpoint(ck, state.step, ts["extra"], ts.get("metrics_len"), saved, ref_dir, ref_fp)

"""[data parallel] One RL run over several GPUs: one process per GPU (`torchrun`), each with the whole model.

    torchrun --nproc-per-node 4 -m lightningrl_fast.train --model DIR ...

What each rank does (rank r of W):
  * rollouts: it decodes its share of each step's prompts on its own copy of the weights (the sampler and the
    trainer still share one set of parameters per process: no weight copy through disk or across processes);
    the data stream, its cursor and the refill rounds of dynamic sampling are global (every rank draws the same
    indices and takes its slice), a group never straddles two ranks;
  * advantages: the group z-scores are per group (local); the batch z-score is over every rank's samples
    (the rewards are all-gathered, a few floats per sample);
  * loss: the Seq-Tok-Tok totals (sequences, tokens, correct sequences and tokens of a mini-batch) are summed
    over the ranks before the loss, so each rank's loss is its share of the global mini-batch loss and the
    summed gradients equal a single process's gradient of the whole batch;
  * optimizer (ZeRO-1): every parameter tensor has one owner rank (`partition`: largest first, to the least
    loaded rank). Gradients are summed into the owner in fp32 (`dist.reduce`), the global gradient norm is one
    all-reduce of the owners' partial sums, the owner clips and steps (fp32 master weights and Adam moments
    exist on the owner only: 12 bytes per bf16 parameter / W instead of 12), then broadcasts the new weights.
    The weights of all ranks therefore stay bitwise identical.
  * checkpoints: rank 0 writes the model and the trainer state (its own optimizer shard inside); rank r > 0
    writes `optimizer-rank<r>.pt` (its shard and RNG states), moved into the same atomic checkpoint folder.
    A checkpoint resumes on any number of ranks (rl/checkpointing.py redistributes the shards).
`DistEnv` says who this process is; every collective here is a no-op (or the identity) when `world == 1`, so the
single-process path runs the same code. Collectives use NCCL on CUDA and gloo on CPU (the tests: 2 CPU processes).
Also here, for one process as for several: `resolve_device` (the `--device` check of train and the CLIs) and the
memory plan `check_training_memory` (the GPU's share of weights, gradients, optimizer shard and reference, and
with `--optimizer-offload` / `--reference-offload` the pinned host memory of this machine's ranks).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .optim import DEFAULT_CHUNK, STAGING_BYTES_PER_ELEMENT, offloaded_state_bytes


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in a data-parallel run (world 1: a plain single-process run)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where this rank's collectives put their tensors (cuda:<local_rank> under NCCL)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE = DistEnv()


def env_from_environment(environ: dict[str, str] | None = None) -> DistEnv:
    """The torchrun variables (WORLD_SIZE, RANK, LOCAL_RANK); world 1 when they are absent."""
    e = os.environ if environ is None else environ
    raw = {k: e.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    if raw["WORLD_SIZE"] is None:
        return SINGLE
    try:
        world, rank = int(raw["WORLD_SIZE"]), int(raw["RANK"] or 0)
        local = int(raw["LOCAL_RANK"] if raw["LOCAL_RANK"] is not None else rank)
    except ValueError:
        raise ValueError(f"torchrun environment: WORLD_SIZE, RANK and LOCAL_RANK must be integers, got {raw}") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"torchrun environment: need 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0, got {raw}")
    return DistEnv(rank=rank, world=world, local_rank=local)


def resolve_device(name: str) -> torch.device:
    """The torch device a `--device` value names ('auto': cuda when available, else cpu). ValueError (which the
    CLIs and train's config check report as a usage error) for a malformed name, a device other than cpu / cuda
    (the model loads and decodes on those; mps / meta / xla failed after loading) or a CUDA device this machine
    does not have. The one device check of every CLI."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a valid torch device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda devices are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def init(env: DistEnv, device: torch.device, timeout_min: float = 60.0) -> tuple[DistEnv, torch.device]:
    """Join the process group (MASTER_ADDR/MASTER_PORT from torchrun). CUDA: one GPU per rank, cuda:<local_rank>
    (an explicit 'cuda:N' is refused: with several ranks the device comes from LOCAL_RANK), NCCL; CPU: gloo."""
    if not env.active:
        return env, device
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"--device {device}: with {env.world} ranks each rank uses cuda:<LOCAL_RANK>; "
                             "give --device cuda (or auto)")
        n = torch.cuda.device_count()
        if env.local_rank >= n:
            raise ValueError(f"rank {env.rank}: LOCAL_RANK {env.local_rank} but this node has {n} GPU(s); "
                             "start at most one process per GPU (torchrun --nproc-per-node)")
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"data-parallel runs support cuda and cpu devices, got {device}")
    if not dist.is_initialized():
        _import_group_defaults()
        kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=env.rank, world_size=env.world,
                                timeout=datetime.timedelta(minutes=timeout_min), **kw)
    env = DistEnv(env.rank, env.world, env.local_rank, str(device))
    return env, device


def _import_group_defaults() -> None:
    """Import, before the process group exists, the torch modules whose functions take `group=group.WORLD` as a
    default argument: a default is evaluated once, at import, so imported after `init_process_group` they would
    keep the default group alive for the life of the process, and `destroy_process_group` would leave its
    backend running (see `shutdown`). Imported before it, the default is None (= the default group at call time).

    `torch.distributed.nn` is such a module (10 collectives). Nothing here calls it, but every CLI's model load
    imported it: `checkpoint.load_model` builds the model on the meta device, where the first weight init runs
    `torch._refs.normal`, wrapped in `torch._disable_dynamo`, which imports torch._dynamo, which imports FSDP,
    which imports `torch.distributed.nn.functional`."""
    try:
        import torch.distributed.nn  # noqa: F401
    except ImportError:  # a torch build without it has nothing to bind
        pass


def shutdown(env: DistEnv, ok: bool = True) -> None:
    """Leave the process group. After a normal run (`ok`) the ranks first meet at a barrier, so that none tears
    its end down and exits while another still works. After an error there is no barrier (the other ranks may
    never reach it): a gloo group is destroyed at once, an NCCL group is left to the launcher, which stops the
    other ranks (destroying it can block on a peer stuck in a collective).

    Destroying the group must free it: the backend's destructor is what stops gloo's worker threads (it joins
    them). A gloo worker drops its reference to a finished collective's work item, and so to its tensors, only
    after the caller has been released, and releasing a tensor made in Python takes the GIL. A worker that gets
    there once interpreter finalization has begun is ended by CPython (pthread_exit) inside the work item's
    noexcept destructor: std::terminate, SIGABRT, "terminate called without an active exception" (seen on a rank
    with nothing to write, which reaches finalization first, under heavy machine load, which deschedules the
    worker). torch's `destroy_process_group` only unregisters the group, so a reference left anywhere keeps the
    backend and its threads running into finalization: `init` imports first the modules that would keep one
    (`_import_group_defaults`), and this function checks that the group is gone once destroyed (a RuntimeWarning
    says the hazard is back)."""
    if not (env.active and dist.is_initialized()):
        return
    if ok:
        dist.barrier()
    elif dist.get_backend() == "nccl":
        return
    try:
        group = weakref.ref(dist.group.WORLD)
    except TypeError:  # a ProcessGroup without weak references: nothing to check
        group = lambda: None  # noqa: E731
    dist.destroy_process_group()
    if group() is not None:
        gc.collect()  # a reference cycle that holds it
    if group() is not None:
        warnings.warn("the process group is still referenced after destroy_process_group, so its backend "
                      "(gloo worker threads) keeps running into interpreter exit, where it can abort this process; "
                      "something imported after init_process_group keeps a reference to dist.group.WORLD",
                      RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def joined(env: DistEnv):
    """The body of a run that `init` joined to the group: leaves it on exit (`shutdown`, ok when no exception
    escaped)."""
    try:
        yield
    except BaseException:
        shutdown(env, ok=False)
        raise
    shutdown(env, ok=True)


# ------------------------------------------------------------------------------------------------------------
# small collectives (identity with one rank)
# ------------------------------------------------------------------------------------------------------------

def barrier(env: DistEnv) -> None:
    if env.active:
        dist.barrier()


def all_sum(env: DistEnv, values: Sequence[float]) -> list[float]:
    """Element-wise sum over the ranks of a few numbers (float64)."""
    if not env.active:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return t.tolist()


def all_max(env: DistEnv, values: Sequence[float]) -> list[float]:
    if not env.active:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather(env: DistEnv, obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order."""
    if not env.active:
        return [obj]
    out: list[Any] = [None] * env.world
    dist.all_gather_object(out, obj)
    return out


def broadcast(env: DistEnv, obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src` on every rank."""
    if not env.active:
        return obj
    box = [obj if env.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@torch.no_grad()
def broadcast_params(env: DistEnv, module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank `src`'s (in place: views and packing survive)."""
    if not env.active:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=src)


# ------------------------------------------------------------------------------------------------------------
# ZeRO-1: parameter owners, gradient reduction, weight broadcast
# ------------------------------------------------------------------------------------------------------------

def partition(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each tensor: largest first, each to the least loaded rank (ties: lower index / rank).
    Deterministic, so every rank computes the same plan."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if world > 1 and len(sizes) < world:
        raise ValueError(f"{world} ranks but only {len(sizes)} parameter tensors: every rank must own at least one")
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += int(sizes[i])
    return owner


def owned(params: Sequence[torch.nn.Parameter], owners: Sequence[int] | None, env: DistEnv) -> list:
    """The parameters this rank updates (all of them with one rank)."""
    if owners is None or not env.active:
        return list(params)
    return [p for p, o in zip(params, owners) if o == env.rank]


@torch.no_grad()
def reduce_and_clip(env: DistEnv, params: Sequence[torch.nn.Parameter], owners: Sequence[int],
                    max_norm: float) -> float:
    """Sum every gradient into its owner (fp32), clip by the global norm; returns that norm (inf/nan when not
    finite: then every rank's gradients are cleared and the caller skips the update, consistently).

    Afterwards an owner's `p.grad` holds the clipped global gradient in p's dtype; other ranks' are None."""
    sq = torch.zeros((), dtype=torch.float64, device=env.device)
    kept: list[torch.nn.Parameter] = []
    for p, o in zip(params, owners):  # one parameter at a time: the fp32 copy is transient
        g = (p.grad.detach().to(torch.float32, copy=True) if p.grad is not None
             else torch.zeros_like(p, dtype=torch.float32))
        dist.reduce(g, dst=o)
        p.grad = None
        if o == env.rank:
            sq += g.square().sum(dtype=torch.float64)
            p.grad = g.to(p.dtype)
            kept.append(p)
        del g
    dist.all_reduce(sq)
    norm = math.sqrt(float(sq))
    if not math.isfinite(norm):
        for p in kept:
            p.grad = None
        return norm
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in kept:
            p.grad.mul_(coef)
    return norm


@torch.no_grad()
def broadcast_from_owners(env: DistEnv, params: Sequence[torch.nn.Parameter], owners: Sequence[int]) -> None:
    """Each owner's updated weights to every rank (in place)."""
    for p, o in zip(params, owners):
        dist.broadcast(p.data, src=o)


# ------------------------------------------------------------------------------------------------------------
# memory plan
# ------------------------------------------------------------------------------------------------------------

OFFLOAD_STAGING_BYTES = STAGING_BYTES_PER_ELEMENT * DEFAULT_CHUNK  # GPU bytes of one offloaded chunk (rl/optim)


class HostMemoryError(MemoryError):
    """The host memory an offloaded run pins (optimizer state, frozen reference) exceeds what the machine has."""


def _opt_bytes(n_params: int, param_bytes: int, world: int) -> int:
    """Optimizer state per rank: fp32 moments, plus fp32 master weights for non-fp32 parameters, 1/world of it."""
    return -(-n_params * (8 + (0 if param_bytes == 4 else 4)) // world)  # rl/optim: master copy unless fp32


def training_bytes(n_params: int, param_bytes: int, world: int, reference: bool,
                   optimizer_offload: bool = False) -> dict[str, int]:
    """Bytes per rank of what RL training keeps resident on the GPU, before activations and the rollout KV cache:
    weights, gradients (transient in backward, full size), optimizer state (1/world of it per rank; with
    `optimizer_offload` only the chunk it streams through the GPU) and the frozen reference copy (`reference`:
    kl_beta > 0 and the reference on the GPU)."""
    opt = _opt_bytes(n_params, param_bytes, world)
    return {"weights": n_params * param_bytes, "gradients": n_params * param_bytes,
            "optimizer": min(opt, OFFLOAD_STAGING_BYTES) if optimizer_offload else opt,
            "reference": n_params * param_bytes if reference else 0}


def host_plan(model: torch.nn.Module, world: int, reference_offload: bool, optimizer_offload: bool) -> int:
    """Pinned host bytes of the largest rank, as allocated: its optimizer shard (`optim.offloaded_state_bytes`, the
    owners as `partition` gives them) and its copy of the frozen reference (`logprobs.host_copy_bytes`), both
    carved from power-of-two slabs."""
    from .logprobs import host_copy_bytes

    params = list(model.parameters())
    total = 0
    if optimizer_offload:
        owners = partition([p.numel() for p in params], world) if world > 1 else [0] * len(params)
        total += max(offloaded_state_bytes([p for p, o in zip(params, owners) if o == r]) for r in range(world))
    if reference_offload:
        total += host_copy_bytes(model)
    return total


def memory_problem(n_params: int, param_bytes: int, world: int, reference: bool, total: int,
                   optimizer_offload: bool = False) -> str | None:
    """Why the resident training state (`training_bytes`) cannot fit `total` bytes of GPU memory, with the options
    that would fit; None when it fits (within 95%)."""
    plan = training_bytes(n_params, param_bytes, world, reference, optimizer_offload)
    need = sum(plan.values())
    if need <= 0.95 * total:
        return None
    gib = 2.0 ** 30

    def fits(w: int = world, ref: bool = reference, off: bool = optimizer_offload) -> bool:  # 20% left for the rest
        return sum(training_bytes(n_params, param_bytes, w, ref, off).values()) <= 0.8 * total

    parts = ", ".join(f"{k} {v / gib:.1f}" for k, v in plan.items() if v)
    opts = []
    if reference and fits(ref=False):
        opts.append("--reference-offload (the frozen reference in host memory) or --kl-beta 0 (no reference)")
    if not optimizer_offload and fits(off=True):
        opts.append("--optimizer-offload (the fp32 optimizer state in host memory, streamed to the GPU per step)")
    elif reference and not optimizer_offload and fits(ref=False, off=True):
        opts.append("--optimizer-offload together with --reference-offload (or --kl-beta 0)")
    n_more = next((w for w in range(world + 1, 257) if fits(w=w)), None)
    if n_more:
        opts.append(f"more GPUs: torchrun --nproc-per-node {n_more} (the optimizer state is sharded over the ranks)")
    return (f"training state needs {need / gib:.1f} GiB per GPU ({parts} GiB; {n_params / 1e9:.2f} B parameters, "
            f"{world} rank(s)) but the GPU has {total / gib:.1f} GiB, before activations and the rollout KV cache; "
            "options: " + ("; ".join(opts) if opts else "a smaller model"))


def available_host_bytes(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Host memory this process can still take: MemAvailable of /proc/meminfo, capped by its memory cgroup's room
    (a container's or a batch job's limit; pinned memory counts against it); None where neither can be read."""
    avail = None
    try:
        with open(f"{proc}/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    room = cgroup_room(proc, cgroup_root)
    return room if avail is None else avail if room is None else min(avail, room)


def cgroup_room(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """limit - usage of this process's memory cgroup (v2: memory.max / memory.current; v1: memory.limit_in_bytes /
    memory.usage_in_bytes), reclaimable file cache (inactive_file) not counted as used; None when there is no
    limit or nothing can be read. The cgroup's own folder (from /proc/self/cgroup) is tried first, then the mount's
    root (what a container with a cgroup namespace sees)."""
    paths: dict[str, str] = {}
    try:
        with open(f"{proc}/self/cgroup", encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
                    paths["v2"] = parts[2]
                elif len(parts) == 3 and "memory" in parts[1].split(","):
                    paths["v1"] = parts[2]
    except OSError:
        pass
    layouts = (("v2", "", "memory.max", "memory.current", "inactive_file"),
               ("v1", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    for version, sub, limit_f, usage_f, inactive_key in layouts:
        base = os.path.join(cgroup_root, sub) if sub else cgroup_root
        for folder in dict.fromkeys([os.path.join(base, paths.get(version, "").lstrip("/")), base]):
            try:
                with open(os.path.join(folder, limit_f), encoding="ascii") as f:
                    limit_s = f.read().strip()
                with open(os.path.join(folder, usage_f), encoding="ascii") as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit_s == "max" or not limit_s.isdigit() or int(limit_s) >= 1 << 60:  # v1 writes ~2^63 for none
                return None
            try:
                with open(os.path.join(folder, "memory.stat"), encoding="ascii") as f:
                    stat = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
                usage -= min(usage, int(stat.get(inactive_key, 0)))
            except (OSError, ValueError):
                pass
            return max(0, int(limit_s) - usage)
    return None


def host_memory_problem(per_rank: int, ranks_here: int, available: int | None, what: str) -> str | None:
    """Why `ranks_here` ranks pinning `per_rank` bytes each cannot fit `available` bytes of host memory (within
    90%), or None (also when nothing is pinned or the available memory is unknown)."""
    if not per_rank or available is None or per_rank * ranks_here <= 0.9 * available:
        return None
    gib = 2.0 ** 30
    return (f"the offloaded training state needs {per_rank * ranks_here / gib:.1f} GiB of pinned host memory "
            f"({per_rank / gib:.1f} GiB per rank x {ranks_here} rank(s) on this machine: {what}) but "
            f"{available / gib:.1f} GiB is available; options: offload less, spread the ranks over more machines, "
            "or a smaller model")


def check_training_memory(model: torch.nn.Module, device: torch.device, world: int, reference: bool,
                          optimizer_offload: bool = False, reference_offload: bool = False,
                          ranks_here: int | None = None) -> dict[str, int]:
    """Refuse, before the first rollout, a run whose resident training state cannot fit the GPU
    (torch.cuda.OutOfMemoryError) or whose offloaded parts cannot fit this machine's free host memory, counted for
    the `ranks_here` ranks on this node (HostMemoryError): an OOM in the first optimizer step would come after a
    whole step of rollouts. Returns the GPU plan, with the host bytes per rank under "host"."""
    n = sum(p.numel() for p in model.parameters())
    pb = next(model.parameters()).element_size()
    host = host_plan(model, world, reference_offload, optimizer_offload) if device.type == "cuda" else 0
    if device.type == "cuda":
        problem = memory_problem(n, pb, world, reference, torch.cuda.get_device_properties(device).total_memory,
                                 optimizer_offload)
        if problem:
            raise torch.cuda.OutOfMemoryError(f"{device}: {problem}")
        parts = (("optimizer state", optimizer_offload), ("frozen reference", reference_offload))
        what = " + ".join(w for w, on in parts if on)
        problem = host_memory_problem(host, ranks_here or world, available_host_bytes(), what)
        if problem:
            raise HostMemoryError(problem)
    return {**training_bytes(n, pb, world, reference, optimizer_offload), "host": host}

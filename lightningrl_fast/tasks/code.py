"""Sandboxed code verifier (the accuracy reward of MBPP / HumanEval-style tasks).

A completion is turned into a `CodeProgram` (setup, solution, list of tests) by `build_program`:

* HumanEval: the solution is ``prompt + completion`` when the completion is a function body, or
  ``prompt + "\\n" + completion`` when it already contains ``def <entry_point>(`` (the prompt's stub is a
  valid function, so the completion's definition replaces it while the prompt's imports and helpers
  stay); one test: the benchmark's ``test`` source followed by ``check(<entry_point>)``.
* MBPP: setup = ``test_setup_code`` (run after the solution: it may build fixtures from the solution's
  classes), solution = the completion, one test per assert of ``test_list``.
* plain code rows (tasks/data.py): the completion alone is the solution, tested as above by their
  ``test`` + ``entry_point`` (no stub is prepended: the prompt is prose) or their ``test_list``.

Model text goes through `extract_code` first (the last fenced block that defines the expected function,
else the last Python block; an unterminated fence is taken to the end; ChatML end tokens are dropped).

`run_program` executes one program in a fresh process and returns a `CodeResult` (pass fraction over the
tests, passed, failure reason: ``timeout``, ``syntax``, ``assertion``, ``memory``, ``output_limit``,
``forbidden``, ``killed:SIGxxx``, ``no_result``, ``error:<ExceptionName>``, ``sandbox_error``,
``no_tests`` for a program given no tests: it never passes). Tests of MBPP are counted one by one,
streamed as they finish, so a program that hangs on its third assert keeps the credit of the first two.
`verify_code_batch` runs many programs in parallel: a thread pool drives one subprocess per item (default
``os.cpu_count()`` at a time).

Isolation layers (each used when the machine allows it; `sandbox_capabilities` says which are on):

1. Always: a new session / process group killed as a whole (``SIGKILL``) at the wall-clock deadline and
   after every run; rlimits set by the child before any untrusted code (address space ``memory_mb``,
   CPU seconds (a ``timeout``: SIGXCPU to the harness's handler, SIGKILL a second later), file size
   ``file_mb``, process count, 256 open files, no core files); a scrubbed environment (PATH, LANG,
   HOME/TMPDIR = the working directory; only LD_LIBRARY_PATH is passed on, for interpreters that need it;
   no secrets); ``python -I -S`` (stdlib only unless ``allow_site_packages``;
   no user site, no PYTHON* variables); a fresh temporary working directory, removed afterwards;
   stdout/stderr go to files capped by RLIMIT_FSIZE and only the first ``max_output_bytes`` are read
   back; results come back over a private pipe, tagged with a nonce.
2. Root that can switch uid (not so in rootless containers): the child drops to an unprivileged uid/gid
   of its own (``uid_base + slot``, a slot per concurrent run, locked with flock across processes), so
   it cannot write root's files (the repository, the caller's temp dirs), signal the caller, or read
   other processes' environ/memory, and RLIMIT_NPROC (ignored for root) bounds a fork bomb. Without a PID namespace, leftover processes of that uid are
   killed after each run (an escaped ``setsid`` daemon included).
3. ``unshare`` (util-linux) when permitted: new network namespace (no network at all, not even the
   host's loopback), PID namespace (every descendant dies with the run; ``/proc`` shows only the sandbox),
   mount namespace with size-capped private tmpfs over /tmp, /var/tmp and /dev/shm (a write to /tmp/pwned
   lands in a throw-away tmpfs), IPC namespace. As non-root, ``unshare --map-root-user`` gives the same
   namespaces when unprivileged user namespaces are enabled.
4. Python guard (``python_guard=True``): an audit hook refusing writes outside the working directory,
   ``kill`` of other processes, fork/exec/subprocess, sockets other than AF_UNIX and ctypes. The first
   forbidden event ends the run with reason ``forbidden`` and score 0 (catching the error cannot help).

What running as root implies: the OS layers (2, 3) are all available and are what really stops hostile
code; the guard only adds early, readable failures. As a non-root user without user namespaces only
layers 1 and 4 remain: RLIMIT_NPROC then counts all the user's processes (it is set to their current
number plus ``max_procs``), a ctypes-based program could write the user's files or signal the caller,
and an escaped daemon outlives the run (its CPU time stays capped). The memory bound is per process:
``max_procs`` x ``memory_mb`` (8 GiB by default, per concurrent run) is the worst case for a fork bomb
that also allocates; use a cgroup if that matters.

Score integrity (the harness's and ``_sandbox_checks``' docstrings have the details): the program runs on
worker threads that hold no harness frame, the reporter is a supervisor thread whose frame the program cannot
reach (no gc walks, no ``sys._current_frames``, no frame introspection on the trusted threads, no
``/proc/self/mem``), a test is counted only when its ``exec`` returned normally, and the tests see pristine
builtins and restored stdlib modules. Objects that fool the comparison itself (the "AlwaysEqual" hack:
``__eq__`` always True, lying ``__lt__``/``__bool__``/``__sub__``/``__hash__``, value-type subclasses,
``__class__`` overrides, such objects inside containers or yielded by iterators, or put into the test's own
arguments) fail the test with ``error:NonPlainResult``: the tests call the program's callables through a
check that accepts only PLAIN values (exact builtin / stdlib value types, recursively, and instances of
program classes without any dunder beyond ``__init__``). A correct solution that returns a namedtuple, a
dataclass or a value-type subclass therefore fails too. Closed since (each with adversarial tests):

* methods, properties and class attributes of program-class instances that a test uses (``Stack().pop()``,
  ``build(xs).to_list()``, a setup fixture's ``root.value()``, ``getattr``/``hasattr``): the tests are
  compiled with every attribute load routed through a checked lookup; for a program object it hands over a
  plain value, a callable wrapped by the same result check, or fails (``error:NonPlainResult``);
* threads of the program racing the check (changing a checked value, a class or a stdlib attribute between
  the check and the comparison): no program thread may be alive when a check is made or a test runs; one
  left by the solution, a call or a test fails it with ``error:ProgramThreadAlive`` (after a 0.5 s grace).
  Threads started and joined within a call (``Thread.join``, ``with ThreadPoolExecutor()``) are fine; a
  pool left open is not. (``import threading`` / ``queue`` on the worker thread used to hang every run: the
  harness now imports ``threading`` first.)

Still out of reach of any in-process check: program code that runs outside a checked call while a test runs
(a weakref callback or finalizer fired when the test drops an object, a program class the test gets with the
builtin ``type()`` and calls, ``operator.methodcaller``-style stdlib helpers that read a program object's
attributes themselves); non-callable globals of the program that a test uses directly (their attributes are
checked, the objects themselves handed over as they are); as root of its own user namespace (non-root
caller without uid drop) a thread that both ``chroot``s to fake ``/proc/self/task`` and hides from the
interpreter's thread count; and, with ``python_guard=False`` (``ctypes`` allowed, frames readable), a
program reading or writing its own memory.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import math
import os
import pwd
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .data import Example

__all__ = [
    "SandboxConfig",
    "CodeProgram",
    "CodeResult",
    "extract_code",
    "build_program",
    "run_program",
    "verify_code",
    "verify_code_batch",
    "sandbox_capabilities",
]

_HARNESS = str(Path(__file__).with_name("_sandbox_harness.py"))
_CPU_LIMIT_EXIT = 124  # the harness's exit status at its CPU-seconds limit (_sandbox_harness.CPU_LIMIT_EXIT)
_PRIVATE_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")  # the harness mounts a private tmpfs over each (namespaced runs)


def hidden_site_dirs() -> list[str]:
    """This interpreter's site-packages folders that a namespaced run cannot see (they lie under a folder the
    sandbox covers with a private tmpfs: a virtual environment created in /tmp, say)."""
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [d for d in dirs if os.path.isdir(d) and any(
        os.path.realpath(d) == m or os.path.realpath(d).startswith(m + "/") for m in _PRIVATE_MOUNTS)]


_NS_FLAGS = ["--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and switches of one sandboxed run (see the module docstring for what each layer does)."""

    timeout_s: float = 5.0          # wall clock for the untrusted part, from the child's "ready"
    startup_timeout_s: float = 20.0  # interpreter start + jail set-up
    memory_mb: int = 1024           # RLIMIT_AS per process
    max_procs: int = 8              # RLIMIT_NPROC - 2 (processes/threads of the sandbox uid; +2: the harness threads)
    file_mb: int = 10               # RLIMIT_FSIZE: largest file, stdout/stderr included
    tmpfs_mb: int = 64              # size of each private tmpfs (namespaced runs)
    max_output_bytes: int = 8192    # stdout/stderr bytes read back into the result
    use_namespaces: bool = True     # unshare net/pid/mount/ipc when permitted
    drop_privileges: bool = True    # as root: run as an unprivileged per-slot uid
    python_guard: bool = True       # audit-hook policy inside the child
    allow_site_packages: bool = False  # let programs import installed packages: no `-S` (numpy needs
    #                                    ctypes, so also python_guard=False; the OS layers still hold)
    uid_base: int = 61000           # per-slot uids uid_base .. uid_base + 255 (must not be real users)


@dataclass
class CodeProgram:
    """What runs in the sandbox: solution and setup once (in that order), then each test separately."""

    solution: str
    tests: list[str]
    setup: str = ""


@dataclass
class CodeResult:
    """Outcome of one program. ``reason`` is None when passed."""

    pass_fraction: float
    passed: bool
    reason: str | None
    n_tests: int
    n_passed: int
    duration_s: float = 0.0
    test_errors: list[str | None] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    layers: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------ programs

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a model response: a fenced block if there is one (see the module docstring), else the text."""
    for tok in _END_TOKENS:
        cut = text.find(tok)
        if cut >= 0:
            text = text[:cut]
    if "```" not in text:
        return text
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(text)]
    if not blocks:
        return text
    python = [b for lang, b in blocks if lang in ("python", "py", "python3", "")] or [b for _, b in blocks]
    if entry_point:
        defining = [b for b in python if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)]
        if defining:
            return defining[-1]
    defining = [b for b in python if re.search(r"^\s*(def|class)\s", b, re.M)]
    return (defining or python)[-1]


def build_program(completion: str, example: Example, extract: bool = True) -> CodeProgram:
    """The program that checks a completion of a code example (HumanEval or MBPP-style)."""
    if example.kind != "code":
        raise ValueError(f"example {example.id!r} is a {example.kind!r} example, not code")
    ep = example.entry_point
    code = extract_code(completion, ep or None) if extract else completion
    if ep and example.test:
        if example.source != "humaneval":  # a plain row's prompt is prose, not a stub to complete
            solution = code
        elif re.search(rf"^def\s+{re.escape(ep)}\s*\(", code, re.M):
            solution = example.prompt + "\n" + code
        else:
            solution = example.prompt + code
        return CodeProgram(solution, [f"{example.test}\n\ncheck({ep})\n"])
    if example.test_list:
        return CodeProgram(code, list(example.test_list), example.test_setup_code)
    raise ValueError(f"code example {example.id!r} has no tests (neither test/entry_point nor test_list)")


# ------------------------------------------------------------------------------------------ capabilities

_CAPS: dict | None = None
_CAPS_LOCK = threading.Lock()


def _probe(argv: list[str]) -> bool:
    try:
        r = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def sandbox_capabilities() -> dict:
    """What this machine allows, probed once: ``root``; ``uid_drop`` (root that can really switch to an
    unmapped uid: not the case in rootless containers); ``unshare`` (the namespace prefix, or None);
    ``user_ns`` (the namespaces come with a user namespace, i.e. we are not root)."""
    global _CAPS
    with _CAPS_LOCK:
        if _CAPS is None:
            root = os.geteuid() == 0
            uid = SandboxConfig().uid_base - 1  # probe with an id below the slot range
            drop = root and _probe(
                [sys.executable, "-I", "-S", "-c", f"import os\nos.setgroups([])\nos.setgid({uid})\nos.setuid({uid})"]
            )
            prefix = None
            exe = shutil.which("unshare")
            if exe:
                candidate = [exe] + ([] if root else ["--map-root-user"]) + _NS_FLAGS
                if _probe(candidate + ["--", sys.executable, "-I", "-S", "-c", "pass"]):
                    prefix = candidate
            _CAPS = {"root": root, "uid_drop": drop, "unshare": prefix, "user_ns": prefix is not None and not root}
        return dict(_CAPS)


# ------------------------------------------------------------------------------------------ uid slots


class _UidSlot:
    """An unprivileged uid held exclusively (flock across processes) for the length of one run."""

    def __init__(self, base: int) -> None:
        lock_dir = Path("/run/lightningrl_fast-sandbox")
        try:
            lock_dir.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            lock_dir = Path(tempfile.gettempdir()) / "lightningrl_fast-sandbox-uids"
            lock_dir.mkdir(mode=0o700, exist_ok=True)
        deadline = time.monotonic() + 60
        while True:
            for uid in range(base, base + 256):
                try:
                    pwd.getpwuid(uid)
                    continue  # a real account: never borrow it
                except KeyError:
                    pass
                fd = os.open(lock_dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self.uid, self.fd = uid, fd
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no free sandbox uid in {base}..{base + 255}")
            time.sleep(0.05)

    def release(self) -> None:
        os.close(self.fd)  # closing drops the flock


def _pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes owned by uid."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                pids.append(int(name))
    return pids


_KILL = shutil.which("kill", path="/usr/bin:/bin")


def _sweep_uid(uid: int) -> None:
    """Kill every process of the sandbox uid. ``kill -9 -1`` run *as that uid* reaches them all at once
    (a fork bomb cannot outrun it); per-pid kills as root are the fallback. Never raises."""
    for _ in range(50):
        pids = _pids_of_uid(uid)
        if not pids:
            return
        try:
            if _KILL is None:
                raise OSError("no kill binary")
            subprocess.run(
                [_KILL, "-9", "-1"], user=uid, group=uid, extra_groups=[], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, cwd="/",
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------ running


def _reason_of(err: str) -> str:
    if err in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax"
    if err == "AssertionError":
        return "assertion"
    if err == "MemoryError":
        return "memory"
    if err == "OutputLimit":
        return "output_limit"
    return f"error:{err}"


def _read_capped(path: Path, cap: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", "replace")
    except OSError:
        return ""


def _rmtree(path: str) -> None:
    def onerror(func, p, exc):
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=onerror)
    else:
        shutil.rmtree(path, onerror=onerror)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


# what util-linux unshare prints when its child (the harness) was SIGKILLed by `_kill_run`
_UNSHARE_NOISE = "unshare: sigprocmask unblock failed: Invalid argument\n"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    """Direct children of pid (``/proc/<pid>/task/<pid>/children``, else a scan of ``/proc``)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        pass
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        kids.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _kill_run(proc: subprocess.Popen, namespaced: bool) -> None:
    """SIGKILL everything of a run. Namespaced: the harness (init of the PID namespace, a child of
    ``unshare``) first, so the namespace dies with it and ``unshare`` reaps it before exiting. Killing the
    group at once would orphan the harness: it would then linger as a zombie of the sandbox uid until the
    machine's init reaps it, and those zombies count against RLIMIT_NPROC of the next runs on that uid."""
    if namespaced and proc.poll() is None:
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)


def run_program(program: CodeProgram, config: SandboxConfig | None = None) -> CodeResult:
    """Run one program in the sandbox and score it (never raises for anything the program does)."""
    cfg = config or SandboxConfig()
    caps = sandbox_capabilities()
    t0 = time.monotonic()
    n_tests = len(program.tests)
    layers = ["rlimits", "session", "clean_env"]
    prefix = caps["unshare"] if cfg.use_namespaces else None
    if prefix and cfg.allow_site_packages:
        hidden = hidden_site_dirs()
        if hidden:
            raise ValueError(
                f"SandboxConfig(allow_site_packages=True): this interpreter's site-packages {hidden[0]} lies under "
                f"{', '.join(_PRIVATE_MOUNTS)}, which the sandbox covers with a private tmpfs, so programs could not "
                "import from it; use an environment installed elsewhere, or use_namespaces=False")
    slot: _UidSlot | None = None
    tmp: str | None = None
    proc = None
    r_fd = w_fd = -1
    try:
        if caps["uid_drop"] and cfg.drop_privileges:
            slot = _UidSlot(cfg.uid_base)
        tmp = tempfile.mkdtemp(prefix="lrl-sandbox-")
        os.chmod(tmp, 0o711)
        work = os.path.join(tmp, "work")
        os.mkdir(work, 0o700)
        if slot is not None:
            os.chown(work, slot.uid, slot.uid)
            layers.append(f"uid:{slot.uid}")
        if prefix:
            layers.append("namespaces")
        if cfg.python_guard:
            layers.append("python_guard")
        nonce = secrets.token_hex(16)
        job = {
            "nonce": nonce, "setup": program.setup, "solution": program.solution, "tests": list(program.tests),
            "uid": slot.uid if slot else None, "private_tmp": bool(prefix), "private_mounts": _PRIVATE_MOUNTS,
            "own_user_ns": caps["user_ns"] and bool(prefix),
            "tmpfs_mb": cfg.tmpfs_mb, "memory_mb": cfg.memory_mb, "cpu_s": int(math.ceil(cfg.timeout_s)) + 1,
            "file_mb": cfg.file_mb, "max_procs": cfg.max_procs, "python_guard": cfg.python_guard,
        }
        job_path = os.path.join(tmp, "job.json")
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(job).encode("utf-8"))
        out_path, err_path = Path(tmp, "stdout"), Path(tmp, "stderr")
        r_fd, w_fd = os.pipe()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work,
               "TMPDIR": work, "OMP_NUM_THREADS": "1"}
        if os.environ.get("LD_LIBRARY_PATH"):  # some interpreters (conda, relocated builds) need it to start
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        flags = ["-I"] if cfg.allow_site_packages else ["-I", "-S"]
        argv = (prefix + ["--"] if prefix else []) + [sys.executable, *flags, _HARNESS, job_path, str(w_fd)]
        private = lambda p, flags: os.open(p, flags | os.O_CREAT | os.O_EXCL, 0o600)  # noqa: E731
        with open(out_path, "wb", opener=private) as out_f, open(err_path, "wb", opener=private) as err_f:
            proc = subprocess.Popen(
                argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                pass_fds=(w_fd,), start_new_session=True, close_fds=True,
            )
        os.close(w_fd)
        w_fd = -1

        # Read the result stream until "D", EOF or the deadline (startup allowance until "R"). When the
        # direct child has exited, a descendant may still hold the pipe: give it 0.2 s, then stop.
        tag = nonce.encode() + b" "
        buf, kept = b"", 0
        records: list[list[str]] = []
        deadline = time.monotonic() + cfg.startup_timeout_s
        exit_grace: float | None = None
        timed_out = done = ready_seen = False
        while not done:
            now = time.monotonic()
            if exit_grace is None and proc.poll() is not None:
                exit_grace = now + 0.2
            limit = deadline if exit_grace is None else min(deadline, exit_grace)
            if now >= limit:
                timed_out = now >= deadline
                break
            ready, _, _ = select.select([r_fd], [], [], min(limit - now, 0.1))
            if not ready:
                continue
            chunk = os.read(r_fd, 65536)
            if not chunk:
                break  # EOF: every writer is gone
            if kept > 1 << 20:  # a flood on the result pipe: drain it, keep nothing more
                continue
            kept += len(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(tag):
                    rec = line[len(tag):].decode("ascii", "replace").split(" ")
                elif line.startswith(b"V "):  # a guard violation: unauthenticated, it can only fail the run
                    rec = line.decode("ascii", "replace").split(" ")
                else:
                    continue
                records.append(rec)
                if rec[0] == "R" and not ready_seen:
                    ready_seen = True
                    deadline = time.monotonic() + cfg.timeout_s
                elif rec[0] in ("D", "E", "V"):
                    done = True
        if not done and not timed_out:  # EOF: the child is exiting; collect its own status (a signal?)
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        own_exit = proc.poll()  # the child's own status, before our kill below can stamp SIGKILL on it
        _kill_run(proc, bool(prefix))
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if slot is not None:
            _sweep_uid(slot.uid)  # an escaped daemon (no PID namespace), or a namespace still tearing down

        passed_tests: dict[int, bool] = {}
        errors: list[str | None] = [None] * n_tests
        stage_err = setup_err = violation = None
        got_done = False
        for rec in records:
            if rec[0] == "T" and len(rec) >= 4 and rec[1].isdigit() and int(rec[1]) < n_tests:
                i = int(rec[1])
                if i not in passed_tests:
                    passed_tests[i] = rec[2] == "1"
                    errors[i] = None if rec[2] == "1" else _reason_of(rec[3])
            elif rec[0] == "S" and len(rec) >= 2:
                stage_err = _reason_of(rec[1])
            elif rec[0] == "E":
                setup_err = " ".join(rec[1:])
            elif rec[0] == "V" and violation is None:
                violation = " ".join(rec[1:])
            elif rec[0] == "D":
                got_done = True
        n_passed = sum(passed_tests.values())
        if setup_err is not None or not ready_seen:  # the jail never came up: nothing untrusted ran
            reason, n_passed = "sandbox_error", 0
        elif violation is not None:
            reason, n_passed = "forbidden", 0
        elif stage_err is not None:
            reason, n_passed = stage_err, 0
        elif timed_out:
            reason = "timeout"
        elif not got_done and own_exit == _CPU_LIMIT_EXIT:
            reason = "timeout"  # the CPU-seconds limit (the harness's SIGXCPU handler)
        elif not got_done and own_exit is not None and own_exit < 0:
            reason = "timeout" if -own_exit == signal.SIGXCPU else f"killed:{_signal_name(-own_exit)}"
        elif not got_done:
            reason = "no_result"
        elif n_passed < n_tests:
            reason = next(e for e in errors if e is not None) if any(errors) else "no_result"
        elif n_tests == 0:
            reason = "no_tests"  # it ran, but nothing checked it: never a pass
        else:
            reason = None
        passed = reason is None and n_tests > 0
        frac = n_passed / n_tests if n_tests else 0.0
        return CodeResult(
            pass_fraction=frac, passed=passed, reason=reason, n_tests=n_tests, n_passed=n_passed,
            duration_s=time.monotonic() - t0, test_errors=errors,
            stdout=_read_capped(out_path, cfg.max_output_bytes),
            stderr=_read_capped(err_path, cfg.max_output_bytes).replace(_UNSHARE_NOISE, "")
            + (f"\n[sandbox] {setup_err}" if setup_err else ""),
            layers=tuple(layers),
        )
    finally:
        try:
            if proc is not None and proc.poll() is None:
                _kill_run(proc, bool(prefix))
                proc.wait(timeout=10)
        except (OSError, subprocess.SubprocessError):
            pass
        for fd in (r_fd, w_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            if slot is not None:
                _sweep_uid(slot.uid)
        finally:
            if slot is not None:
                slot.release()
            if tmp is not None:
                _rmtree(tmp)


def verify_code(completion: str, example: Example, config: SandboxConfig | None = None) -> CodeResult:
    """Build the program for a completion of ``example`` and run it (ValueError for a non-code example)."""
    return run_program(build_program(completion, example), config)


def verify_code_batch(
    items: Iterable[tuple[str, Example] | CodeProgram],
    workers: int | None = None,
    config: SandboxConfig | None = None,
) -> list[CodeResult]:
    """Run many (completion, example) pairs or `CodeProgram`s, ``workers`` subprocesses at a time; results in order."""
    items = list(items)
    workers = max(1, workers or os.cpu_count() or 1)

    def one(item) -> CodeResult:
        if isinstance(item, CodeProgram):
            return run_program(item, config)
        completion, example = item
        return verify_code(completion, example, config)

    if workers == 1 or len(items) <= 1:
        return [one(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(one, items))

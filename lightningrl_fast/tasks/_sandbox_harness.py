"""Child side of the code sandbox: set up the jail, run untrusted code, report per-test results.

Started by `lightningrl_fast.tasks.code` as ``python -I -S _sandbox_harness.py JOB_FILE RESULT_FD`` (inside
``unshare`` namespaces when the machine allows them). Standard library only; it imports nothing from the
package but its sibling `_sandbox_checks` (the result checks, loaded by path at start: ``-I`` keeps this
directory off ``sys.path``). Order matters — everything privileged happens before the first line of untrusted code:

1. read the job (JSON) and delete its file;
2. private mounts (only when the parent put us in a fresh mount namespace): size-capped tmpfs over the
   folders the job names (``/tmp``, ``/var/tmp``, ``/dev/shm``: code.py's _PRIVATE_MOUNTS), the working
   directory inside the new ``/tmp``;
3. resource limits (address space, CPU seconds, file size, processes, open files, no core dumps),
   soft == hard so they cannot be raised again;
4. ``PR_SET_NO_NEW_PRIVS`` and, when started as root, a drop to the job's unprivileged uid/gid (the
   stdlib is then imported through ``/proc/self/fd/N``, a directory descriptor opened before the drop,
   because the interpreter may live under a directory that uid cannot traverse, e.g. ``/root``);
5. close every inherited descriptor except stdin/stdout/stderr and the result pipe;
6. hand-over to a supervisor thread (`_supervise`); the main thread then only waits (`_idle`). The
   supervisor installs the audit hook (PEP 578, cannot be removed): an always-on integrity part that keeps
   the program away from the supervisor's frames and memory, and the optional Python guard refusing
   writes and renames outside the working directory, ``kill`` of other processes,
   ``fork``/``exec``/``subprocess``, sockets, ``ctypes`` and frame introspection; a forbidden event ends
   the process at once (no ``except`` can retry it) — defense in depth on top of the OS layers;
7. solution + setup, then each test, each on a fresh worker thread whose stack holds no frame of the
   harness; a test counts as passed only if ``exec`` returned normally (a lock released by the C-level
   chain right after it) and no thread of the program is left when it ends. Each test sees pristine builtins
   and the stdlib modules' top-level attributes (and their ``sys.modules`` entries) as they were before the
   program ran, and the program's objects only through the result checks of `_sandbox_checks` (the sibling
   module, loaded by path at start: PLAIN values from the program's callables, attribute loads of program
   objects checked the same way, no program thread alive while a check is made or a test runs). One record
   per test is streamed.

Records on the result pipe are ``<nonce> <TAG> ...`` lines: ``R n`` (ready, n tests), ``S err``
(setup/solution failed), ``T i ok err``, ``D`` (done), ``E msg`` (sandbox set-up error); ``V event``
(guard violation) is written without the nonce (it can only fail the run). The nonce and everything the
supervisor uses live only in its own frame, bound before any untrusted code; see `_supervise` for why the
program cannot reach them (as long as it cannot read this process's memory: with ``python_guard=False``,
``ctypes`` is allowed and such a program could). Consequences for programs: ``signal.signal`` fails (not
the main thread), ``sys._getframe`` / traceback frames are refused under the guard (the stdlib users,
``namedtuple``, ``typing``, ``enum``, fall back), names of the solution that shadow builtins are not
visible to a test that also calls another function of the program (one that calls only the builtin-named
function, MBPP's ``def sum(a, b)``, sees it), the tests see the program's classes as wrapped callables
(``isinstance(x, Cls)`` with a class of the solution fails in a test), a value a test gets from the program
must be plain, and a thread the program starts must have ended when the call (or the solution) that started
it returns (`_sandbox_checks` has the rules).

Still open (in-process checks cannot close these): program code that runs outside a checked call while a
test runs (a weakref callback or finalizer fired when the test drops the last reference to an object, a
program class the test obtains with the builtin ``type()`` and calls directly, stdlib helpers such as
``operator.methodcaller`` that read attributes of a program object without the test's rewritten lookup),
which may change a checked value or start a thread that ends before the test does; non-callable globals of
the program used directly by a test (handed over as they are; in practice setup-code data such as a tree
``root``, whose attributes and methods are checked); a program that is handed a wrapped callable by the
test can read the checker's defaults, ``held`` included; when the harness runs as root of its own user
namespace (non-root caller, no uid drop) a program thread could ``chroot`` to fake ``/proc/self/task`` while
also hiding from ``_thread._count()`` (running in a finalizer after its thread function returned); and,
with ``python_guard=False``, frame introspection on the worker threads and ``ctypes`` (a program reading or
writing its own memory can do anything).
"""

import _thread
import builtins
import collections
import functools
import gc
import itertools
import json
import os
import resource
import signal
import sys
import time
import types

_write = os.write
_exit = os._exit
# Modules whose top-level attributes are put back before every test (a program patching ``math.isclose``
# must not change what the tests compute); imported before any untrusted code so the snapshot is clean.
_RESTORED_MODULES = ("math", "cmath", "re", "string", "random", "collections", "itertools", "functools",
                     "heapq", "bisect", "operator", "numbers", "decimal", "fractions")
# Frame-reaching reads (audited as ``object.__getattr__``); see `_make_integrity_hook`.
_FRAME_ATTRS = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_code", "f_locals",
                          "f_globals", "f_builtins"))


def _load_checks():
    """The sibling module `_sandbox_checks` (result checks), loaded by path: ``python -I`` keeps this
    directory off ``sys.path``, and it must be read now, before the privilege drop (the sandbox uid may not
    be able to read the package) and before any untrusted code. Not put in ``sys.modules``."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_checks.py")
    mod = types.ModuleType("_sandbox_checks")
    mod.__file__ = path
    with open(path, "rb") as f:
        exec(compile(f.read(), path, "exec", dont_inherit=True), mod.__dict__)
    return mod


_checks = _load_checks()


def _clean(name):
    return "".join(c for c in str(name) if c.isalnum() or c == "_")[:64] or "Error"


def _describe(where, e):
    """Best-effort one-line note on stderr (bounded; never fails)."""
    try:
        msg = "%s: %s: %s" % (where, type(e).__name__, str(e)[:500])
        _write(2, (msg + "\n").encode("utf-8", "replace"))
    except BaseException:
        pass


def _mount_tmpfs(libc, target, size_mb):
    MS_NOSUID, MS_NODEV = 2, 4
    if not os.path.isdir(target):
        return True
    opts = ("size=%dm,mode=1777" % size_mb).encode()
    return libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0


def _count_own_processes(uid):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat("/proc/" + name).st_uid == uid
            except OSError:
                pass
    return n


def _make_hook(workdir, guard, trusted, result_fd, protected=()):
    """The audit hook (PEP 578, cannot be removed), installed by the supervisor thread before any untrusted
    code runs. It closes over nothing secret (a violation is reported on the result pipe *without* the
    nonce: a forged violation can only fail the program that forges it).

    Integrity part (always on, ``guard`` or not): nothing may reach the supervisor's frames or objects,
    where the nonce lives: no ``gc`` object walks, ``sys._current_frames``, new audit hooks, trace/profile
    functions or ``sys.monitoring``, no frame introspection at all on the trusted threads (``trusted``: the
    main and supervisor threads, where a finalizer of the program could run), and no reading of this
    process's memory through ``/proc/<pid>/...`` (nor opening foreign directories or ``..`` paths, which
    would let a ``dir_fd`` relative open dodge the path check), and no attribute change of the result
    checker's functions and class (``protected``: ids of objects the supervisor keeps alive; a swapped
    ``__code__`` or ``__kwdefaults__`` would turn the check off). These raise (the operation does not happen).

    Guard part (``guard=True``): writes and renames outside the working directory, ``kill`` of other
    processes, ``fork``/``exec``/``subprocess``, sockets other than AF_UNIX, ``ctypes`` end the process at
    once (``violation``: no ``except`` can retry it); frame introspection (``sys._getframe``, traceback /
    generator frames, ``f_code``) is refused in every thread, so a solution cannot read the expected values
    out of the test that calls it."""
    work = os.path.realpath(workdir)
    allowed_dev = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdout", "/dev/stderr")
    me = os.getpid()
    realpath, fspath, isabs, join, isdir = os.path.realpath, os.fspath, os.path.isabs, os.path.join, os.path.isdir
    getcwd, get_ident, write, exit_ = os.getcwd, _thread.get_ident, os.write, os._exit
    trusted = frozenset(trusted)
    protected = frozenset(protected)
    id_ = id
    frame_attrs = _FRAME_ATTRS
    proc_self = ("self", "thread-self")

    def violation(what):
        try:
            write(2, ("sandbox guard: %s is not allowed\n" % what).encode("ascii", "replace"))
            write(result_fd, ("V %s\n" % _clean(what.split(" ")[0])).encode("ascii", "replace"))
        except BaseException:
            pass
        exit_(4)

    def deny(what, exc=PermissionError):
        if guard:
            violation(what)
        raise exc("sandbox: %s is not allowed" % what)

    def resolve(p):
        """(absolute real path, relative path with '..') of an open/path argument; None for an fd."""
        if isinstance(p, int):
            return None, False
        p = fspath(p)
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        dotdot = False
        if not isabs(p):
            dotdot = ".." in p.split("/")
            p = join(getcwd(), p)
        return p, dotdot

    def inside(p):
        try:
            p, dotdot = resolve(p)
        except Exception:
            return False
        if p is None:
            return True  # an already-open descriptor
        if p in allowed_dev:
            return True
        p = realpath(p)
        return not dotdot and (p == work or p.startswith(work + "/"))

    def readable(p):
        """False for this process's memory (``/proc/<pid>/...``), raw memory devices, a directory outside
        the working directory (a ``dir_fd`` for relative opens the hook cannot see) and relative ``..``
        paths (relative to such a descriptor they would not mean what they seem to)."""
        try:
            p, dotdot = resolve(p)
        except Exception:
            return False
        if p is None:
            return True
        if dotdot:
            return False
        r = realpath(p)
        if r.startswith("/proc/"):
            part = r.split("/")[2]
            if part.isdigit() or part in proc_self:
                return False
        if r in ("/dev/mem", "/dev/kmem", "/dev/port"):
            return False
        if r != work and not r.startswith(work + "/") and isdir(r):
            return False
        return True

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {
        "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
        "os.truncate": (0,), "os.utime": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,),
        "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,),
    }
    denied = {
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
        "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.__new__",
        "os.kill", "os.killpg", "signal.pthread_kill",
    }
    integrity = {
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
        "sys._current_exceptions", "sys.addaudithook", "sys.settrace", "sys.setprofile",
        "sys._settraceallthreads", "sys._setprofileallthreads",
    }

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if not readable(path):
                deny("open of %r" % (path,))
            if guard:
                writing = (mode is not None and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and flags & write_flags
                )
                if writing and not inside(path):
                    violation("open-for-writing outside the working directory")
        elif event in integrity or event.startswith("sys.monitoring"):
            deny(event)
        elif event == "object.__setattr__" or event == "object.__delattr__":
            if id_(args[0]) in protected:
                deny("changing the result checker")
        elif event == "sys._getframe":
            if guard or get_ident() in trusted:
                raise ValueError("sandbox: frame introspection is not allowed")
        elif event == "object.__getattr__":
            if get_ident() in trusted or (guard and args[1] in frame_attrs):
                raise RuntimeError("sandbox: frame introspection is not allowed")
        elif not guard:
            return
        elif event in path_events:
            for i in path_events[event]:
                if i < len(args) and not inside(args[i]):
                    violation(event + " outside the working directory")
        elif event in denied:
            if event == "os.kill" and args[0] == me:
                return
            if event == "socket.__new__" and args[1] == 1:  # AF_UNIX stays allowed
                return
            violation(event)

    return hook


def main():
    job_path, result_fd = sys.argv[1], int(sys.argv[2])
    with open(job_path, "rb") as f:
        job = json.loads(f.read().decode("utf-8"))
    try:
        os.unlink(job_path)
    except OSError:
        pass
    nonce = job["nonce"].encode()

    def emit(*parts):
        line = nonce + b" " + " ".join(str(p) for p in parts).encode("ascii", "replace") + b"\n"
        try:
            _write(result_fd, line)
        except OSError:
            pass

    try:
        uid = job.get("uid")
        workdir = os.getcwd()
        if job.get("private_tmp"):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            ok = all(_mount_tmpfs(libc, t, job["tmpfs_mb"]) for t in job["private_mounts"])
            if not ok:
                raise OSError(ctypes.get_errno(), "mounting a private tmpfs failed")
            workdir = "/tmp/work"
            os.mkdir(workdir, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
            os.chdir(workdir)
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir

        mb = 1024 * 1024
        nproc = job["max_procs"] + 2  # + the harness's own supervisor and worker threads (NPROC counts tasks)
        if uid is None and not job.get("own_user_ns"):
            nproc += _count_own_processes(os.getuid())
        limits = [
            (resource.RLIMIT_AS, job["memory_mb"] * mb),
            (resource.RLIMIT_CPU, job["cpu_s"]),
            (resource.RLIMIT_FSIZE, job["file_mb"] * mb),
            (resource.RLIMIT_NPROC, nproc),
            (resource.RLIMIT_NOFILE, 256),
            (resource.RLIMIT_CORE, 0),
        ]
        for which, value in limits:
            soft, hard = resource.getrlimit(which)
            # CPU seconds: SIGXCPU at the limit (`_on_cpu_limit` ends the run as a timeout), SIGKILL one second on
            top = value + 1 if which == resource.RLIMIT_CPU else value
            if hard != resource.RLIM_INFINITY:
                value, top = min(value, hard), min(top, hard)
            resource.setrlimit(which, (value, top))
        # The main thread runs the handler (the program's threads cannot replace it: signal.signal works on the
        # main thread only). As init of a PID namespace this process would ignore a SIGXCPU without one.
        signal.signal(signal.SIGXCPU, _on_cpu_limit)

        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot elevate
        for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
            del sys.modules[name]  # a later `import ctypes` goes through the guard again
        del ctypes

        keep_fds = {0, 1, 2, result_fd}
        if uid is not None:
            # The interpreter may live where the sandbox uid cannot traverse (e.g. /root/.pyenv): keep a
            # directory descriptor on the stdlib's parent and import through /proc/self/fd/N instead.
            lib = os.path.dirname(os.path.dirname(os.__file__))
            lib_fd = os.open(lib, os.O_RDONLY | os.O_DIRECTORY)
            keep_fds.add(lib_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
                raise OSError("privilege drop failed")
            libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/fd stays owned by us after setuid
            via = "/proc/self/fd/%d" % lib_fd

            def remap(paths):
                paths[:] = [via + p[len(lib):] if p == lib or p.startswith(lib + "/") else p for p in paths]

            remap(sys.path)
            for mod in list(sys.modules.values()):
                pkg_path = getattr(mod, "__path__", None)
                if isinstance(pkg_path, list):
                    remap(pkg_path)
            sys.path_importer_cache.clear()
        del libc

        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        keep = sorted(keep_fds)
        for lo, hi in zip(keep, keep[1:] + [65536]):
            os.closerange(lo + 1, hi)
        sys.dont_write_bytecode = True
        # ``threading`` too: imported first on a worker thread (``import queue`` does it), its ``_MainThread``
        # would take that worker's join sentinel (``_thread._set_sentinel``) and the stage would never end
        for name in _RESTORED_MODULES + ("typing", "threading"):
            __import__(name)
        return (nonce, result_fd, job["setup"], job["solution"], job["tests"], workdir,
                bool(job.get("python_guard")), _thread.get_ident())
    except BaseException as e:  # the jail is incomplete: run nothing
        msg = "".join(c if " " <= c <= "~" else "?" for c in str(e)[:300])
        emit("E", _clean(type(e).__name__), msg)
        _exit(3)


def _make_unraisable_hook(reasons):
    """sys.unraisablehook for the worker threads: note the name of the exception that ended the stage (read
    by the supervisor for the failure reason only: a pass never depends on it) and a line on stderr."""
    type_name = type.__dict__["__name__"].__get__
    errno_of = OSError.__dict__["errno"].__get__

    def hook(u):
        try:
            cls = u.exc_type
            name = _clean(type_name(cls))
            if issubclass(cls, OSError) and errno_of(u.exc_value) == 27:  # EFBIG: RLIMIT_FSIZE hit
                name = "OutputLimit"
            reasons.append(name)
            _describe("stage", u.exc_value)
        except BaseException:
            pass

    return hook


def _supervise(nonce, result_fd, setup, solution, tests, workdir, guard, main_ident,
               _write=os.write, _exit=os._exit, _exec=exec, _compile=compile, _dict=dict, _list=list,
               _str=str, _type=type, _len=len, _range=range, _map=map, _starmap=itertools.starmap,
               _chain=itertools.chain, _deque=collections.deque, _partial=functools.partial,
               _lock=_thread.allocate_lock, _acquire=_thread.LockType.acquire, _start=_thread.start_new_thread,
               _sentinel=getattr(_thread, "_set_sentinel", None),
               _joinable=getattr(_thread, "start_joinable_thread", None), _sleep=time.sleep,
               _get_ident=_thread.get_ident, _sys=sys, _addaudithook=sys.addaudithook, _builtins=builtins,
               _modules=sys.modules, _module_type=types.ModuleType, _restored=_RESTORED_MODULES,
               _make_hook=_make_hook, _make_unraisable_hook=_make_unraisable_hook, _clean=_clean,
               _make_checker=_checks.make_checker, _make_thread_check=_checks.make_thread_check,
               _compile_test=_checks.compile_test, _getattr_name=_checks.GETATTR, _method=types.MethodType,
               _callable=callable, _id=id, _frozenset=frozenset, _gc_enable=gc.enable, _set=set,
               _code_type=types.CodeType, _tuple=tuple):
    """The supervisor thread: runs the solution + setup, then each test, each in a fresh worker thread, and
    reports. Why it is built like this (a program that passes nothing must not be able to report a pass):

    * untrusted code never runs on this thread's stack: a worker is started on a C-only chain
      (``deque(chain(map(exec, ...), starmap(ok.release, ...)))``), so its frames have no Python caller to
      walk up to (``f_back`` is not audited) and ``ok`` is released only when ``exec`` returned normally;
    * the nonce and the pass locks live only in this frame; the audit hook keeps other threads out of it
      (no ``gc`` walks, no ``sys._current_frames``, no introspection on this thread for a finalizer that
      happens to run here, no ``/proc/self/mem``), and this is not the main thread, so a signal handler of
      the program (only the main thread runs them) never sees it;
    * everything used here is bound as a default argument before any untrusted code: patching
      ``builtins.exec``/``str`` or this module's globals changes nothing here;
    * each test sees a fresh copy of the pristine builtins (names of the solution that shadow a builtin,
      e.g. ``def abs``, are not visible to it unless it calls no other function of the program: then the
      builtin-named function is the one under test) and the top-level attributes of common stdlib modules
      (``math.isclose``, ...) are put back before it;
    * this thread never drops the last reference to an object of the program (``keep``), so no ``__del__``
      of the program runs here by reference counting;
    * the program's callables reach the tests only wrapped by the result check (`_sandbox_checks`), built
      here before any untrusted code, as are the tests' code objects (attribute loads rewritten to the
      checked lookup); its ``held``/``alive``/``verified`` are emptied (into ``keep``) before each test, and
      ``gc`` is re-enabled;
    * no thread of the program may outlive the solution, the setup or a test (``quiet``): a test runs, and
      its checks are made, with no other thread of the program alive."""
    def names_of(code, _set=_set, _type=_type, _code_type=_code_type, _tuple=_tuple):
        """The global and attribute names a compiled test mentions, nested code objects included (runs on the
        test's code object only; a local function: the program cannot reach it to swap its code)."""
        names, stack = _set(), [code]
        while stack:
            c = stack.pop()
            names.update(_tuple(c.co_names))
            stack.extend([x for x in c.co_consts if _type(x) is _code_type])
        return names

    def emit(*parts):
        line = nonce + b" " + " ".join(_str(p) for p in parts).encode("ascii", "replace") + b"\n"
        try:
            _write(result_fd, line)
        except OSError:
            pass

    keep = []
    reasons = []
    pristine = _dict(_builtins.__dict__)
    snapshots = []
    for name in _restored:
        mod = _modules.get(name)
        if _type(mod) is _module_type:
            snapshots.append((mod.__dict__, _dict(mod.__dict__)))
    unraisable = _make_unraisable_hook(reasons)
    quiet = _make_thread_check()  # main + this thread alive now; see `_sandbox_checks` (THREADS)
    call_checked, getattr_checked, test_builtins, (held, alive, verified), protected_ids, protected = (
        _make_checker(_restored, quiet))
    keep.append(protected)
    compiled = []  # each test compiled now, attribute loads rewritten: the program cannot patch ``ast`` first
    for i in _range(_len(tests)):
        try:
            code = _compile_test(tests[i], "<test %d>" % i)
            compiled.append((code, names_of(code)))  # global names the test's code mentions
        except BaseException as e:  # a test that does not compile fails (it is counted, not run)
            keep.append(e)
            compiled.append((None, None))
    restored_mods = [(name, _modules[name]) for name in _restored if name in _modules]
    typing_mod = _modules.get("typing")
    typing_objs = _list(typing_mod.__dict__.values()) if _type(typing_mod) is _module_type else []
    keep.append(typing_objs)
    unwrapped = _frozenset(_id(v) for v in typing_objs)  # ``List``, ``Optional``...: annotations, not code
    _addaudithook(_make_hook(workdir, guard, (main_ident, _get_ident()), result_fd, protected_ids))

    def stage(code, g):
        """Run ``exec(code, g)`` on a fresh worker thread; (True, None) if it returned normally."""
        ok = _lock()
        ok.acquire()
        del reasons[:]
        _sys.unraisablehook = unraisable
        work = _chain(_map(_exec, (code,), (g,)), _starmap(ok.release, ((),)))
        keep.append((code, g, work, ok))
        try:
            if _joinable is not None:  # Python >= 3.13
                handle = _joinable(_partial(_deque, work, 0))
                keep.append(handle)
                handle.join()
            else:
                # the worker takes a sentinel lock that is released when its thread state is gone, and
                # only then shows it to us (``holder``): acquiring it again here is the join
                tmp, holder = [], []
                prologue = (_map(tmp.append, _starmap(_sentinel, ((),))), _map(_acquire, tmp),
                            _map(holder.append, tmp))
                _start(_deque, (_chain(*prologue, work), 0))
                while not holder:
                    _sleep(0.0005)
                keep.append(holder)
                holder[0].acquire()
        except BaseException as e:  # the worker could not start (process limit reached by the program)
            keep.append(e)
            return False, "ThreadLimit"
        if ok.acquire(False):
            return True, None
        return False, (reasons[0] if reasons else "SystemExit")  # SystemExit ends a thread silently

    emit("R", _len(tests))
    g = {"__name__": "__sandbox__", "__builtins__": _builtins}
    keep.append(g)
    try:
        # the solution, then the row's setup: MBPP's setup code builds its fixtures from classes the solution
        # defines (``root = Node(1)``); a setup of imports only is indifferent to the order
        done, err = stage(_compile(solution, "<solution>", "exec"), g)
        if done and not quiet(0):  # a thread of the program would race the checks of the tests
            done, err = False, "ProgramThreadAlive"
        if done and setup:
            done, err = stage(_compile(setup, "<setup>", "exec"), g)
            if done and not quiet(0):
                done, err = False, "ProgramThreadAlive"
    except BaseException as e:  # compile(): a syntax error
        keep.append(e)
        done, err = False, _clean(_type(e).__name__)
    if not done:
        emit("S", err)
        emit("D")
        _exit(0)
    for i in _range(_len(tests)):
        ok, err = False, "Error"
        code, used = compiled[i]
        if code is None:
            emit("T", i, 0, err)
            continue
        if not quiet(0):  # a thread of the program, left by the previous test, is still running
            emit("T", i, 0, "ProgramThreadAlive")
            continue
        try:
            for live, saved in snapshots:
                new = {}
                for k, v in live.items():
                    if _type(k) is _str and k not in saved and _type(v) is _module_type:
                        new[k] = v  # a submodule imported since (``import xml.dom`` sets ``xml.dom``)
                keep.append(_dict(live))
                live.clear()
                live.update(saved)
                live.update(new)
            for name, mod in restored_mods:
                keep.append(_modules.get(name))  # a module object of the program must not die here
                _modules[name] = mod
            keep.append(held[:])
            keep.append(alive[:])
            keep.append(verified.copy())
            del held[:]
            del alive[:]
            verified.clear()
            _gc_enable()
            tb = _dict(pristine)
            tb.update(test_builtins)  # getattr / hasattr: checked for program objects
            tg = {"__builtins__": tb, _getattr_name: getattr_checked}
            own_used = False  # does the test call a callable of the program under a non-builtin name?
            for k, v in _list(g.items()):
                if _type(k) is _str and k != "__builtins__" and k not in pristine:
                    if _callable(v) and _type(v) is not _module_type and _id(v) not in unwrapped:
                        v = _method(call_checked, v)
                        own_used = own_used or k in used
                    tg[k] = v
                elif _type(k) is _str and k != "__builtins__" and v is pristine[k]:
                    tg[k] = v
            if not own_used:
                # a function of the solution named like a builtin (MBPP's ``def sum(a, b)``) is the function
                # under test when the test calls no other function of the program: then it is visible (result
                # checked). Otherwise it stays hidden: ``def abs(x): return 0`` must not decide
                # ``assert abs(add(1, 2) - 3) < 1e-9``.
                for k, v in _list(g.items()):
                    if (_type(k) is _str and k != "__builtins__" and k in pristine and v is not pristine[k]
                            and k in used and _callable(v) and _type(v) is not _module_type):
                        tg[k] = _method(call_checked, v)
            ok, err = stage(code, tg)
            if ok and not quiet(0):  # started by program code outside a checked call (a finalizer...)
                ok, err = False, "ProgramThreadAlive"
        except BaseException as e:
            keep.append(e)
        emit("T", i, 1 if ok else 0, "-" if ok else err)
    emit("D")
    _exit(0)


# The exit status of a run stopped by its CPU-seconds limit (code.py reads it as a timeout, as it reads
# SIGXCPU where no handler is installed).
CPU_LIMIT_EXIT = 124


def _on_cpu_limit(signum, frame, _exit=os._exit):
    """SIGXCPU: the program used up its CPU seconds (threads that release the GIL get there before the
    wall-clock deadline). End the run now; the tests already reported keep their records."""
    _exit(CPU_LIMIT_EXIT)


def _idle(_lock=_thread.allocate_lock, _exit=os._exit):
    """The main thread after the hand-over: it holds nothing and waits. A signal sent by the program (say
    SIGINT from ``os.kill(os.getpid(), ...)``) interrupts the wait: the run ends there, without a result. The wait
    wakes every 20 ms: Python runs a signal's handler on this thread only, and a signal the kernel sends to the
    process (SIGXCPU at the CPU-seconds limit) may land on a program thread, which does not interrupt a plain
    wait here; the handler would not run before the hard limit's SIGKILL."""
    try:
        lock = _lock()
        lock.acquire()
        while not lock.acquire(timeout=0.02):
            pass
    except BaseException:
        pass
    _exit(5)


if __name__ == "__main__":
    _thread.start_new_thread(_supervise, main())
    _idle()

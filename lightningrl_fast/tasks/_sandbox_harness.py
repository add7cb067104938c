"""Child side of the code sandbox: set up the jail, run untrusted code, report per-test results.

Started by `lightningrl_fast.tasks.code` as ``python -I -S _sandbox_harness.py JOB_FILE RESULT_FD`` (inside
``unshare`` namespaces when the machine allows them). Standard library only; it imports nothing from the
package. Order matters — everything privileged happens before the first line of untrusted code:

1. read the job (JSON) and delete its file;
2. private mounts (only when the parent put us in a fresh mount namespace): size-capped tmpfs over
   ``/tmp``, ``/var/tmp`` and ``/dev/shm``, the working directory inside the new ``/tmp``;
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
   chain right after it). Each test sees pristine builtins and the stdlib modules' top-level attributes
   (and their ``sys.modules`` entries) as they were before the program ran, and the program's callables
   only through the result check below. One record per test is streamed.

Result check (the "AlwaysEqual" reward hack: an object whose ``__eq__``/``__lt__``/``__bool__``/``__sub__``
... lies to the test's comparison). Every callable value the test namespace takes from the program's
globals (functions, lambdas, classes, bound methods, partials, callable instances; not modules, not the
``typing`` module's own objects, not a pristine builtin under its own name) is handed to the test as
``MethodType(call_checked, f)`` (`_make_checker`). A call from the test then fails with
``NonPlainResult`` (a ``BaseException``: an ``except Exception`` in a test cannot swallow it) unless:

* the result is PLAIN: every object reachable from it has an exact type (``type(o) is T``, never
  ``isinstance`` or ``o.__class__``) among ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
  ``bytes``, ``bytearray``, ``range``, ``decimal.Decimal`` (leaves), ``list``, ``tuple``, ``set``,
  ``frozenset``, ``collections.deque``, ``dict`` views, ``dict``, ``collections.Counter`` /
  ``OrderedDict`` / ``defaultdict`` (keys and values; their instance ``__dict__`` must be empty, a
  ``defaultdict``'s factory ``None`` or one of these types), ``fractions.Fraction`` (both slots exact
  ``int``), or an instance of an INERT program class: no metaclass, only classes created at run time
  above ``object``, no dunder in their dicts beyond ``__init__`` and class metadata (so no ``__eq__``,
  ``__hash__``, ``__bool__``, ``__class__``, ``__getattr__``, ``__slots__``, ``__repr__``, ``__str__``,
  ...: it compares by identity), whose instance ``__dict__`` (keys and values) is checked the same way
  (test-built arguments like MBPP's ``Pair(5, 24)`` and tree nodes stay usable). Subclasses of the value types
  (``namedtuple`` included), dataclasses, enums, exceptions and anything else are not plain. The walk is
  iterative with a visited set (cycles, depth), reads objects only through the exact types' C slots
  and descriptors bound before untrusted code, and visits at most ``_PLAIN_LIMIT`` (200 000) objects per
  value: larger, or any error, counts as not plain;
* an iterator of an allowlisted C type (generator, ``map``, ``filter``, ``zip``, ``enumerate``,
  ``reversed``, container iterators, ``itertools`` objects) is drained first (at most ``_PLAIN_LIMIT``
  items, so an endless one fails), its items checked as a list and handed on as ``iter(list)``: later
  program code cannot change an item already yielded;
* every argument that was plain before the call is still plain after it (a solution putting an
  AlwaysEqual into the test's list), and so is every value checked earlier in the same test (``held``:
  a later call cannot change what an earlier one returned); arguments are kept alive to the end of the
  test (no weakref callback of the program between the check and the comparison);
* the stdlib the tests use is untouched: the restored modules' attributes and ``sys.modules`` entries,
  and the class dicts of the allowlisted types that are mutable (``Counter``, ``Fraction`` and the
  ``numbers`` ABCs), compared by identity with a snapshot taken before the program ran;
* no automatic garbage collection (hence no finalizer of the program) runs between the check and the
  test's comparison: ``gc`` is enabled for the call and disabled right after it.

The checker's functions read only parameter defaults bound before untrusted code (no globals, no closure
cells); the integrity hook refuses changing their attributes (``__code__``, ``__kwdefaults__``).

Records on the result pipe are ``<nonce> <TAG> ...`` lines: ``R n`` (ready, n tests), ``S err``
(setup/solution failed), ``T i ok err``, ``D`` (done), ``E msg`` (sandbox set-up error); ``V event``
(guard violation) is written without the nonce (it can only fail the run). The nonce and everything the
supervisor uses live only in its own frame, bound before any untrusted code; see `_supervise` for why the
program cannot reach them (as long as it cannot read this process's memory: with ``python_guard=False``,
``ctypes`` is allowed and such a program could). Consequences for programs: ``signal.signal`` fails (not
the main thread), ``sys._getframe`` / traceback frames are refused under the guard (the stdlib users,
``namedtuple``, ``typing``, ``enum``, fall back), names of the solution that shadow builtins are not
visible to a test that also calls another function of the program (one that calls only the builtin-named
function, MBPP's ``def sum(a, b)``, sees it), the tests see the program's classes as wrapped callables (``isinstance(x, Cls)``
with a class of the solution fails in a test), and a value a test gets from a program callable must be
plain (above).

Still open (in-process checks cannot close these): a thread of the program changing a checked value, a
class of the program or a module attribute between the check and the test's comparison (or racing the
restore); methods and properties of an inert instance that a test calls or reads (not checked: an inert
class may define any non-dunder attribute); non-callable globals of the program used directly by a test
(handed over as they are; in practice setup-code data such as a tree ``root``); a program that is handed
a wrapped callable by the test can read (not change) the checker's defaults, ``held`` included; and, with
``python_guard=False``, frame introspection on the worker threads and ``ctypes`` (a program reading or
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


def _clean(name):
    return "".join(c for c in str(name) if c.isalnum() or c == "_")[:64] or "Error"


def _describe(where, e):
    """Best-effort one-line note on stderr (bounded; never fails)."""
    try:
        msg = "%s: %s: %s" % (where, type(e).__name__, str(e)[:500])
        _write(2, (msg + "\n").encode("utf-8", "replace"))
    except BaseException:
        pass


def _err_name(e):
    if isinstance(e, OSError) and getattr(e, "errno", None) == 27:  # EFBIG: RLIMIT_FSIZE hit
        return "OutputLimit"
    return _clean(type(e).__name__)


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
            ok = all(_mount_tmpfs(libc, t, job["tmpfs_mb"]) for t in ("/tmp", "/var/tmp", "/dev/shm"))
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
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(which, (value, value))

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
        for name in _RESTORED_MODULES + ("typing",):
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


# Most objects the plainness check visits in one value (result, argument or materialised iterator);
# a larger value counts as not plain. HumanEval / MBPP results are far smaller.
_PLAIN_LIMIT = 200_000
# Dunder names an "inert" program class may define (anything else, e.g. __eq__, __hash__, __bool__,
# __class__, __getattr__, __slots__, __repr__, __str__, __new__, makes its instances not plain).
_INERT_DUNDERS = frozenset(("__module__", "__qualname__", "__doc__", "__init__", "__dict__", "__weakref__",
                            "__annotations__", "__firstlineno__", "__static_attributes__"))


def _make_checker(restored, _type=type, _id=id, _frozenset=frozenset, _tuple=tuple, _dict=dict, _sys=sys):
    """Build the result check of the tests, before any untrusted code: returns ``(call_checked, (held,
    alive), protected_ids, protected)``. ``call_checked(f, *args, **kw)`` (handed to the tests as
    ``MethodType(call_checked, f)``) calls a callable of the program and returns its result only if it is
    PLAIN (rules: the module docstring); the supervisor empties ``held`` and ``alive`` before each test.
    Every function here reads only its own parameters (defaults bound now; the audit hook refuses
    ``object.__setattr__``/``__delattr__`` on the ``protected`` objects, so ``__code__``/``__defaults__``
    cannot be swapped), no globals and no closure cells, and calls no method of an object that is not of
    an exact allowlisted type."""
    import decimal
    import fractions
    import gc

    NoneType = _type(None)
    Counter, OrderedDict = collections.Counter, collections.OrderedDict
    defaultdict, deque, Fraction = collections.defaultdict, collections.deque, fractions.Fraction
    scalars = (NoneType, bool, int, float, complex, str, bytes, bytearray, range, decimal.Decimal)
    d = {}
    sequences = (list, tuple, set, frozenset, deque, _type(d.keys()), _type(d.values()), _type(d.items()))
    mappings = (dict, Counter, OrderedDict, defaultdict)
    # instance __dict__ of an allowlisted type (Counter, OrderedDict): must stay empty (an attribute there
    # would shadow a method such as ``most_common``)
    inst_dicts = _tuple((_id(t), t.__dict__["__dict__"]) for t in mappings + sequences if "__dict__" in t.__dict__)
    factories = _frozenset(_id(t) for t in scalars[1:] + sequences[:5] + mappings if t is not range)
    mro_of = type.__dict__["__mro__"].__get__
    flags_of = type.__dict__["__flags__"].__get__
    tdict_of = type.__dict__["__dict__"].__get__
    # allowlisted types whose class attributes can be changed (pure-Python classes: Counter, Fraction and
    # the numbers ABCs): snapshot of their dicts, compared after every call
    mutable = []
    for t in scalars + sequences + mappings + (Fraction,):
        for c in mro_of(t):
            if not flags_of(c) & (1 << 8) and all(c is not m for m, _ in mutable):  # Py_TPFLAGS_IMMUTABLETYPE
                mutable.append((c, _tuple(tdict_of(c).items())))
    iterators = [types.GeneratorType, map, filter, zip, enumerate, reversed, _type(iter(lambda: 0, 1))]
    for sample in ([], (), range(1), range(1 << 70), "a", "\xe9", "\U0001f600", b"", bytearray(), set(), d,
                   d.values(), d.items(), deque()):
        iterators.append(_type(iter(sample)))
    for sample in ([], d, d.values(), d.items(), deque(), range(1)):
        iterators.append(_type(reversed(sample)))
    for name in ("chain", "islice", "count", "cycle", "repeat", "accumulate", "product", "permutations",
                 "combinations", "combinations_with_replacement", "starmap", "takewhile", "dropwhile",
                 "compress", "zip_longest", "filterfalse", "pairwise", "batched", "groupby"):
        t = getattr(itertools, name, None)
        if _type(t) is type:
            iterators.append(t)
    iterators.append(_type(itertools.tee([])[0]))

    class NonPlainResult(BaseException):  # BaseException: an ``except Exception`` in a test cannot eat it
        pass

    def inert(t, _type=_type, _typetype=type, _mro=mro_of, _flags=flags_of, _tdict=tdict_of, _object=object,
              _str=str, _starts=str.startswith, _ends=str.endswith, _items=types.MappingProxyType.items,
              _ok=_INERT_DUNDERS, _getset=types.GetSetDescriptorType):
        """A class of the program whose instances compare by identity and have nothing but attributes: no
        metaclass, only heap types (classes created at run time) above ``object``, no dunder outside
        `_INERT_DUNDERS`."""
        if _type(t) is not _typetype:
            return False
        mro = _mro(t)
        if _type(mro) is not tuple or mro[-1] is not _object:
            return False
        for c in mro[:-1]:
            if _type(c) is not _typetype or not _flags(c) & (1 << 9):  # Py_TPFLAGS_HEAPTYPE
                return False
            for k, v in _items(_tdict(c)):
                if _type(k) is not _str:
                    return False
                if _starts(k, "__") and _ends(k, "__"):
                    if k not in _ok:
                        return False
                    if (k == "__dict__" or k == "__weakref__") and _type(v) is not _getset:
                        return False
        return True

    def plain(root, _type=_type, _id=_id, _set=set, _scalars=_frozenset(_id(t) for t in scalars),
              _seqs=_frozenset(_id(t) for t in sequences), _maps=_frozenset(_id(t) for t in mappings),
              _inst_dicts=inst_dicts, _dd=_id(defaultdict), _ddf=defaultdict.__dict__["default_factory"],
              _factories=factories, _frac=_id(Fraction),
              _frac_slots=(Fraction.__dict__["_numerator"], Fraction.__dict__["_denominator"]),
              _member_get=types.MemberDescriptorType.__get__, _getset_get=types.GetSetDescriptorType.__get__,
              _int=int, _dict=dict, _items=dict.items, _len=len, _inert=inert,
              _getattr=object.__getattribute__, _limit=_PLAIN_LIMIT):
        """True if every object reachable from ``root`` has an exact allowlisted type (or is an instance
        of an `inert` class, whose ``__dict__`` values are then checked the same way). Iterative (cycles
        and depth are fine), at most ``_limit`` objects; any error counts as not plain."""
        try:
            seen = _set()
            stack = [root]
            n = 0
            while stack:
                o = stack.pop()
                t = _type(o)
                ti = _id(t)
                if ti in _scalars:
                    continue
                oi = _id(o)
                if oi in seen:
                    continue
                n += 1
                if n > _limit:
                    return False
                seen.add(oi)
                if ti in _seqs:
                    stack.extend(o)
                elif ti in _maps:
                    for kv in _items(o):
                        stack.extend(kv)
                    if ti == _dd:
                        f = _member_get(_ddf, o, t)
                        if f is not None and _id(f) not in _factories:
                            return False
                elif ti == _frac:
                    for s in _frac_slots:
                        if _type(_member_get(s, o, t)) is not _int:
                            return False
                    continue
                elif _inert(t):
                    d = _getattr(o, "__dict__")
                    if _type(d) is not _dict:
                        return False
                    for kv in _items(d):  # keys too: a key of the program could answer a lookup
                        stack.extend(kv)
                    continue
                else:
                    return False
                for i, desc in _inst_dicts:
                    if i == ti:
                        d = _getset_get(desc, o, t)
                        if _type(d) is not _dict or _len(d):
                            return False
            return True
        except BaseException:
            return False

    modules = _tuple((name, _sys.modules[name]) for name in restored if name in _sys.modules)
    snaps = _tuple((live, _tuple(saved.items())) for live, saved in
                   ((m.__dict__, _dict(m.__dict__)) for _, m in modules))

    def untouched(_modules=modules, _snaps=snaps, _mutable=_tuple(mutable), _sysmods=_sys.modules,
                  _get=dict.get, _pget=types.MappingProxyType.get, _tdict=tdict_of, _len=len, _missing=object()):
        """The stdlib the tests use is as it was before the program ran: restored modules (attributes and
        ``sys.modules`` entries) and the class dicts of the mutable allowlisted types."""
        for name, m in _modules:
            if _get(_sysmods, name) is not m:
                return False
        for live, items in _snaps:
            for k, v in items:
                if _get(live, k, _missing) is not v:
                    return False
        for c, items in _mutable:
            d = _tdict(c)
            if _len(d) != _len(items):
                return False
            for k, v in items:
                if _pget(d, k, _missing) is not v:
                    return False
        return True

    held, alive = [], []

    def call_checked(__lrl_f, *args, __lrl_plain=plain, __lrl_untouched=untouched, __lrl_held=held,
                     __lrl_alive=alive, __lrl_np=NonPlainResult, __lrl_type=_type, __lrl_id=_id,
                     __lrl_iters=_frozenset(_id(t) for t in iterators), __lrl_list=list, __lrl_iter=iter,
                     __lrl_islice=itertools.islice, __lrl_limit=_PLAIN_LIMIT, __lrl_len=len,
                     __lrl_gc=(gc.enable, gc.disable), **kw):
        """Call ``f`` for a test; return its result only if PLAIN (an iterator of an allowlisted type is
        drained first, at most ``_PLAIN_LIMIT`` items, and handed on as an iterator over a checked list),
        the plain arguments are still plain, earlier checked values of this test (``held``) are still
        plain, and the stdlib is `untouched`; else raise ``NonPlainResult``."""
        enable, disable = __lrl_gc
        pre = [a for a in args if __lrl_plain(a)]
        pre += [v for v in kw.values() if __lrl_plain(v)]
        __lrl_alive.append((args, kw))  # nothing the test passed dies (weakref callbacks) before it compares
        enable()
        r = __lrl_f(*args, **kw)
        disable()  # no collection, hence no finalizer of the program, between the check and the comparison
        lazy = __lrl_id(__lrl_type(r)) in __lrl_iters
        if lazy:
            items = __lrl_list(__lrl_islice(r, __lrl_limit + 1))
            disable()
            if __lrl_len(items) > __lrl_limit:
                raise __lrl_np("an iterator of more than %d items" % __lrl_limit)
            r = items
        if not __lrl_plain(r):
            raise __lrl_np("the result is not a plain value (exact builtin/stdlib value types only)")
        for a in pre:
            if not __lrl_plain(a):
                raise __lrl_np("an argument was given a value that is not plain")
        for h in __lrl_held:
            if not __lrl_plain(h):
                raise __lrl_np("an earlier result was changed into a value that is not plain")
        if not __lrl_untouched():
            raise __lrl_np("the program changed the stdlib the tests use")
        __lrl_held.extend(pre)
        __lrl_held.append(r)
        return __lrl_iter(r) if lazy else r

    protected = (inert, plain, untouched, call_checked, NonPlainResult)
    return call_checked, (held, alive), _tuple(_id(p) for p in protected), protected


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
               _make_checker=_make_checker, _method=types.MethodType, _callable=callable, _id=id,
               _frozenset=frozenset, _gc_enable=gc.enable, _set=set, _code_type=types.CodeType, _tuple=tuple):
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
    * the program's callables reach the tests only wrapped by the result check (module docstring), built
      here before any untrusted code; its ``held``/``alive`` lists are emptied (into ``keep``) before each
      test, and ``gc`` is re-enabled."""
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
    call_checked, (held, alive), protected_ids, protected = _make_checker(_restored)
    keep.append(protected)
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
        if done and setup:
            done, err = stage(_compile(setup, "<setup>", "exec"), g)
    except BaseException as e:  # compile(): a syntax error
        keep.append(e)
        done, err = False, _clean(_type(e).__name__)
    if not done:
        emit("S", err)
        emit("D")
        _exit(0)
    for i in _range(_len(tests)):
        ok, err = False, "Error"
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
            del held[:]
            del alive[:]
            _gc_enable()
            code = _compile(tests[i], "<test %d>" % i, "exec")
            used = names_of(code)  # global and attribute names the test's code mentions
            tg = {"__builtins__": _dict(pristine)}
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
        except BaseException as e:
            keep.append(e)
        emit("T", i, 1 if ok else 0, "-" if ok else err)
    emit("D")
    _exit(0)


def _idle(_lock=_thread.allocate_lock, _exit=os._exit):
    """The main thread after the hand-over: it holds nothing and waits. A signal sent by the program (say
    SIGINT from ``os.kill(os.getpid(), ...)``) interrupts the wait: the run ends there, without a result."""
    try:
        lock = _lock()
        lock.acquire()
        lock.acquire()
    except BaseException:
        pass
    _exit(5)


if __name__ == "__main__":
    _thread.start_new_thread(_supervise, main())
    _idle()

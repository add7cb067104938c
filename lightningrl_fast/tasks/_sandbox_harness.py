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
6. the optional Python guard: an audit hook (PEP 578, cannot be removed) refusing writes and
   renames outside the working directory, ``kill`` of other processes, ``fork``/``exec``/``subprocess``,
   sockets and ``ctypes``; a forbidden event ends the process at once (no ``except`` can retry it) —
   defense in depth on top of the OS layers, not a substitute for them;
7. exec setup + solution, then each test separately, streaming one record per test.

Records on the result pipe are ``<nonce> <TAG> ...`` lines built with plain string formatting and written
with a saved reference to ``os.write``: ``R n`` (ready, n tests), ``S err`` (setup/solution failed),
``T i ok err``, ``D`` (done), ``V event`` (guard violation), ``E msg`` (sandbox set-up error). The nonce
stops accidental forgery (a program printing "passed"); code that deliberately introspects this
interpreter can still forge results: the OS layers protect the machine, not the score.
"""

import builtins
import json
import os
import resource
import sys

_write = os.write
_exit = os._exit


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


def _make_guard(workdir, violation):
    """The audit hook. A forbidden event ends the process at once (``violation`` reports it and exits), so
    code that catches exceptions cannot retry its way around the policy."""
    work = os.path.realpath(workdir)
    allowed_dev = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdout", "/dev/stderr")
    me = os.getpid()
    realpath, fspath, isabs, join = os.path.realpath, os.fspath, os.path.isabs, os.path.join
    getcwd = os.getcwd

    def inside(p):
        if isinstance(p, int):
            return True  # an already-open descriptor
        try:
            p = fspath(p)
            if isinstance(p, bytes):
                p = p.decode("utf-8", "surrogateescape")
            if not isabs(p):
                p = join(getcwd(), p)
        except Exception:
            return False
        if p in allowed_dev:
            return True
        p = realpath(p)
        return p == work or p.startswith(work + "/")

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
        "sys.setprofile", "sys.settrace", "os.kill", "os.killpg", "signal.pthread_kill",
    }

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path):
                violation("open-for-writing outside the working directory")
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
        nproc = job["max_procs"]
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
        setup, solution, tests = job["setup"], job["solution"], job["tests"]
        if job.get("python_guard"):

            def violation(what):
                try:
                    _write(2, ("sandbox guard: %s is not allowed\n" % what).encode("ascii", "replace"))
                except BaseException:
                    pass
                emit("V", _clean(what.split(" ")[0]))
                _exit(4)

            sys.addaudithook(_make_guard(workdir, violation))
    except BaseException as e:  # the jail is incomplete: run nothing
        msg = "".join(c if " " <= c <= "~" else "?" for c in str(e)[:300])
        emit("E", _clean(type(e).__name__), msg)
        _exit(3)

    emit("R", len(tests))
    g = {"__name__": "__sandbox__", "__builtins__": builtins}
    try:
        if setup:
            exec(compile(setup, "<setup>", "exec"), g)
        exec(compile(solution, "<solution>", "exec"), g)
    except BaseException as e:
        _describe("solution", e)
        emit("S", _err_name(e))
        emit("D")
        _exit(0)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), g)
            emit("T", i, 1, "-")
        except BaseException as e:
            _describe("test %d" % i, e)
            emit("T", i, 0, _err_name(e))
    emit("D")
    _exit(0)


if __name__ == "__main__":
    main()

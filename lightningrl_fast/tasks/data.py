"""Benchmark files -> uniform `Example` rows, and the prompt builders.

Users bring their own files (nothing is downloaded). Supported containers, chosen by file name:

* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line (blank lines are ignored);
* ``.json`` / ``.json.gz``: a list of objects, or ``{"data": [...]}`` (a ``.json`` file of one object per line
  is read as JSON Lines);
* ``.parquet``: needs ``pyarrow`` (an optional dependency; a clear error says so when it is missing).

Supported row formats (REFERENCE.md §6), detected per file from the keys of its first object (the first row of
the table below whose keys it has: a row holding both ``problem`` and ``question`` is math500), or forced with
``fmt=``:

==========  =====================================================================  ======
fmt         keys                                                                   kind
==========  =====================================================================  ======
humaneval   ``task_id``, ``prompt``, ``canonical_solution``, ``test``,             code
            ``entry_point``
mbpp        ``task_id``, ``text`` (or ``prompt``), ``code``, ``test_list``,        code
            ``test_setup_code`` (optional; ``test_imports`` of the sanitized set)
math500     ``problem``, ``answer`` (``solution`` optional)                        math
gsm8k       ``question``, ``answer`` (worked solution ending in ``#### 42``)       math
plain       ``prompt``, ``answer`` (optional ``id``, ``kind``; a ``"code"`` row also   math
            needs ``test_list`` or ``test`` + ``entry_point``)
==========  =====================================================================  ======

Malformed rows (bad JSON, not an object, a missing key, a wrong type, an empty question / problem / prompt,
an empty or non-finite reference answer, a GSM8K answer without a number after ``####``, a code row without
tests, a HumanEval row with an empty ``test``)
become `RowError`s naming the file and the line (JSONL) or the row index (JSON, Parquet). With
``on_error="raise"`` the first one raises `DataFormatError`; with ``on_error="skip"`` (default) they are
skipped, counted in `LoadResult.errors`, and summarized in one warning and one log line — never dropped
silently. A file with no rows at all, or with no valid row, is an error either way (``allow_empty=True``
accepts it).

Prompt builders are plain functions returning strings: `math_prompt` is exactly the LightningRL math
prompt (REFERENCE.md §1); `code_prompt` wraps an MBPP statement plus its asserts, or a HumanEval function
stub, in the same ChatML user turn; `build_prompt` dispatches on ``example.kind``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

__all__ = [
    "Example",
    "RowError",
    "DataFormatError",
    "LoadResult",
    "FORMATS",
    "detect_format",
    "load_examples",
    "parse_gsm8k_reference",
    "chat_user_turn",
    "math_prompt",
    "code_prompt",
    "build_prompt",
]


IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

FORMATS = ("gsm8k", "math500", "mbpp", "humaneval", "plain")


@dataclass
class Example:
    """One benchmark item, whatever file it came from.

    ``prompt`` is the raw question / problem statement (for HumanEval: the function stub), not yet templated.
    ``answer`` is the reference final answer for math (GSM8K: the number after ``####``) and the reference
    program for code. ``solution`` keeps a worked solution when the file has one. Code fields:
    ``test_list`` (MBPP asserts, one per entry), ``test_setup_code`` (run after the solution, before the tests),
    ``test`` (HumanEval source defining ``check``) and ``entry_point`` (HumanEval function name).
    """

    id: str
    prompt: str
    answer: str
    kind: Literal["math", "code"]
    source: str = "plain"
    solution: str = ""
    test_list: list[str] = field(default_factory=list)
    test_setup_code: str = ""
    test: str = ""
    entry_point: str = ""


@dataclass(frozen=True)
class RowError:
    """A malformed row: where it is and what is wrong. ``line`` is 1-based for JSONL, ``row`` 0-based otherwise."""

    path: str
    message: str
    line: int | None = None
    row: int | None = None

    @property
    def location(self) -> str:
        if self.line is not None:
            return f"{self.path}:{self.line}"
        if self.row is not None:
            return f"{self.path}[row {self.row}]"
        return self.path

    def __str__(self) -> str:
        return f"{self.location}: {self.message}"


class DataFormatError(ValueError):
    """A file (or, with ``on_error="raise"``, a row) that cannot be read; ``str()`` names the file and line."""

    def __init__(self, message: str, error: RowError | None = None):
        super().__init__(message)
        self.error = error


@dataclass
class LoadResult:
    """What `load_examples` returns: the examples (iterable/indexable like a list) and the skipped rows."""

    path: str
    fmt: str
    examples: list[Example]
    errors: list[RowError]
    n_rows: int

    @property
    def skipped(self) -> int:
        return len(self.errors)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


class _BadRow(Exception):
    """Internal: a row-level problem, turned into a RowError with the location by the caller."""


# ------------------------------------------------------------------------------------------ reading


def _open_bytes(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _container(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for ext in ("jsonl", "json", "parquet"):
        if name.endswith("." + ext):
            return ext
    raise DataFormatError(f"{path}: unknown file type (expected .jsonl, .jsonl.gz, .json, .json.gz or .parquet)")


def holds_json_lines(lines: Iterable[str | bytes], parse: Callable[[str], Any] = json.loads) -> bool:
    """Whether the lines of a ``.json`` file are really JSON Lines (what many dataset exports write): the first
    non-blank line is a whole JSON object (read by `parse`) and something follows it. Shared with the generate
    command line's prompts files."""
    it = iter(lines)
    first = next((ln for ln in it if ln.strip()), None)
    rest = any(ln.strip() for ln in it)
    if first is None or not rest or first.lstrip()[:1] not in ("{", b"{"):
        return False
    try:
        return isinstance(parse(first.decode("utf-8-sig") if isinstance(first, bytes) else first), dict)
    except (ValueError, RecursionError):  # not UTF-8 / not JSON / too many digits / nested too deep
        return False


def json_document_rows(doc: Any) -> list | None:
    """The rows a ``.json`` document holds: a list, ``{"data": [...]}``, or one object (a one-row JSON Lines export
    named .json); None when it is none of those. Shared with the generate command line's prompts files."""
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        return doc["data"]
    if isinstance(doc, dict) and "data" not in doc:
        return [doc]
    return doc if isinstance(doc, list) else None


def _iter_raw_rows(path: Path) -> Iterator[tuple[dict[str, Any] | None, RowError | None]]:
    """Yield (row, None) or (None, error) for every row of the file, in order."""
    kind = _container(path)
    spath = str(path)
    try:
        if kind == "json":
            with _open_bytes(path) as f:
                if holds_json_lines(f):
                    kind = "jsonl"
        if kind == "jsonl":
            with _open_bytes(path) as f:
                for lineno, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    try:
                        obj = json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8"))  # a BOM may lead
                    except UnicodeDecodeError as e:
                        yield None, RowError(spath, f"not UTF-8 ({e.reason} at byte {e.start})", line=lineno)
                        continue
                    except json.JSONDecodeError as e:
                        yield None, RowError(spath, f"bad JSON: {e.msg} (column {e.colno})", line=lineno)
                        continue
                    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits, nesting too deep
                        yield None, RowError(spath, f"bad JSON: {e}", line=lineno)
                        continue
                    if not isinstance(obj, dict):
                        yield None, RowError(spath, f"expected a JSON object, got {type(obj).__name__}", line=lineno)
                        continue
                    yield obj, RowError(spath, "", line=lineno)
        elif kind == "json":
            with _open_bytes(path) as f:
                data = f.read()
            if not data.strip():
                return
            try:
                doc = json.loads(data.decode("utf-8-sig"))
            except (ValueError, RecursionError) as e:  # + not UTF-8, > 4300-digit integers, nesting too deep
                where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
                raise DataFormatError(f"{path}: not valid JSON{where}: {e}") from None
            doc = json_document_rows(doc)
            if doc is None:
                raise DataFormatError(f'{path}: expected a JSON list of objects or {{"data": [...]}}')
            for i, obj in enumerate(doc):
                if not isinstance(obj, dict):
                    yield None, RowError(spath, f"expected a JSON object, got {type(obj).__name__}", row=i)
                else:
                    yield obj, RowError(spath, "", row=i)
        else:  # parquet
            try:
                import pyarrow.parquet as pq  # optional dependency
            except ImportError:
                raise DataFormatError(
                    f"{path}: reading Parquet needs pyarrow, which is not installed (pip install pyarrow)"
                ) from None
            try:
                table = pq.read_table(path)
            except Exception as e:  # pyarrow raises its own error types
                raise DataFormatError(f"{path}: cannot read Parquet: {e}") from None
            for i, obj in enumerate(table.to_pylist()):
                yield obj, RowError(spath, "", row=i)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; truncated gzip is EOFError
        raise DataFormatError(f"{path}: cannot read file: {e}") from None


# ------------------------------------------------------------------------------------------ formats


def detect_format(row: dict[str, Any]) -> str | None:
    """The row format implied by a row's keys, or None when no known format fits."""
    keys = set(row)
    if {"prompt", "canonical_solution", "test", "entry_point"} <= keys:
        return "humaneval"
    if {"code", "test_list"} <= keys and ("text" in keys or "prompt" in keys):
        return "mbpp"
    if {"problem", "answer"} <= keys:
        return "math500"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"prompt", "answer"} <= keys:
        return "plain"
    return None


def _get(row: dict[str, Any], key: str, types: tuple[type, ...] = (str,), default: Any = ...) -> Any:
    if key not in row or row[key] is None:
        if default is not ...:
            return default
        raise _BadRow(f"missing key {key!r} (keys: {sorted(row)})")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise _BadRow(f"key {key!r} should be {names}, got {type(value).__name__}")
    if isinstance(value, str):
        _check_encodable(value, key)
    return value


def _check_encodable(value: str, key: str) -> None:
    """A JSON string may escape a lone UTF-16 surrogate ("\\ud800"), which is no text: the tokenizer refuses it
    (a TypeError deep inside) and so does any UTF-8 output of the row."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _BadRow(f"key {key!r} holds an unpaired surrogate U+{ord(value[e.start]):04X} at character "
                      f"{e.start} (not text)") from None


def _text(row: dict[str, Any], key: str) -> str:
    """A required text field that the prompt is built from: a string with something besides whitespace."""
    value = _get(row, key)
    if not value.strip():
        raise _BadRow(f"key {key!r} is empty")
    return value


def _text_answer(value: Any, key: str) -> str:
    """A reference answer as text: a non-empty string, or a finite number (a math answer is never NaN)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(f"key {key!r} should be str or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadRow(f"key {key!r} is {value!r}, not a finite number")
    text = value.strip() if isinstance(value, str) else str(value)
    if not text:
        raise _BadRow(f"key {key!r} is empty")
    _check_encodable(text, key)
    return text


_GSM8K_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def parse_gsm8k_reference(answer: str) -> str | None:
    """The final number of a GSM8K answer (text after the last ``####``), commas and ``$`` removed; None if absent."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip()
    final = final.replace(",", "").replace("$", "").strip()
    if final.endswith("."):
        final = final[:-1].strip()
    return final or None


def _row_id(row: dict[str, Any], default: str) -> str:
    for key in ("id", "task_id", "unique_id", "idx"):
        v = row.get(key)
        if isinstance(v, (str, int)) and not isinstance(v, bool):
            if isinstance(v, str):
                _check_encodable(v, key)  # ids are written to results files
            return str(v)
    return default


def _from_gsm8k(row: dict[str, Any], default_id: str) -> Example:
    question = _text(row, "question")
    solution = _get(row, "answer")
    final = parse_gsm8k_reference(solution)
    if final is None:
        raise _BadRow("GSM8K 'answer' has no '#### <number>' final line")
    if not _GSM8K_NUMBER_RE.fullmatch(final):
        raise _BadRow(f"GSM8K 'answer' ends in '#### {final[:40]}', which is not a number")
    return Example(_row_id(row, default_id), question, final, "math", "gsm8k", solution=solution)


def _from_math500(row: dict[str, Any], default_id: str) -> Example:
    problem = _text(row, "problem")
    answer = _text_answer(_get(row, "answer", (str, int, float)), "answer")
    solution = _get(row, "solution", default="")
    return Example(_row_id(row, default_id), problem, answer, "math", "math500", solution=solution)


def _str_list(row: dict[str, Any], key: str, default: Any = ...) -> list[str]:
    value = _get(row, key, (list, tuple), default=default)
    if not all(isinstance(t, str) for t in value):
        raise _BadRow(f"key {key!r} should be a list of str")
    for i, t in enumerate(value):
        _check_encodable(t, f"{key}[{i}]")
    return list(value)


def _from_mbpp(row: dict[str, Any], default_id: str) -> Example:
    text = _text(row, "text") if "text" in row else _text(row, "prompt")
    code = _get(row, "code")
    tests = _str_list(row, "test_list")
    if not tests:
        raise _BadRow("key 'test_list' is empty")
    setup = _get(row, "test_setup_code", default="")
    imports = _str_list(row, "test_imports", default=[])
    if imports:
        setup = "\n".join(imports + ([setup] if setup else []))
    _get(row, "task_id", (str, int), default="")
    return Example(
        _row_id(row, default_id), text, code, "code", "mbpp", test_list=tests, test_setup_code=setup
    )


def _from_humaneval(row: dict[str, Any], default_id: str) -> Example:
    prompt = _text(row, "prompt")
    solution = _get(row, "canonical_solution")
    test = _text(row, "test")  # without it every completion would fail `check`: a silently wrong score
    entry = _get(row, "entry_point")
    if not entry.isidentifier():
        raise _BadRow(f"'entry_point' {entry!r} is not a Python identifier")
    return Example(
        _row_id(row, default_id), prompt, solution, "code", "humaneval", test=test, entry_point=entry
    )


def _from_plain(row: dict[str, Any], default_id: str) -> Example:
    prompt = _text(row, "prompt")
    answer = _text_answer(_get(row, "answer", (str, int, float)), "answer")
    kind = _get(row, "kind", default="math")
    if kind not in ("math", "code"):
        raise _BadRow(f"'kind' should be 'math' or 'code', got {kind!r}")
    if kind == "math":
        return Example(_row_id(row, default_id), prompt, answer, kind, "plain")
    # a code row is scored by running tests: MBPP-style asserts, or a HumanEval-style check(entry_point)
    tests = _str_list(row, "test_list", default=[])
    setup = _get(row, "test_setup_code", default="")
    test = _get(row, "test", default="")
    entry = _get(row, "entry_point", default="")
    if bool(test) != bool(entry):
        raise _BadRow("a code row with 'test' needs 'entry_point' too (and the other way round)")
    if entry and not entry.isidentifier():
        raise _BadRow(f"'entry_point' {entry!r} is not a Python identifier")
    if not tests and not test:
        raise _BadRow("a 'code' row needs tests: 'test_list' (asserts) or 'test' + 'entry_point'")
    return Example(_row_id(row, default_id), prompt, answer, kind, "plain", test_list=tests,
                   test_setup_code=setup, test=test, entry_point=entry)


_CONVERTERS: dict[str, Callable[[dict[str, Any], str], Example]] = {
    "gsm8k": _from_gsm8k,
    "math500": _from_math500,
    "mbpp": _from_mbpp,
    "humaneval": _from_humaneval,
    "plain": _from_plain,
}


# ------------------------------------------------------------------------------------------ loading


def load_examples(
    path: str | Path,
    fmt: str | None = None,
    on_error: Literal["skip", "raise"] = "skip",
    limit: int | None = None,
    allow_empty: bool = False,
) -> LoadResult:
    """Read a benchmark file into `Example`s (see the module docstring for formats and error handling).

    ``fmt`` forces one of `FORMATS`; by default the format is detected from the first JSON object of the
    file. ``limit`` stops after that many valid examples. Returns a `LoadResult` (list-like, with
    ``.errors`` / ``.skipped``).
    """
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if fmt is not None and fmt not in _CONVERTERS:
        raise ValueError(f"fmt must be one of {FORMATS} or None, got {fmt!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    path = Path(path)
    if path.is_dir():
        raise DataFormatError(f"{path} is a folder, not a data file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    stem = path.name.split(".")[0]
    examples: list[Example] = []
    errors: list[RowError] = []
    n_rows = 0
    convert = _CONVERTERS.get(fmt) if fmt else None
    for row, where in _iter_raw_rows(path):
        n_rows += 1
        err: RowError | None = None
        if row is None:
            err = where
        else:
            if convert is None:
                fmt = detect_format(row)
                if fmt is None:
                    raise DataFormatError(
                        f"{where.location}: cannot detect the format from keys {sorted(row)}; "
                        f"expected one of {FORMATS} (see lightningrl_fast.tasks.data) or pass fmt="
                    )
                convert = _CONVERTERS[fmt]
            pos = where.line if where.line is not None else where.row
            try:
                examples.append(convert(row, f"{stem}/{pos}"))
            except _BadRow as e:
                err = RowError(where.path, f"{fmt}: {e}", line=where.line, row=where.row)
        if err is not None:
            if on_error == "raise":
                raise DataFormatError(str(err), err)
            errors.append(err)
        if limit is not None and len(examples) >= limit:
            break
    if n_rows == 0 and not allow_empty:
        raise DataFormatError(f"{path}: the file has no rows")
    if not examples and not allow_empty:
        first = "; ".join(str(e) for e in errors[:3])
        raise DataFormatError(f"{path}: no valid row among {n_rows} ({first})")
    if errors:
        shown = "; ".join(str(e) for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        msg = f"{path}: skipped {len(errors)} malformed row(s) of {n_rows}: {shown}{more}"
        warnings.warn(msg, stacklevel=2)  # once (it was also logged: the CLIs printed it twice)
    return LoadResult(str(path), fmt or "unknown", examples, errors, n_rows)


# ------------------------------------------------------------------------------------------ prompts


def hash01(key: str) -> float:
    """A fixed pseudo-random number in [0, 1) from `key` (the first 8 bytes of its sha256): splits of examples that
    depend on nothing but the key (tasks/synthetic.py's test / validation split, rl/selection.split_by_hash)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") / 2**64


def chat_user_turn(user_text: str) -> str:
    """The ChatML single user turn with the assistant turn opened (what SDAR chat checkpoints expect)."""
    return f"{IM_START}user\n{user_text}{IM_END}\n{IM_START}assistant\n"


def math_prompt(question: str) -> str:
    """The LightningRL math prompt (REFERENCE.md §1), exactly."""
    return chat_user_turn(f"{question}\n{MATH_INSTRUCTION}")


def code_prompt_text(example: Example) -> str:
    """The user message for a code example (no chat wrapping).

    MBPP: the statement, then its asserts as examples of the required signature. HumanEval: the function
    stub to complete. The model is asked for one fenced Python block. Plain rows: the prompt as its author
    wrote it (their tests are not shown).
    """
    if example.source == "plain":
        return example.prompt
    if example.source == "humaneval" or example.entry_point:
        return (
            "Complete the following Python function. Reply with the whole function in one ```python code block.\n"
            f"```python\n{example.prompt.rstrip()}\n```"
        )
    if example.test_list:
        tests = "\n".join(example.test_list)
        return (
            f"{example.prompt.strip()}\nYour code should pass these tests:\n\n{tests}\n\n"
            "Reply with the Python code in one ```python code block."
        )
    return example.prompt


def code_prompt(example: Example) -> str:
    """The ChatML prompt for a code example (see `code_prompt_text`)."""
    return chat_user_turn(code_prompt_text(example))


def build_prompt(example: Example) -> str:
    """`math_prompt` or `code_prompt` depending on ``example.kind``."""
    if example.kind == "math":
        return math_prompt(example.prompt)
    if example.kind == "code":
        return code_prompt(example)
    raise ValueError(f"unknown example kind {example.kind!r} (expected 'math' or 'code')")

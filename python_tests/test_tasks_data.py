"""Tests for lightningrl_fast/tasks/data.py: every container (jsonl, jsonl.gz, json list / {"data"}, parquet),
every row format (GSM8K, MATH500, MBPP, HumanEval, plain) with detection and forcing, malformed rows reported
with file and line (skip with a counted warning, or raise), and the prompt builders. Files are written here.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import warnings
from pathlib import Path

import pytest

from lightningrl_fast.tasks import (
    MathTask,
    Task,
    TaskLike,
    available_tasks,
    get_task,
    is_correct_batch,
    register_task,
    score_batch,
)
from lightningrl_fast.tasks.data import (
    DataFormatError,
    Example,
    build_prompt,
    code_prompt,
    detect_format,
    load_examples,
    math_prompt,
    parse_gsm8k_reference,
)

GSM = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A shop sells 1,200 pens a day. Pens in 2 days?", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
]
MATH = [
    {"problem": "What is $1/2 + 1/4$?", "solution": "... $\\boxed{\\frac{3}{4}}$", "answer": "\\frac{3}{4}",
     "unique_id": "test/algebra/1.json"},
    {"problem": "Compute $2^3$.", "solution": "$\\boxed{8}$", "answer": "8"},
]
MBPP = [
    {"task_id": 11, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": "",
     "challenge_test_list": []},
]
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": "def inc(x):\n    \"\"\"Return x + 1.\"\"\"\n",
     "canonical_solution": "    return x + 1\n", "test": "def check(candidate):\n    assert candidate(1) == 2\n",
     "entry_point": "inc"},
]
PLAIN = [{"prompt": "2+2?", "answer": 4}, {"id": "p2", "prompt": "3*3?", "answer": "9"}]


def write_jsonl(path: Path, rows, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_gsm8k_jsonl(tmp_path):
    res = load_examples(write_jsonl(tmp_path / "gsm8k_test.jsonl", GSM))
    assert res.fmt == "gsm8k" and len(res) == 2 and res.skipped == 0 and res.n_rows == 2
    ex = res[0]
    assert ex.kind == "math" and ex.source == "gsm8k" and ex.answer == "7" and ex.prompt == GSM[0]["question"]
    assert ex.solution == GSM[0]["answer"] and ex.id == "gsm8k_test/1"
    assert res[1].answer == "2400"  # thousands separators removed


def test_utf8_byte_order_mark_is_read(tmp_path):
    """Files saved with a BOM (Windows tools): the first JSONL row and a JSON document load, nothing skipped."""
    (tmp_path / "gsm8k_bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in GSM).encode())
    res = load_examples(tmp_path / "gsm8k_bom.jsonl")
    assert len(res) == 2 and res.skipped == 0 and res[0].answer == "7"
    (tmp_path / "m.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(MATH).encode())
    assert [e.answer for e in load_examples(tmp_path / "m.json")] == ["\\frac{3}{4}", "8"]


def test_train_refuses_data_of_another_task(tmp_path):
    from lightningrl_fast.tasks.data import DataFormatError
    from lightningrl_fast.run_setup import load_task_examples

    path = write_jsonl(tmp_path / "mbpp.jsonl", MBPP)
    with pytest.raises(DataFormatError, match="'code' problems, not 'math'"):
        load_task_examples(str(path), None, None, lambda _m: None, "math")
    assert len(load_task_examples(str(path), None, None, lambda _m: None, "code")) == 1


def test_math500_json_list_and_data_wrapper(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(MATH))
    (tmp_path / "b.json").write_text(json.dumps({"data": MATH}))
    for name in ("a.json", "b.json"):
        res = load_examples(tmp_path / name)
        assert res.fmt == "math500" and [e.answer for e in res] == ["\\frac{3}{4}", "8"]
        assert res[0].id == "test/algebra/1.json" and res[0].solution.endswith("$")


def test_mbpp_and_humaneval_gz(tmp_path):
    mbpp = load_examples(write_jsonl(tmp_path / "mbpp.jsonl.gz", MBPP, gz=True))
    ex = mbpp[0]
    assert mbpp.fmt == "mbpp" and ex.kind == "code" and ex.id == "11" and ex.test_list == MBPP[0]["test_list"]
    assert ex.answer == MBPP[0]["code"] and ex.prompt == MBPP[0]["text"]
    he = load_examples(write_jsonl(tmp_path / "HumanEval.jsonl.gz", HUMANEVAL, gz=True))
    ex = he[0]
    assert he.fmt == "humaneval" and ex.entry_point == "inc" and ex.test == HUMANEVAL[0]["test"]
    assert ex.prompt == HUMANEVAL[0]["prompt"] and ex.answer == "    return x + 1\n" and ex.id == "HumanEval/0"


def test_mbpp_setup_code_and_ids_are_kept(tmp_path):
    """Real MBPP rows carry a test_setup_code (e.g. an import) that must run before the asserts; ids are task_id."""
    rows = [dict(MBPP[0], task_id=17, test_setup_code="import math\nR = 3"), dict(MBPP[0], task_id="mbpp_5")]
    res = load_examples(write_jsonl(tmp_path / "mbpp_full.jsonl", rows))
    assert [(e.id, e.test_setup_code, e.source) for e in res] == [("17", "import math\nR = 3", "mbpp"),
                                                                  ("mbpp_5", "", "mbpp")]
    assert [e.test_list for e in res] == [MBPP[0]["test_list"]] * 2 and res[0].solution == ""
    # sanitized rows: test_imports first, then the setup code
    row = dict(MBPP[0], test_imports=["import re", "import os"], test_setup_code="X = 1")
    assert load_examples(write_jsonl(tmp_path / "s2.jsonl", [row]))[0].test_setup_code == "import re\nimport os\nX = 1"


@pytest.mark.parametrize("fmt, good, bad, message", [
    ("math500", MATH[1], {"problem": "p", "answer": ["1"]}, "math500: key 'answer' should be str or int or float, got list"),
    ("math500", MATH[1], {"problem": 3, "answer": "1"}, "math500: key 'problem' should be str, got int"),
    ("math500", MATH[1], {"problem": "p", "answer": "1", "solution": 7}, "math500: key 'solution' should be str, got int"),
    ("math500", MATH[1], {"problem": "p", "answer": True}, "math500: key 'answer' should be str or int or float, got bool"),
    ("mbpp", MBPP[0], {k: v for k, v in MBPP[0].items() if k != "code"}, "mbpp: missing key 'code'"),
    ("mbpp", MBPP[0], dict(MBPP[0], code=["def add(a, b): ..."]), "mbpp: key 'code' should be str, got list"),
    ("mbpp", MBPP[0], dict(MBPP[0], test_setup_code=1), "mbpp: key 'test_setup_code' should be str, got int"),
    ("mbpp", MBPP[0], dict(MBPP[0], test_imports="import math"), "mbpp: key 'test_imports' should be list or tuple"),
    ("mbpp", MBPP[0], dict(MBPP[0], test_imports=[1]), "mbpp: key 'test_imports' should be a list of str"),
    ("mbpp", MBPP[0], dict(MBPP[0], task_id=[11]), "mbpp: key 'task_id' should be str or int, got list"),
    ("humaneval", HUMANEVAL[0], {k: v for k, v in HUMANEVAL[0].items() if k != "canonical_solution"},
     "humaneval: missing key 'canonical_solution'"),
    ("humaneval", HUMANEVAL[0], dict(HUMANEVAL[0], canonical_solution=None), "humaneval: missing key 'canonical_solution'"),
    ("humaneval", HUMANEVAL[0], dict(HUMANEVAL[0], entry_point=5), "humaneval: key 'entry_point' should be str, got int"),
    ("humaneval", HUMANEVAL[0], {k: v for k, v in HUMANEVAL[0].items() if k != "test"}, "humaneval: missing key 'test'"),
    ("humaneval", HUMANEVAL[0], dict(HUMANEVAL[0], test=["assert True"]), "humaneval: key 'test' should be str, got list"),
    ("gsm8k", GSM[0], {"question": "q", "answer": 7}, "gsm8k: key 'answer' should be str, got int"),
    ("gsm8k", GSM[0], {"question": "q", "answer": "7 ####"}, "no '#### <number>'"),
    # a JSON "\\ud800" escape is no text (was: the tokenizer's TypeError deep inside, or a UnicodeEncodeError writing
    # the results)
    ("gsm8k", GSM[0], {"question": "q\ud800", "answer": "s\n#### 7"},
     "gsm8k: key 'question' holds an unpaired surrogate U+D800 at character 1"),
    ("math500", MATH[1], {"problem": "p", "answer": "\udc001"}, "key 'answer' holds an unpaired surrogate U+DC00"),
    ("mbpp", MBPP[0], dict(MBPP[0], test_list=["assert True", "assert f()\udc00"]),
     "mbpp: key 'test_list[1]' holds an unpaired surrogate U+DC00"),
    ("mbpp", MBPP[0], dict(MBPP[0], task_id="t\ud800"), "mbpp: key 'task_id' holds an unpaired surrogate"),
])
def test_malformed_rows_of_every_format(tmp_path, fmt, good, bad, message):
    """A bad row between two good rows of the same format (detected from the first row): it alone is skipped,
    reported with its line and what is wrong; the good rows around it are read in full."""
    path = write_jsonl(tmp_path / "rows.jsonl", [good, bad, good])
    with pytest.warns(UserWarning, match=r"skipped 1 malformed row\(s\) of 3"):
        res = load_examples(path)
    assert res.fmt == fmt and len(res) == 2 and res.n_rows == 3
    assert [e.line for e in res.errors] == [2] and message in res.errors[0].message, res.errors[0].message
    assert str(res.errors[0]).startswith(f"{path}:2: {fmt}: ")
    assert dataclasses.replace(res[0], id="") == dataclasses.replace(res[1], id="") and res[1].prompt == good.get("question", good.get("problem", good.get("text", good.get("prompt"))))
    with pytest.raises(DataFormatError, match=rf"rows\.jsonl:2: {fmt}: "):
        load_examples(path, on_error="raise")


def test_mbpp_sanitized_variant(tmp_path):
    row = {"task_id": 2, "prompt": "Add.", "code": "def add(a, b):\n    return a + b",
           "test_list": ["assert add(1, 1) == 2"], "test_imports": ["import math"]}
    ex = load_examples(write_jsonl(tmp_path / "s.jsonl", [row]))[0]
    assert ex.prompt == "Add." and ex.test_setup_code == "import math"


def test_plain_format_and_forced_format(tmp_path):
    res = load_examples(write_jsonl(tmp_path / "plain.jsonl", PLAIN))
    assert res.fmt == "plain" and [e.answer for e in res] == ["4", "9"] and res[1].id == "p2"
    # forcing: a GSM8K-shaped file read as plain fails every row (no 'prompt'), and says so
    with pytest.raises(DataFormatError, match="missing key 'prompt'"):
        load_examples(write_jsonl(tmp_path / "g.jsonl", GSM), fmt="plain", on_error="raise")
    with pytest.raises(ValueError, match="fmt must be one of"):
        load_examples(tmp_path / "g.jsonl", fmt="nope")


def test_detect_format_table():
    assert detect_format(GSM[0]) == "gsm8k"
    assert detect_format(MATH[0]) == "math500"
    assert detect_format(MBPP[0]) == "mbpp"
    assert detect_format(HUMANEVAL[0]) == "humaneval"
    assert detect_format(PLAIN[0]) == "plain"
    assert detect_format({"foo": 1}) is None


def test_unknown_keys_name_the_file(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"foo": 1}])
    with pytest.raises(DataFormatError, match=r"odd\.jsonl:1: cannot detect the format"):
        load_examples(path)


def test_malformed_rows_skipped_with_file_and_line(tmp_path):
    rows = [
        GSM[0],
        '{"question": "broken", "answer": ',          # line 2: bad JSON
        {"question": "no answer key"},                # line 3: missing key
        {"question": 5, "answer": "#### 5"},          # line 4: wrong type
        {"question": "no marker", "answer": "42"},    # line 5: GSM8K answer without ####
        "[1, 2]",                                     # line 6: not an object
        GSM[1],
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.warns(UserWarning, match=r"skipped 5 malformed row\(s\) of 7"):
        res = load_examples(path)
    assert len(res) == 2 and res.skipped == 5
    lines = [e.line for e in res.errors]
    assert lines == [2, 3, 4, 5, 6]
    text = [str(e) for e in res.errors]
    assert text[0].startswith(f"{path}:2: bad JSON")
    assert "missing key 'answer'" in text[1]
    assert "key 'question' should be str, got int" in text[2]
    assert "no '#### <number>'" in text[3]
    assert "expected a JSON object, got list" in text[4]
    with pytest.raises(DataFormatError, match=rf"{path}:2: bad JSON") as info:
        load_examples(path, on_error="raise")
    assert info.value.error.line == 2


def test_blank_lines_are_not_rows(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text("\n" + json.dumps(GSM[0]) + "\n\n   \n" + json.dumps(GSM[1]) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = load_examples(path)
    assert len(res) == 2 and res.skipped == 0 and res.errors == []


def test_json_rows_are_reported_by_index(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([MATH[0], {"problem": "x"}, 7, MATH[1]]))
    with pytest.warns(UserWarning):
        res = load_examples(path)
    assert len(res) == 2 and [e.row for e in res.errors] == [1, 2]
    assert str(res.errors[0]).startswith(f"{path}[row 1]: math500: missing key 'answer'")
    bad = tmp_path / "bad.json"
    bad.write_text('[{"problem": "x", "answer": 1},')
    with pytest.raises(DataFormatError, match=r"bad\.json: not valid JSON \(line 1"):
        load_examples(bad)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(DataFormatError, match="expected a JSON list"):
        load_examples(scalar)


def test_json_file_holding_json_lines(tmp_path):
    path = tmp_path / "export.json"
    path.write_text("\n" + json.dumps(MATH[0]) + "\n" + '{"problem": "x"}' + "\n\n" + json.dumps(MATH[1]) + "\n")
    with pytest.warns(UserWarning, match="skipped 1"):
        res = load_examples(path)
    assert [e.answer for e in res] == ["\\frac{3}{4}", "8"] and [e.line for e in res.errors] == [3]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(MATH[1]))
    assert [e.answer for e in load_examples(one)] == ["8"]
    pretty = tmp_path / "pretty.json"  # an indented {"data": [...]} is still one JSON document
    pretty.write_text(json.dumps({"data": MATH}, indent=2))
    assert len(load_examples(pretty)) == 2
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": 3}))
    with pytest.raises(DataFormatError, match="expected a JSON list"):
        load_examples(wrapped)


def test_empty_and_all_bad_files(tmp_path):
    for name in ("empty.jsonl", "empty.json"):
        (tmp_path / name).write_text("")
        with pytest.raises(DataFormatError, match="has no rows"):
            load_examples(tmp_path / name)
        assert len(load_examples(tmp_path / name, allow_empty=True)) == 0
    gz = tmp_path / "empty.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("")
    with pytest.raises(DataFormatError, match="has no rows"):
        load_examples(gz)
    allbad = write_jsonl(tmp_path / "allbad.jsonl", ["{nope", "{nope"])
    with pytest.raises(DataFormatError, match=r"no valid row among 2 \(.*allbad\.jsonl:1: bad JSON"):
        load_examples(allbad)


def test_gz_errors_and_missing_files(tmp_path):
    notgz = tmp_path / "x.jsonl.gz"
    notgz.write_bytes(b"this is not gzip")
    with pytest.raises(DataFormatError, match=r"x\.jsonl\.gz: cannot read file"):
        load_examples(notgz)
    good = write_jsonl(tmp_path / "t.jsonl.gz", GSM * 50, gz=True)
    truncated = tmp_path / "trunc.jsonl.gz"
    truncated.write_bytes(good.read_bytes()[:-20])
    with pytest.raises(DataFormatError, match=r"trunc\.jsonl\.gz: cannot read file"):
        load_examples(truncated)
    bad_line = write_jsonl(tmp_path / "badline.jsonl.gz", [GSM[0], "{oops"], gz=True)
    with pytest.raises(DataFormatError, match=r"badline\.jsonl\.gz:2: bad JSON"):
        load_examples(bad_line, on_error="raise")
    with pytest.raises(FileNotFoundError):
        load_examples(tmp_path / "missing.jsonl")
    with pytest.raises(DataFormatError, match="unknown file type"):
        (tmp_path / "data.csv").write_text("a,b\n")
        load_examples(tmp_path / "data.csv")


def test_limit(tmp_path):
    res = load_examples(write_jsonl(tmp_path / "g.jsonl", GSM * 5), limit=3)
    assert len(res) == 3



def test_limit_below_one_is_refused(tmp_path):
    """limit=0 or a negative limit returned one example (the check ran after the first append)."""
    path = write_jsonl(tmp_path / "g.jsonl", GSM * 5)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="limit must be a positive integer"):
            load_examples(path, limit=bad)


def test_a_folder_is_named_as_a_folder(tmp_path):
    """A folder passed as the data file was reported as `no such file` (FileNotFoundError)."""
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    with pytest.raises(DataFormatError, match="data.jsonl is a folder, not a data file"):
        load_examples(folder)


def test_json_that_python_cannot_parse_is_a_bad_row(tmp_path):
    """A > 4300-digit integer or a deeply nested value made json.loads raise a bare ValueError / RecursionError,
    which escaped load_examples without the file and line (a traceback through the CLIs)."""
    rows = [GSM[0], '{"problem": "x", "answer": ' + "9" * 5000 + "}", '{"question": ' + "[" * 100_000 + "]" * 100_000 + "}"]
    path = write_jsonl(tmp_path / "odd.jsonl", rows)
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        res = load_examples(path)
    assert len(res) == 1 and [e.line for e in res.errors] == [2, 3]
    assert all("bad JSON" in e.message for e in res.errors)
    whole = tmp_path / "odd.json"
    whole.write_text('[{"problem": "x", "answer": ' + "9" * 5000 + "}]")
    with pytest.raises(DataFormatError, match="odd.json: not valid JSON"):
        load_examples(whole)


def test_empty_prompt_text_and_humaneval_test_are_bad_rows(tmp_path):
    """An empty question / problem / prompt / MBPP text was accepted (the model was asked nothing and scored), and a
    HumanEval row with an empty `test` scored every completion wrong (check is undefined)."""
    rows = [
        {"question": "", "answer": "#### 3"},
        {"question": "  \n", "answer": "#### 3"},
    ]
    with pytest.raises(DataFormatError, match=r"e\.jsonl:1: gsm8k: key 'question' is empty"):
        load_examples(write_jsonl(tmp_path / "e.jsonl", rows), on_error="raise")
    with pytest.raises(DataFormatError, match="key 'question' is empty"):
        load_examples(write_jsonl(tmp_path / "e.jsonl", rows[1:]), on_error="raise")
    cases = [({"problem": " ", "answer": "1"}, "math500: key 'problem' is empty"),
             ({"prompt": "", "answer": "1"}, "plain: key 'prompt' is empty"),
             ({**MBPP[0], "text": ""}, "mbpp: key 'text' is empty"),
             ({**HUMANEVAL[0], "test": ""}, "humaneval: key 'test' is empty"),
             ({**HUMANEVAL[0], "prompt": ""}, "humaneval: key 'prompt' is empty")]
    for row, msg in cases:
        with pytest.raises(DataFormatError, match=msg):
            load_examples(write_jsonl(tmp_path / "r.jsonl", [row]), on_error="raise")

def test_code_row_type_errors(tmp_path):
    rows = [dict(MBPP[0], test_list="assert add(1, 2) == 3"), dict(MBPP[0], test_list=[1, 2]), dict(MBPP[0], test_list=[]),
            dict(HUMANEVAL[0], entry_point="not valid"), MBPP[0]]
    path = write_jsonl(tmp_path / "code.jsonl", rows, gz=False)
    with pytest.warns(UserWarning):
        res = load_examples(path, fmt="mbpp")
    assert len(res) == 1 and res.skipped == 4
    msgs = [e.message for e in res.errors]
    assert "should be list or tuple, got str" in msgs[0] and "list of str" in msgs[1] and "empty" in msgs[2]
    he = write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL[0], dict(HUMANEVAL[0], entry_point="not valid")])
    with pytest.raises(DataFormatError, match=r"he\.jsonl:2: humaneval: 'entry_point' 'not valid'"):
        load_examples(he, on_error="raise")


def test_reference_answers_must_be_usable(tmp_path):
    rows = [
        {"prompt": "a?", "answer": ""},                               # 1: empty
        {"prompt": "b?", "answer": "   "},                            # 2: blank
        {"prompt": "c?", "answer": float("nan")},                     # 3: NaN (json.dumps writes NaN)
        {"prompt": "d?", "answer": float("inf")},                     # 4: Infinity
        {"prompt": "e?", "answer": -2.5},                             # 5: fine
    ]
    with pytest.warns(UserWarning, match=r"skipped 4 malformed row\(s\) of 5"):
        res = load_examples(write_jsonl(tmp_path / "p.jsonl", rows))
    assert [e.answer for e in res] == ["-2.5"]
    msgs = [e.message for e in res.errors]
    assert "'answer' is empty" in msgs[0] and "'answer' is empty" in msgs[1]
    assert "nan, not a finite number" in msgs[2] and "inf, not a finite number" in msgs[3]
    with pytest.raises(DataFormatError, match=r"m\.json\[row 0\]: math500: key 'answer' is empty"):
        load_examples(_write_json(tmp_path / "m.json", [dict(MATH[0], answer="")]), on_error="raise")


def _write_json(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def test_gsm8k_final_answer_must_be_a_number(tmp_path):
    good = ["#### 7", "#### -3", "#### 1,000", "#### $18.", "#### 0.25", "#### .5", "#### 3/4"]
    bad = ["#### seven", "#### 7 apples", "#### 1.2.3", "#### x=3"]
    rows = [{"question": f"q{i}", "answer": f"work\n{a}"} for i, a in enumerate(good + bad)]
    with pytest.warns(UserWarning, match=rf"skipped {len(bad)} malformed"):
        res = load_examples(write_jsonl(tmp_path / "g.jsonl", rows))
    assert [e.answer for e in res] == ["7", "-3", "1000", "18", "0.25", ".5", "3/4"]
    assert [e.line for e in res.errors] == list(range(len(good) + 1, len(rows) + 1))
    assert "ends in '#### seven', which is not a number" in res.errors[0].message


def test_plain_code_rows_need_tests(tmp_path):
    asserts = {"prompt": "Write add(a, b).", "answer": "def add(a, b): return a + b", "kind": "code",
               "test_list": ["assert add(1, 2) == 3"], "test_setup_code": "import math"}
    check = {"prompt": "Write inc(x).", "answer": "def inc(x): return x + 1", "kind": "code",
             "test": "def check(f):\n    assert f(1) == 2\n", "entry_point": "inc"}
    rows = [asserts, check,
            {"prompt": "Write f.", "answer": "def f(): pass", "kind": "code"},                      # 3: no tests
            dict(check, entry_point=None),                                                          # 4: test alone
            dict(check, test=None),                                                                 # 5: entry alone
            dict(check, entry_point="not valid"),                                                   # 6
            dict(asserts, test_list="assert add(1, 2) == 3")]                                       # 7: not a list
    with pytest.warns(UserWarning, match=r"skipped 5 malformed"):
        res = load_examples(write_jsonl(tmp_path / "c.jsonl", rows))
    a, c = res
    assert a.kind == c.kind == "code" and a.test_list == asserts["test_list"] and a.test_setup_code == "import math"
    assert c.test == check["test"] and c.entry_point == "inc" and not c.test_list
    msgs = [e.message for e in res.errors]
    assert "needs tests" in msgs[0] and "needs 'entry_point' too" in msgs[1] and "needs 'entry_point' too" in msgs[2]
    assert "not a Python identifier" in msgs[3] and "should be list or tuple" in msgs[4]
    # the author's prompt is used as written, and the rows are scored by their tests
    assert code_prompt(a) == "<|im_start|>user\nWrite add(a, b).<|im_end|>\n<|im_start|>assistant\n"
    from lightningrl_fast.tasks.code import build_program

    assert build_program("```python\ndef add(a, b):\n    return a + b\n```", a).tests == asserts["test_list"]
    assert "check(inc)" in build_program("```python\ndef inc(x):\n    return x + 1\n```", c).tests[0]


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "mbpp.parquet"
    pq.write_table(pa.Table.from_pylist(MBPP * 3), path)
    res = load_examples(path)
    assert res.fmt == "mbpp" and len(res) == 3 and res[0].test_list == MBPP[0]["test_list"]
    gsm = tmp_path / "gsm.parquet"
    pq.write_table(pa.Table.from_pylist([GSM[0], {"question": "q", "answer": "no marker"}]), gsm)
    with pytest.warns(UserWarning):
        res = load_examples(gsm)
    assert len(res) == 1 and res.errors[0].row == 1 and str(res.errors[0]).startswith(f"{gsm}[row 1]:")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 garbage")
    with pytest.raises(DataFormatError, match=r"broken\.parquet: cannot read Parquet"):
        load_examples(broken)


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataFormatError, match=r"needs pyarrow.*pip install pyarrow"):
        load_examples(path)


def test_gsm8k_reference_parsing():
    assert parse_gsm8k_reference("blah\n#### 1,000") == "1000"
    assert parse_gsm8k_reference("#### $18.") == "18"
    assert parse_gsm8k_reference("#### -3.5") == "-3.5"
    assert parse_gsm8k_reference("no marker") is None


def test_prompt_builders():
    q = "What is 2+3?"
    expected = ("<|im_start|>user\nWhat is 2+3?\nPlease reason step by step, and put your final answer within "
                "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert math_prompt(q) == expected
    ex = Example("1", q, "5", "math")
    assert build_prompt(ex) == expected == get_task("math").build_prompt(ex)
    mbpp = Example("m", "Write add.", "code", "code", "mbpp", test_list=["assert add(1, 2) == 3"])
    p = code_prompt(mbpp)
    assert p.startswith("<|im_start|>user\nWrite add.\nYour code should pass these tests:\n\nassert add(1, 2) == 3\n")
    assert p.endswith("<|im_end|>\n<|im_start|>assistant\n")
    he = Example("h", "def inc(x):\n    pass\n", "", "code", "humaneval", test="...", entry_point="inc")
    assert "```python\ndef inc(x):\n    pass\n```" in code_prompt(he) and build_prompt(he) == code_prompt(he)
    with pytest.raises(ValueError, match="unknown example kind"):
        build_prompt(Example("x", "q", "a", "poem"))  # type: ignore[arg-type]


def test_registry_names_lazy_entries_and_duck_typed_tasks(monkeypatch):
    assert {"math", "code", "synthetic"} <= set(available_tasks())
    assert isinstance(get_task("math", strict=False), MathTask) and get_task("math", strict=False).strict is False
    with pytest.raises(KeyError, match="unknown task 'nope'; available: .*math"):
        get_task("nope")

    class Echo:  # duck-typed: no Task base class
        name = "echo"

        def build_prompt(self, example):
            return example.prompt

        def score(self, response, example):
            return float(response == example.answer)

        def is_correct(self, response, example):
            return response == example.answer

    import lightningrl_fast.tasks as tasks_pkg

    monkeypatch.setattr(tasks_pkg, "_REGISTRY", dict(tasks_pkg._REGISTRY))  # registration stays in this test
    register_task("echo", Echo)
    task = get_task("echo")
    ex = Example("e", "say hi", "hi", "math")
    assert isinstance(task, TaskLike) and not isinstance(task, Task)
    assert score_batch(task, ["hi", "ho"], [ex, ex]) == [1.0, 0.0]
    assert is_correct_batch(task, ["hi"], [ex]) == [True]
    assert score_batch(get_task("math"), [r"\boxed{hi}"], [ex]) == [1.0]
    with pytest.raises(TypeError, match="needs a class with build_prompt"):
        register_task("bad", object)


def test_registry_builds_the_synthetic_task_when_present():
    if importlib.util.find_spec("lightningrl_fast.tasks.synthetic") is None:
        pytest.skip("tasks/synthetic.py is not there")
    task = get_task("synthetic")
    assert task.name == "synthetic" and isinstance(task, TaskLike)


# ---- mutation-testing gaps: each case failed on a mutant of the row parsing / task registry that the tests above
# let through


def test_gsm8k_reference_is_after_the_last_marker():
    assert parse_gsm8k_reference("first try #### 3\nno, redo\n#### 5") == "5"


def test_row_id_prefers_id_then_task_id(tmp_path):
    rows = [dict(PLAIN[0], id="a1", task_id="t1", idx=3), dict(PLAIN[0], task_id="t2", idx=4), dict(PLAIN[0], idx=5),
            dict(PLAIN[0])]
    assert [e.id for e in load_examples(write_jsonl(tmp_path / "ids.jsonl", rows))] == ["a1", "t2", "5", "ids/4"]


def test_detect_format_needs_the_answer_key():
    assert detect_format({"question": "q"}) is None and detect_format({"problem": "p"}) is None
    assert detect_format({"prompt": "p"}) is None


def test_detect_format_takes_the_first_table_row_that_fits():
    """A row fitting several formats gets the first of the module docstring's table (its stated rule)."""
    both = {"question": "q", "problem": "p", "answer": "1"}
    assert detect_format(both) == "math500"
    assert detect_format(dict(both, prompt="p")) == "math500"
    assert detect_format({"question": "q", "prompt": "p", "answer": "1"}) == "gsm8k"
    assert detect_format(dict(HUMANEVAL[0], code="c", test_list=["assert 1"])) == "humaneval"
    assert detect_format(dict(MBPP[0], answer="1", problem="p")) == "mbpp"


class _Partial:
    """A duck-typed task with partial credit: score 0.5 means "not correct"."""

    name = "partial"

    def build_prompt(self, example):
        return example.prompt

    def score(self, response, example):
        return {"right": 1.0, "half": 0.5}.get(response, 0.0)

    def is_correct(self, response, example):
        return response == "right"


def test_batch_helpers_keep_score_and_is_correct_apart():
    ex = Example("e", "q", "a", "math")
    task = _Partial()
    assert score_batch(task, ["right", "half", "no"], [ex] * 3) == [1.0, 0.5, 0.0]
    assert is_correct_batch(task, ["right", "half", "no"], [ex] * 3) == [True, False, False]

    class Sub(Task):  # the base class: is_correct means a full score; its batch methods check the lengths
        score = _Partial.score

    sub = Sub()
    assert [sub.is_correct(r, ex) for r in ("right", "half", "no")] == [True, False, False]
    assert sub.score_batch(["half", "right"], [ex, ex]) == [0.5, 1.0]
    assert is_correct_batch(sub, ["half", "right"], [ex, ex]) == [False, True]
    for method in (sub.score_batch, sub.is_correct_batch):
        with pytest.raises(ValueError, match="1 responses for 2 examples"):
            method(["right"], [ex, ex])

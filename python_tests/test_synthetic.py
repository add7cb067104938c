"""The embedded default task: splits, phrasings, the exact verifier."""

import random

import pytest

from lightningrl_fast.tasks import get_task
from lightningrl_fast.tasks.synthetic import ArithExample, SyntheticArithmetic, final_answer, trace, well_formed


def test_splits_are_disjoint_deterministic_and_cover_all_prompts():
    t = SyntheticArithmetic()
    train, test = {e.operands for e in t.train}, {e.operands for e in t.test}
    assert not train & test and len(train | test) == 9**3
    assert 0.1 < len(test) / 9**3 < 0.3
    assert [e.operands for e in SyntheticArithmetic().test] == [e.operands for e in t.test]
    assert {e.operands for e in SyntheticArithmetic(seed=1).test} != test
    with pytest.raises(ValueError, match="min_operand < max_operand"):
        SyntheticArithmetic(min_operand=5, max_operand=5)


def test_every_phrasing_is_correct_and_there_are_several():
    ex = ArithExample((6, 4, 5))
    rng = random.Random(0)
    seen = {trace(ex, rng) for _ in range(200)}
    assert len(seen) == 8  # 2 orders x 2 orders x 2 spacing styles
    assert "6 + 4=10,10 + 5=15#15" in seen and "4+6 = 10,5+10 = 15#15" in seen
    assert len({len(s) for s in seen}) == 1  # one length: TPF cannot be raised by a longer phrasing
    assert all(well_formed(s, ex) and final_answer(s) == 15 for s in seen)


def test_verifier_and_well_formed():
    t = SyntheticArithmetic()
    ex = ArithExample((6, 4, 5))
    loose = SyntheticArithmetic(strict=False)
    for task in (t, loose):
        assert task.is_correct("6+4=10,10+5=15#15", ex) and task.is_correct("04 + 06=10,10 + 05=15#15", ex)
        assert not task.is_correct("6+4=10,10+5=15#16", ex) and not task.is_correct("6+4=10,10+5=15", ex)
        assert not task.is_correct("#1 5", ex)
    # strict (the default): a right answer after a wrong or junk trace is wrong; answer-only accepts it
    for hacked in ("junk#15", "09 0 0= 10,05++  = 15#15", "6+4=11,11+4=15#15"):
        assert t.score(hacked, ex) == 0.0 and loose.score(hacked, ex) == 1.0, hacked
    for bad in ("6+4=11,11+4=15#15", "6+4=10#15", "6+5=11,11+4=15#15", "6+4=10,10+5=15,1+1=2#15", "6+4=10,10*5=15#15"):
        assert not well_formed(bad, ex), bad


def test_sft_pairs_end_with_eos_and_fit_the_length_bound():
    t = SyntheticArithmetic()
    tok = t.tokenizer
    rng = random.Random(1)
    for ex in t.train[:50]:
        p, r = t.sft_pair(ex, rng)
        assert tok.decode(p) == ex.prompt and r[-1] == tok.special_id("<|im_end|>")
        assert len(r) <= t.max_response_tokens()
        assert t.is_correct(tok.decode(r, skip_special=True), ex)


def test_registered_as_a_task():
    t = get_task("synthetic", max_operand=4)
    assert t.build_prompt(t.train[0]).endswith("?")


def test_padded_traces_have_a_length_fixed_by_the_phrasing():
    t = SyntheticArithmetic()
    assert t.width == 2
    lengths = {}
    for ex in t.train:
        for style in (0, 1):
            s = trace(ex, swap=(False, True), style=style, width=t.width)
            assert t.is_correct(s, ex) and well_formed(s, ex)
            lengths.setdefault(style, set()).add(len(s))
    assert lengths == {0: {24}, 1: {24}}
    assert trace(ArithExample((6, 4, 5)), swap=(False, False), style=0, width=2) == "06 + 04=10,10 + 05=15#15"
    assert trace(ArithExample((6, 4, 5)), swap=(True, False), style=1, width=2) == "04+06 = 10,10+05 = 15#15"
    with pytest.raises(ValueError, match="style must be 0"):
        trace(ArithExample((6, 4, 5)), style=2)


# ---- mutation-testing gaps: each case failed on a mutant of the verifier / generator that the tests above let through


def test_answer_is_the_true_sum_with_zeros_and_more_operands():
    assert ArithExample((6, 4, 5)).answer == 15
    assert ArithExample((0, 0, 7)).answer == 7 and ArithExample((9, 0, 0)).answer == 9
    assert ArithExample((1, 2, 3, 4)).answer == 10 and ArithExample((0, 0)).answer == 0
    t = SyntheticArithmetic(num_operands=4, min_operand=0, max_operand=3)
    ex = ArithExample((3, 0, 2, 1))
    assert t.is_correct("3+0=3,3+2=5,5+1=6#6", ex) and not t.is_correct("3+0=3,3+2=5,5+1=6#5", ex)
    assert t.is_correct("03+00=03,02+03=05,05+01=06#06", ex)


def test_min_operand_bounds_the_prompts():
    t = SyntheticArithmetic(min_operand=0, max_operand=3)
    every = {e.operands for e in t.train} | {e.operands for e in t.test}
    assert len(every) == 4**3 and (0, 0, 0) in every and (3, 3, 3) in every
    t2 = SyntheticArithmetic(min_operand=2, max_operand=4)
    assert {x for e in t2.train + t2.test for x in e.operands} == {2, 3, 4}


@pytest.mark.parametrize("response, expected", [
    ("6+4=10,10+5=15#15", 15),
    ("6+4=10,10+5=15# 15 ", 15),  # whitespace around the answer is not part of it
    ("1#2#15", 15),  # the text after the LAST '#'
    ("6+4=10,10+5=15#15 3", None),  # trailing junk: no answer
    ("6+4=10,10+5=15#1 5", None),
    ("6+4=10,10+5=15#", None),
    ("6+4=10,10+5=15", None),
])
def test_final_answer_is_the_whole_text_after_the_last_hash(response, expected):
    assert final_answer(response) == expected


def test_well_formed_rejects_wrong_sums_extra_text_and_stray_hashes():
    ex = ArithExample((6, 4, 5))
    assert well_formed("6+4=10,10+5=15#15", ex)
    for bad in (
        "6+4=9,9+5=15#15",  # a wrong partial sum, chained on: every step checks its own sum
        "6+4=10,10+5=14#15",  # the last step's sum is wrong, the answer right
        "6+4=10+1,10+5=15#15",  # extra text in a step
        "6+4=10,10+5=15 7#15",
        "6+4=10,10+5=15#9#15",  # a stray '#': the trace is the text before the LAST '#'
    ):
        assert not well_formed(bad, ex), bad
        assert not SyntheticArithmetic().is_correct(bad, ex), bad

"""The embedded default task: multi-step arithmetic with a worked trace, several equally valid phrasings.

A prompt is `a+b+c?` (three operands in [min_operand, max_operand], 1..9 by default); a correct response
is a worked trace ending in the answer, numbers zero-padded to the width of the largest sum, e.g.
`06 + 04=10,10 + 05=15#15`, then EOS. Every example's SFT target is drawn at random from equally valid
phrasings (REFERENCE §7):
  * operand order of each step (`06 + 04=10` or `04 + 06=10`; `10 + 05=15` or `05 + 10=15`),
  * spacing style, spaces around `+` or around `=` (`06 + 04=10` or `06+04 = 10`): the digits after the
    first operand sit two positions apart in the two styles,
so an SFT model cannot know which phrasing its neighbouring positions will take: its per-position
confidence is split between modes, parallel (threshold) decoding unmasks few tokens per step, and TPF is
low. LightningRL's job — collapse to one phrasing per prompt and raise TPF at equal accuracy — is real
and measurable on a CPU in minutes. Had the data one phrasing, the SFT model would already decode every
block in one step and there would be nothing to gain. All eight phrasings of an example have the same
length, so TPF (tokens per forward) is the inverse of forwards per answer: a policy cannot raise TPF by
choosing a longer phrasing whose extra tokens are easy.

Splits: the operand triples are split once by a fixed hash into train, an optional validation split and
held-out test, so the test accuracy measures generalization to unseen prompts; the validation split (none unless
`val_fraction` asks for it; the train CLI's default preset carves 10%) is what a run may select or tune on without
touching the test split. The test split depends on `test_fraction` alone: carving a validation split out of the
rest leaves it unchanged. The verifier is exact and, by default, strict: the
text after the last `#` (before EOS) must be the true sum AND every step of the worked trace must be right
(`well_formed`). With an answer-only verifier (`strict=False`) RL learns to keep the answer and turn the
trace into fast junk (measured: `9+9+7?` -> `09 0 0= 18,08++  = 25#25`, 95% "correct", 0% well-formed).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..tokenizer import CharTokenizer
from .data import hash01

ALPHABET = "0123456789+=,# ?"
_STEP = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*(\d+)\s*$")


@dataclass(frozen=True)
class ArithExample:
    """One prompt: operands and the true answer."""

    operands: tuple[int, ...]

    @property
    def id(self) -> str:
        return "+".join(map(str, self.operands))

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.operands)) + "?"

    @property
    def answer(self) -> int:
        return sum(self.operands)


def trace(ex: ArithExample, rng: random.Random | None = None, swap: tuple[bool, ...] | None = None,
          style: int | None = None, width: int = 1) -> str:
    """A correct worked trace for `ex`; phrasing drawn from `rng` unless given (swap per step, spacing
    style: 0 = spaces around '+', 1 = spaces around '=').

    Numbers are zero-padded to `width` digits, so a trace's length depends on neither the values nor the
    phrasing."""
    rng = rng or random.Random(0)
    num = f"{{:0{width}d}}".format
    nsteps = len(ex.operands) - 1
    swap = swap if swap is not None else tuple(rng.random() < 0.5 for _ in range(nsteps))
    style = style if style is not None else int(rng.random() < 0.5)
    if style not in (0, 1):
        raise ValueError(f"style must be 0 (spaces around '+') or 1 (around '='), got {style!r}")
    plus, eq = (" + ", "=") if style == 0 else ("+", " = ")
    acc, steps = ex.operands[0], []
    for i, x in enumerate(ex.operands[1:]):
        lhs, rhs = (x, acc) if swap[i] else (acc, x)
        acc += x
        steps.append(f"{num(lhs)}{plus}{num(rhs)}{eq}{num(acc)}")
    return ",".join(steps) + f"#{num(acc)}"


def final_answer(response: str) -> int | None:
    """The integer after the last '#', or None."""
    if "#" not in response:
        return None
    tail = response.rsplit("#", 1)[1].strip()
    return int(tail) if tail.isdigit() else None


def well_formed(response: str, ex: ArithExample) -> bool:
    """Every step `x+y=z` is true and chains the operands in order, and the answer is right."""
    if final_answer(response) != ex.answer:
        return False
    steps = response.rsplit("#", 1)[0].split(",")
    if len(steps) != len(ex.operands) - 1:
        return False
    acc = ex.operands[0]
    for step, x in zip(steps, ex.operands[1:]):
        m = _STEP.match(step)
        if not m:
            return False
        lhs, rhs, res = map(int, m.groups())
        if {lhs, rhs} != {acc, x} or (lhs, rhs) not in ((acc, x), (x, acc)) or res != acc + x:
            return False
        acc = res
    return True


class SyntheticArithmetic:
    """Generator, splits and exact verifier of the default task (see the module docstring)."""

    name = "synthetic"

    def __init__(self, num_operands: int = 3, max_operand: int = 9, test_fraction: float = 0.2, seed: int = 0,
                 min_operand: int = 1, pad_numbers: bool = True, strict: bool = True,
                 val_fraction: float = 0.0) -> None:
        if num_operands < 2 or not 0 <= min_operand < max_operand or not 0 < test_fraction < 1:
            raise ValueError("need num_operands >= 2, 0 <= min_operand < max_operand and 0 < test_fraction < 1")
        if not 0 <= val_fraction < 1 - test_fraction:
            raise ValueError(f"need 0 <= val_fraction < 1 - test_fraction, got val_fraction {val_fraction} with "
                             f"test_fraction {test_fraction}")
        self.num_operands, self.max_operand = num_operands, max_operand
        self.strict = strict  # the worked trace must be right too, not only the final answer
        # every number in a trace has the width of the largest possible sum: the length of a trace is fixed
        # by its phrasing alone, so parallel decoding never has to guess how many digits a partial sum has
        self.width = len(str(num_operands * max_operand)) if pad_numbers else 1
        self.tokenizer = CharTokenizer(ALPHABET)
        triples = _all_operands(num_operands, min_operand, max_operand)
        # one hash value per tuple: [0, test) -> test, [test, test + val) -> validation, the rest -> train
        h = {t: _hash01(t, seed) for t in triples}
        self.test = [ArithExample(t) for t in triples if h[t] < test_fraction]
        self.val = [ArithExample(t) for t in triples if test_fraction <= h[t] < test_fraction + val_fraction]
        self.train = [ArithExample(t) for t in triples if h[t] >= test_fraction + val_fraction]

    # -- the Task interface ---------------------------------------------------------------------------
    def build_prompt(self, ex: ArithExample) -> str:
        return ex.prompt

    def is_correct(self, response: str, ex: ArithExample) -> bool:
        return well_formed(response, ex) if self.strict else final_answer(response) == ex.answer

    def score(self, response: str, ex: ArithExample) -> float:
        return float(self.is_correct(response, ex))

    # -- data -----------------------------------------------------------------------------------------
    def sft_pair(self, ex: ArithExample, rng: random.Random) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids + EOS) with a random phrasing."""
        tok = self.tokenizer
        return tok.encode(ex.prompt), tok.encode(trace(ex, rng, width=self.width)) + [tok.special_id("<|im_end|>")]

    def max_response_tokens(self) -> int:
        big = ArithExample(tuple([self.max_operand] * self.num_operands))
        return len(trace(big, style=0, swap=(False,) * (self.num_operands - 1), width=self.width)) + 1


def _all_operands(k: int, lo: int, hi: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for _ in range(k):
        out = [t + (x,) for t in out for x in range(lo, hi + 1)]
    return out


def _hash01(t: tuple[int, ...], seed: int) -> float:
    return hash01(f"{seed}:{t}")

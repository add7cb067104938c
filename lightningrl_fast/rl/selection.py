"""Choosing the RL step to keep, on a validation split (`--select-best`), and the split itself.

RL on a few hundred prompts can keep gaining on the prompts it revisits while losing on unseen ones (the
embedded default's seed 0 did before it had a validation split: README "Results", the earlier table). The last
step is then not the model to use, and choosing another one by the held-out test split would leave nothing that
tests the choice. A run with a validation split (`--val-data FILE`, or `--val-fraction F` carved out of the
training prompts by `split_by_hash`) evaluates it greedily before RL, every `--eval-every` steps and at the last
step, and keeps one of them.

The rule (`Selection.offer`): an evaluation qualifies when its validation accuracy is at least the accuracy
before RL minus `--select-margin` (REFERENCE §7's bar: more tokens per forward at an accuracy within a point of
the starting model); among the qualifying ones the highest TPF wins, ties to the higher accuracy, then to the
earlier step. The threshold is fixed by the first evaluation, so deciding at each evaluation whether it beats
the one kept so far gives the same choice as ranking all of them at the end: only the kept step's weights are
ever on disk. The evaluation before RL always qualifies; when no RL step does, the kept model is the starting
one and the run says so.

On disk: `<out>/best-model/` (an SDAR checkpoint folder, written atomically by checkpoint.save_model) and
`<out>/best-model.json` (which step it holds, written after it). The selection state travels in each training
checkpoint; a resumed run keeps the folder only when it holds the step that state names (`reconcile`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .._jsonfile import write_text_atomic
from ..tasks.data import hash01

BEST_DIR, BEST_META = "best-model", "best-model.json"


def split_by_hash(examples: Sequence[Any], fraction: float, salt: str = "val") -> tuple[list, list]:
    """(kept, carved): each example goes to `carved` when a hash of its id (and `salt`) falls below `fraction`,
    so the split does not depend on the order of the rows, on --seed or on the other examples. An example
    without an `id` uses its position."""
    kept, carved = [], []
    for i, ex in enumerate(examples):
        key = str(getattr(ex, "id", None) or f"#{i}")
        (carved if hash01(f"{salt}:{key}") < fraction else kept).append(ex)
    return kept, carved


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One validation evaluation: the RL step it was taken at, greedy accuracy and mean TPF."""

    step: int
    acc: float
    tpf: float


@dataclasses.dataclass
class Selection:
    """The rule of the module docstring, applied one evaluation at a time."""

    margin: float
    start: Candidate | None = None  # the first evaluation (before RL): fixes the accuracy threshold
    best: Candidate | None = None  # the evaluation whose weights are kept

    def offer(self, c: Candidate) -> bool:
        """Record the evaluation `c`; True when it becomes the kept one (the caller saves its weights)."""
        if self.start is None:
            self.start = c
        if c.acc < self.start.acc - self.margin - 1e-9:  # 1e-9: a fraction of examples compares equal to itself
            return False
        if self.best is None or (c.tpf, c.acc, -c.step) > (self.best.tpf, self.best.acc, -self.best.step):
            self.best = c
            return True
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"margin": self.margin, "start": dataclasses.asdict(self.start) if self.start else None,
                "best": dataclasses.asdict(self.best) if self.best else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any], margin: float) -> Selection:
        """From a checkpoint's record; `margin` is this run's (a resumed run may change it: the threshold moves,
        the kept step stays until a later evaluation beats it under the new margin)."""
        def cand(x: dict | None) -> Candidate | None:
            return Candidate(int(x["step"]), float(x["acc"]), float(x["tpf"])) if x else None

        return cls(margin=margin, start=cand(d.get("start")), best=cand(d.get("best")))


def save_best(out: Path, model: Any, tokenizer: Any, sel: Selection) -> Path:
    """Write the kept step's weights to <out>/best-model (atomic) and then <out>/best-model.json. The old record
    goes first, so a crash at any point leaves no record naming weights the folder does not hold. Main rank only."""
    from ..checkpoint import save_model

    assert sel.best is not None
    (out / BEST_META).unlink(missing_ok=True)
    folder = save_model(model, model.config, out / BEST_DIR, tokenizer=tokenizer)
    meta = {**dataclasses.asdict(sel.best), "start": dataclasses.asdict(sel.start) if sel.start else None,
            "margin": sel.margin, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_text_atomic(out / BEST_META, json.dumps(meta, indent=2) + "\n")
    return folder


def saved_step(out: Path) -> int | None:
    """The step <out>/best-model holds according to best-model.json; None when either is missing or unreadable."""
    try:
        meta = json.loads((out / BEST_META).read_text(encoding="utf-8"))
        step = meta["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(step) if isinstance(step, int) and (out / BEST_DIR / "config.json").is_file() else None


def reconcile(out: Path, sel: Selection, say: Callable[[str], None]) -> Selection:
    """A resumed run: keep the recorded choice when <out>/best-model holds its step. Otherwise (the folder was
    overwritten by a later step of the part of the run the resume discards, or a crash came between the folder
    and its record) the choice is dropped, the folder moved aside to <out>/best-model-discarded[-k], and the
    selection continues from the next evaluation with the same threshold. Main rank only (the caller broadcasts
    the result)."""
    if sel.best is None:
        return sel
    on_disk = saved_step(out)
    if on_disk == sel.best.step:
        return sel
    if (out / BEST_DIR).exists():
        dest = out / f"{BEST_DIR}-discarded"
        k = 1
        while dest.exists():
            dest, k = out / f"{BEST_DIR}-discarded-{k}", k + 1
        os.rename(out / BEST_DIR, dest)
        if (out / BEST_META).exists():
            os.rename(out / BEST_META, dest / BEST_META)
        where = f"holds step {on_disk}" if on_disk is not None else "has no readable record"
        say(f"select: {out / BEST_DIR} {where}, not the kept step {sel.best.step}: moved to {dest}; the selection "
            "continues from the next validation evaluation")
    else:
        say(f"select: the kept step {sel.best.step}'s weights are not in {out / BEST_DIR}; the selection continues "
            "from the next validation evaluation")
    return dataclasses.replace(sel, best=None)

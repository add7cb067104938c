"""Tasks: datasets, prompts and verifiers, behind a small registry.

A task turns an `Example` into a prompt string and scores a model response against it:

    task = get_task("math")                 # or "code"
    prompt = task.build_prompt(example)     # ChatML text for the sampler
    reward = task.score(response, example)  # float in [0, 1]
    ok = task.is_correct(response, example) # the verifier's yes/no (the accuracy reward, NLL mask)

``score_batch`` / ``is_correct_batch`` score many pairs at once (the code task runs its sandboxes in
parallel). ``response`` is the generated text only (what follows the prompt).

Adding a task: write a class in ``tasks/<name>.py`` with ``name``, ``build_prompt``, ``score`` and
``is_correct`` (subclassing `Task` gives the batch methods; any class with those four members is
accepted, see `TaskLike`) and register it, either by calling ``register_task("<name>", Cls)`` or by
adding ``"<name>": "lightningrl_fast.tasks.<name>:Cls"`` to ``_BUILTIN`` (imported lazily on first use,
so heavy modules cost nothing until asked for). ``score_batch(task, ...)`` / ``is_correct_batch(task,
...)`` work with either kind.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, Sequence, runtime_checkable

from .data import (
    DataFormatError,
    Example,
    LoadResult,
    RowError,
    build_prompt,
    code_prompt,
    load_examples,
    math_prompt,
)

__all__ = [
    "Task",
    "TaskLike",
    "score_batch",
    "is_correct_batch",
    "MathTask",
    "CodeTask",
    "get_task",
    "register_task",
    "available_tasks",
    "Example",
    "LoadResult",
    "RowError",
    "DataFormatError",
    "load_examples",
    "math_prompt",
    "code_prompt",
    "build_prompt",
]


@runtime_checkable
class TaskLike(Protocol):
    """What the trainer needs from a task (`Task` subclasses and duck-typed classes alike)."""

    name: str

    def build_prompt(self, example: Any) -> str: ...

    def score(self, response: str, example: Any) -> float: ...

    def is_correct(self, response: str, example: Any) -> bool: ...


class Task:
    """Base of every task: ``name``, ``build_prompt``, ``score`` (in [0, 1]) and ``is_correct``."""

    name: str = "task"

    def build_prompt(self, example: Example) -> str:
        raise NotImplementedError

    def score(self, response: str, example: Example) -> float:
        raise NotImplementedError

    def is_correct(self, response: str, example: Example) -> bool:
        return self.score(response, example) >= 1.0

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        _check_pairs(responses, examples)
        return [self.score(r, e) for r, e in zip(responses, examples)]

    def is_correct_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> list[bool]:
        _check_pairs(responses, examples)
        return [self.is_correct(r, e) for r, e in zip(responses, examples)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _check_pairs(responses: Sequence[Any], examples: Sequence[Any]) -> None:
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses for {len(examples)} examples")


class MathTask(Task):
    """Math word problems / competition math: the LightningRL prompt and `verify_math` (1.0 or 0.0)."""

    name = "math"

    def __init__(self, strict: bool = True, timeout_s: float = 5.0, mode: str = "process") -> None:
        self.strict, self.timeout_s, self.mode = strict, timeout_s, mode

    def build_prompt(self, example: Example) -> str:
        return math_prompt(example.prompt)

    def is_correct(self, response: str, example: Example) -> bool:
        from .math import verify_math

        return verify_math(response, example.answer, strict=self.strict, timeout_s=self.timeout_s, mode=self.mode)

    def score(self, response: str, example: Example) -> float:
        return 1.0 if self.is_correct(response, example) else 0.0

    def is_correct_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> list[bool]:
        """`is_correct` of each pair; the symbolic checks de-duplicated and run in parallel (verify_math_batch)."""
        from .math import verify_math_batch

        _check_pairs(responses, examples)
        return verify_math_batch(list(responses), [e.answer for e in examples], strict=self.strict,
                                 timeout_s=self.timeout_s, mode=self.mode)

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        return [1.0 if ok else 0.0 for ok in self.is_correct_batch(responses, examples)]


class CodeTask(Task):
    """MBPP / HumanEval: the code prompt and the sandboxed verifier; score = fraction of tests passed."""

    name = "code"

    def __init__(self, config: Any = None, workers: int | None = None) -> None:
        from .code import SandboxConfig

        self.config = config or SandboxConfig()
        self.workers = workers

    def build_prompt(self, example: Example) -> str:
        return code_prompt(example)

    def run(self, response: str, example: Example):
        """The full `CodeResult` (reason, per-test errors, captured output)."""
        from .code import verify_code

        return verify_code(response, example, self.config)

    def score(self, response: str, example: Example) -> float:
        return self.run(response, example).pass_fraction

    def is_correct(self, response: str, example: Example) -> bool:
        return self.run(response, example).passed

    def run_batch(self, responses: Sequence[str], examples: Sequence[Example]):
        from .code import verify_code_batch

        _check_pairs(responses, examples)
        return verify_code_batch(list(zip(responses, examples)), workers=self.workers, config=self.config)

    def score_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        return [r.pass_fraction for r in self.run_batch(responses, examples)]

    def is_correct_batch(self, responses: Sequence[str], examples: Sequence[Example]) -> list[bool]:
        return [r.passed for r in self.run_batch(responses, examples)]


# name -> "module:Class", imported on first use
_BUILTIN: dict[str, str] = {"synthetic": "lightningrl_fast.tasks.synthetic:SyntheticArithmetic"}
_REGISTRY: dict[str, type] = {"math": MathTask, "code": CodeTask}
_MEMBERS = ("build_prompt", "score", "is_correct")


def register_task(name: str, cls: type) -> None:
    """Make ``get_task(name)`` build ``cls`` (a `Task` subclass or any class with the `TaskLike` members)."""
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in _MEMBERS):
        raise TypeError(f"register_task({name!r}, ...) needs a class with {', '.join(_MEMBERS)}; got {cls!r}")
    _REGISTRY[name] = cls


def available_tasks() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def get_task(name: str, **kwargs: Any) -> TaskLike:
    """A new task object by name (keyword arguments go to its constructor)."""
    if name not in _REGISTRY and name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        register_task(name, getattr(importlib.import_module(module), attr))
    if name not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(available_tasks())}")
    return _REGISTRY[name](**kwargs)


def score_batch(task: TaskLike, responses: Sequence[str], examples: Sequence[Any]) -> list[float]:
    """``task.score_batch`` when the task has one (parallel code sandboxes), else one ``score`` per pair."""
    if hasattr(task, "score_batch"):
        return list(task.score_batch(responses, examples))
    _check_pairs(responses, examples)
    return [float(task.score(r, e)) for r, e in zip(responses, examples)]


def is_correct_batch(task: TaskLike, responses: Sequence[str], examples: Sequence[Any]) -> list[bool]:
    """``task.is_correct_batch`` when the task has one, else one ``is_correct`` per pair."""
    if hasattr(task, "is_correct_batch"):
        return list(task.is_correct_batch(responses, examples))
    _check_pairs(responses, examples)
    return [bool(task.is_correct(r, e)) for r, e in zip(responses, examples)]

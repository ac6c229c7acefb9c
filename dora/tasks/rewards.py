"""Verifiable rewards, pluggable as ``module:function`` or by a built-in's short name (``BUILT_IN``).

A reward function has the signature ``(completion: str, item: dora.tasks.tasks.Item) -> float | dict`` and
returns a finite number (1.0 for a correct answer, 0.0 otherwise, by convention), or a dict of named
components (finite numbers, e.g. ``{"correct": 1.0, "format": 0.2}``): the reward is then the value under
``"reward"`` if there is one, else the components' sum, and the broker writes each component's mean per
train step into metrics.jsonl. ``score`` calls it safely: a function that raises, returns something else,
or runs past its time budget gives reward 0.0 with the reason, and never takes the worker down; the reason
travels to the broker, which counts failures by reason (``dora status``). A function that times out keeps
running in its thread (Python cannot stop it); such threads are counted, so a reward that hangs is
visible in the worker's metrics.

Built in: ``exact``, ``numeric`` and ``math`` compare the final answers of the completion and the
reference (``dora.tasks.verify``: the last ``\\boxed{}``, else after ``####``, else after ``=``, else the
last line) as normalised text, as numbers, or with math-verify (the ``math`` extra); ``exact_match``,
``digits_shaped`` and ``countdown`` score the built-in tasks; ``python_stdout`` runs the completion. A spec
that is an ``http(s)://`` URL is a reward service (``dora.tasks.remote_reward``), called in batches. Several
sources weighed together, a reward model and an LLM judge among them, are ``dora.tasks.combine``'s.
"""

from __future__ import annotations

import ast
import concurrent.futures
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from math import isfinite
from typing import Any, Protocol, runtime_checkable

from dora.config import ConfigError, resolve_callable
from dora.tasks import verify
from dora.tasks.remote_reward import RemoteReward, RewardServiceError
from dora.tasks.tasks import Item

RewardFn = Callable[[str, Item], Any]
"""Returns a finite number, or a dict of named finite numbers (see the module docstring)."""


@runtime_checkable
class Batched(Protocol):
    """A reward that takes calls to answer together (a reward service, a weighted combination holding one)."""

    def __call__(self, completion: str, item: Item) -> Any: ...

    def submit(self, completion: str, item: Item) -> concurrent.futures.Future[Any]: ...


MAX_COMPONENTS = 32
MAX_COMPONENT_NAME = 64
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
_stuck = 0
_lock = threading.Lock()


def answer_text(completion: str) -> str:
    """What the model answered: the text after the last '=' (or all of it), first line, stripped."""
    tail = completion.rsplit("=", 1)[-1]
    return tail.strip().splitlines()[0].strip() if tail.strip() else ""


def exact_match(completion: str, item: Item) -> float:
    return 1.0 if answer_text(completion) == item.answer else 0.0


def digits_shaped(completion: str, item: Item) -> float:
    """A shaped reward for the arithmetic format: the share of the answer's characters that are digits,
    plus 1 for the exact answer. A random tiny model already gets a spread of values, so a run shows a
    learning signal before any warm-start (smoke tests, demos); ``exact_match`` is the real target."""
    text = answer_text(completion)
    if not text:
        return 0.0
    return sum(c.isdigit() for c in text) / len(text) + (1.0 if text == item.answer else 0.0)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"not allowed in an answer: {ast.dump(node)[:60]}")


def countdown(completion: str, item: Item) -> float:
    """1 if the expression uses only the given numbers (each at most once) and equals the target."""
    text = completion.strip().splitlines()[0] if completion.strip() else ""
    if not text or len(text) > 200:
        return 0.0
    try:
        tree = ast.parse(text, mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    pool = list(item.meta["numbers"])
    for n in used:
        if n not in pool:
            return 0.0
        pool.remove(n)
    return 1.0 if value == item.meta["target"] else 0.0


def exact(completion: str, item: Item) -> float:
    """1 if the completion's final answer is the reference's as text: whitespace, a trailing period and
    thousands separators aside, case kept (``dora.tasks.verify``)."""
    return float(verify.exact_equal(verify.final_answer(completion), verify.final_answer(item.answer)))


def numeric(completion: str, item: Item) -> float:
    """1 if both final answers are numbers (3, -2.5, 3/4, 1,234, 50%, 1e-3) and equal: exactly for integers,
    else within a relative 1e-6."""
    return float(verify.numeric_equal(verify.final_answer(completion), verify.final_answer(item.answer)))


def math(completion: str, item: Item) -> float:
    """1 if math-verify finds the final answers equal ("\\frac{1}{2}", "0.5" and "1/2" agree); the ``math``
    extra (math-verify, imported when first called)."""
    return float(verify.math_equal(verify.final_answer(completion), verify.final_answer(item.answer)))


DEFAULT = {"arithmetic": "dora.tasks.rewards:exact_match", "countdown": "dora.tasks.rewards:countdown",
           "dataset": "dora.tasks.rewards:exact"}  # fmt: skip
BUILT_IN = {name: f"dora.tasks.rewards:{name}" for name in
            ("exact", "numeric", "math", "exact_match", "digits_shaped", "countdown", "python_stdout")}  # fmt: skip
"""Short names a reward spec may use instead of ``module:function``."""


def resolve(spec: str, *, service_timeout_s: float = 10.0, service_retries: int = 2, batch_size: int = 32) -> RewardFn:
    """``module:function``, a short name (``BUILT_IN``) or a reward service's ``http(s)://`` URL (a
    ``RemoteReward`` with the given timeout, retries and batch size) -> the function; a clear ConfigError (a
    ValueError) for a bad spec or URL, and for ``math`` when math-verify is not installed."""
    if spec.startswith(("http://", "https://")):
        return RemoteReward(spec, timeout_s=service_timeout_s, retries=service_retries, batch_size=batch_size)
    fn = resolve_callable(BUILT_IN.get(spec, spec), "reward")
    if fn is math and not verify.math_verify_installed():
        raise ConfigError(f"task.reward = \"{spec}\" needs the math extra: pip install 'dora-rl[math]'")
    return fn


@dataclass(frozen=True, slots=True)
class Scored:
    """What one reward call gave."""

    reward: float
    reason: str = ""
    """Empty for a normal score; why the reward is 0.0 otherwise (it raised, timed out, returned junk)."""
    components: dict[str, float] = field(default_factory=dict)
    """The named components when the function returned a dict; empty for a plain number or a failure."""


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and isfinite(value)


def _from_dict(value: dict[Any, Any]) -> Scored:
    if not value:
        return Scored(0.0, "reward returned an empty dict")
    if len(value) > MAX_COMPONENTS:
        return Scored(0.0, f"reward returned {len(value)} components, more than {MAX_COMPONENTS}")
    for name, part in value.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_COMPONENT_NAME:
            return Scored(0.0, f"reward component name {repr(name)[:70]} is not a string of 1 to "
                               f"{MAX_COMPONENT_NAME} characters")  # fmt: skip
        if not _finite(part):
            return Scored(0.0, f"reward component {name!r} is {repr(part)[:60]}, not a finite number")
    components = {name: float(part) for name, part in value.items()}
    reward = components["reward"] if "reward" in components else sum(components.values())
    if not isfinite(reward):
        return Scored(0.0, f"reward components sum to {reward}, not a finite number")
    return Scored(reward, "", components)


def score(fn: RewardFn, completion: str, item: Item, *, timeout_s: float = 5.0) -> Scored:
    """``fn``'s reward for the completion, called in a worker thread within ``timeout_s``: the number it returned,
    or its dict's ``"reward"`` (else the sum) with the components; 0.0 with the reason for anything else."""
    return _collect(_pool.submit(fn, completion, item), timeout_s, count_stuck=True)


def score_many(fn: RewardFn, pairs: list[tuple[str, Item]], *, timeout_s: float = 5.0) -> list[Scored]:
    """``score`` of every (completion, item), in order. A reward service's calls (``RemoteReward``) are all queued
    at once, so they share its batches, and each waits at most ``timeout_s`` from now; any other reward is called
    one by one, exactly as ``score`` does. A weighted combination (``dora.tasks.combine``) is queued the same way."""
    if not isinstance(fn, Batched):
        return [score(fn, completion, item, timeout_s=timeout_s) for completion, item in pairs]
    futures = []
    for completion, item in pairs:
        try:
            futures.append(fn.submit(completion, item))
        except RewardServiceError as e:  # a service's client closed
            futures.append(concurrent.futures.Future())
            futures[-1].set_exception(e)
    deadline = time.monotonic() + timeout_s
    return [_collect(f, max(0.0, deadline - time.monotonic()), count_stuck=False, budget_s=timeout_s)
            for f in futures]  # fmt: skip


def settled(future: concurrent.futures.Future[Any]) -> Scored:
    """A finished call's result as ``score`` gives it: its number, or its dict's reward and components, or 0.0
    with the reason it raised or returned junk."""
    return _collect(future, 0.0, count_stuck=False)


def _collect(future: concurrent.futures.Future[Any], timeout_s: float, *, count_stuck: bool,
             budget_s: float | None = None) -> Scored:  # fmt: skip
    global _stuck
    try:
        value = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        if count_stuck:
            with _lock:
                _stuck += 1
        return Scored(0.0, f"reward timed out after {timeout_s if budget_s is None else budget_s:g} s")
    except Exception as e:  # the reward is user code: any error is a zero, never a crash
        return Scored(0.0, f"reward raised {type(e).__name__}: {str(e)[:200]}")
    if isinstance(value, dict):
        return _from_dict(value)
    if not _finite(value):
        return Scored(0.0, f"reward returned {repr(value)[:60]}, not a finite number")
    return Scored(float(value))


class Sandboxed(Exception):
    """A code reward's program did not end normally (a limit, a signal): reward 0, with this reason."""


def python_stdout(completion: str, item: Item) -> float:
    """A code-execution reward: run the completion as a Python program in the sandbox
    (``dora.tasks.sandbox``); 1.0 if what it prints is the answer, 0.0 if not. A program stopped by a
    limit raises ``Sandboxed`` with the reason, which ``score`` turns into 0.0 with that reason."""
    from dora.tasks import sandbox

    outcome = sandbox.run_python(completion)
    if outcome.reason:
        raise Sandboxed(outcome.reason)
    return 1.0 if outcome.stdout.strip() == item.answer else 0.0


def stuck_reward_calls() -> int:
    return _stuck

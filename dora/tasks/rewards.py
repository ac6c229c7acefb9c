"""Verifiable rewards, pluggable as ``module:function``.

A reward function has the signature ``(completion: str, item: dora.tasks.tasks.Item) -> float`` and
returns a finite number (1.0 for a correct answer, 0.0 otherwise, by convention). ``score`` calls it
safely: a function that raises, returns something that is not a finite number, or runs past its
time budget gives reward 0.0 with the reason, and never takes the worker down. A function that
times out keeps running in its thread (Python cannot stop it); such threads are counted, so a
reward that hangs is visible in the worker's metrics.
"""

from __future__ import annotations

import ast
import concurrent.futures
import math
import operator
import threading
from collections.abc import Callable
from fractions import Fraction

from dora.config import resolve_callable
from dora.tasks.tasks import Item

RewardFn = Callable[[str, Item], float]
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


DEFAULT = {"arithmetic": "dora.tasks.rewards:exact_match", "countdown": "dora.tasks.rewards:countdown"}


def resolve(spec: str) -> RewardFn:
    """``module:function`` -> the function; a clear ValueError (a ConfigError) for a bad spec."""
    return resolve_callable(spec, "reward")


def score(fn: RewardFn, completion: str, item: Item, *, timeout_s: float = 5.0) -> tuple[float, str]:
    """(reward, reason): reason is empty for a normal score; 0.0 with the reason for anything else."""
    global _stuck
    future = _pool.submit(fn, completion, item)
    try:
        value = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        with _lock:
            _stuck += 1
        return 0.0, f"reward timed out after {timeout_s:g} s"
    except Exception as e:  # the reward is user code: any error is a zero, never a crash
        return 0.0, f"reward raised {type(e).__name__}: {str(e)[:200]}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0, f"reward returned {value!r}, not a finite number"
    return float(value), ""


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

"""The environment contract: what a multi-turn task implements, plugged as ``task.env = "module:Class"``.

An episode is one trajectory. The model speaks (an assistant turn, sampled until EOS or one of
``task.turn_end``), the environment answers, the model speaks again, until the environment says done, the
episode reaches ``task.max_turns`` turns or ``task.max_episode_tokens`` tokens. Every assistant turn of an
episode is sampled by the one policy version the episode's group was dispatched on (C1, checked per turn).

A class with:

- ``reset(item) -> messages``: the opening chat turns (a list of ``{"role", "content"}``, e.g. a system
  and a user turn) for ``item`` (``dora.tasks.tasks.Item``: its prompt, answer and meta). It must be a pure
  function of the item: the broker renders the prompt from one instance and the worker that runs the
  episode calls ``reset`` on its own instance, and the two are checked to agree.
- ``step(action) -> (observation, reward, done)``, a coroutine or a plain function: ``action`` is the text
  of the assistant turn just sampled; ``observation`` the chat turns to append (usually one ``tool`` or
  ``user`` turn; empty when done), ``reward`` a finite number or None, ``done`` whether the episode is over.
  The episode's reward is the sum of the rewards returned.

One instance serves one episode: the worker makes a new one per episode (the class is called with no
argument). A coroutine ``step`` runs on the worker's event loop and must not block it; a plain ``step``
runs in a thread pool. Either has ``task.env_timeout_s`` to answer. An environment that raises, times
out or answers something malformed ends its episode with that reason: the episode scores 0, the reason
is counted in the metrics, and its group is still trained whole (C2) unless ``task.env_failure = "mask"``
keeps such episodes out of the loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dora.config import ConfigError, resolve_callable

Messages = list[dict[str, str]]


class EnvError(RuntimeError):
    """An environment broke its contract (raised, timed out, answered something malformed)."""


class Env(Protocol):
    def reset(self, item: Any) -> Sequence[dict[str, str]]: ...
    def step(self, action: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class Answer:
    """An environment's answer to one assistant turn, checked."""

    observation: Messages
    reward: float | None
    done: bool


def resolve(spec: str) -> type:
    """The environment class of ``task.env``; a bad spec is a ConfigError naming it."""
    cls = resolve_callable(spec, "task.env")
    if not isinstance(cls, type):
        raise ConfigError(f"task.env = {spec!r} is not a class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(f"task.env = {spec!r}: the class has no {method}() method")
    return cls


def messages(value: Any, what: str) -> Messages:
    """``value`` as chat turns, or EnvError saying what is wrong with it."""
    if not isinstance(value, (list, tuple)):
        raise EnvError(f"{what} returned {type(value).__name__}, not a list of {{role, content}} turns")
    out = []
    for i, turn in enumerate(value):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise EnvError(f"{what}: turn {i} is not a {{role: str, content: str}} dict: {str(turn)[:80]}")
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def answer(value: Any) -> Answer:
    """A step's return value checked against the contract: ``(observation, reward | None, done)``."""
    if not (isinstance(value, tuple) and len(value) == 3):
        raise EnvError(f"step returned {type(value).__name__}, not (observation, reward, done)")
    obs, reward, done = value
    number = isinstance(reward, (int, float)) and not isinstance(reward, bool)
    if reward is not None and not (number and math.isfinite(reward)):
        raise EnvError(f"step returned reward {reward!r}: a finite number or None is needed")
    if not isinstance(done, bool):
        raise EnvError(f"step returned done = {done!r}: a bool is needed")
    return Answer(messages(obs, "step"), None if reward is None else float(reward), done)

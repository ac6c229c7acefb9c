"""Rewards from several sources, weighted: rules, a reward model, an LLM judge (``task.reward_weights``).

``resolve`` reads a task section's reward sources. Without a reward model or a judge it is ``task.reward`` (or
the task's default) as ``dora.tasks.rewards.resolve`` gives it, unchanged. Otherwise the reward is a ``Combined``:
each source's value is a named component, the reward is ``sum(weight * value)``, and both travel to the broker as
the sample's ``reward_components`` (with the total under ``"reward"``), where each component's mean is written per
train step (metrics.jsonl ``reward_components``, TensorBoard ``train/reward/<name>``).

The sources: ``model`` and ``judge`` are the components of one call to the `dora reward` server
(``task.reward_server``; ``dora.reward``), which scores both in its own batches; any other name is a reward spec as
``task.reward`` takes it (a built-in name, ``module:function``, a reward service URL), whose reward is its value and
whose own components, if it returns a dict, are kept as ``<name>/<component>``. ``submit`` starts every source of a
sample at once (the server's and other services' calls join their batches; rules run in a small thread pool), so a
step's samples are scored together by ``rewards.score_many``. A sample any of whose sources fails scores 0 with that
source's reason: a partial sum would be a reward no one asked for.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Mapping
from math import isfinite
from typing import Any

from dora.config import ConfigError
from dora.config.run import TaskSection
from dora.tasks import rewards
from dora.tasks.remote_reward import RemoteReward, RewardServiceError
from dora.tasks.tasks import Item

SERVED = {"model": "reward_model", "judge": "reward_judge"}
"""The sources `dora reward` serves (the components of its answer), by the task key that sets each."""


class RewardSourceFailed(Exception):
    """One source of a combined reward failed a sample (its reason follows the source's name)."""


class Combined:
    """A weighted sum of reward sources (see the module docstring); a reward function that also batches."""

    def __init__(self, weights: Mapping[str, float], rules: Mapping[str, rewards.RewardFn],
                 server: RemoteReward | None) -> None:  # fmt: skip
        """``weights``: source -> weight; ``rules``: the functions of the sources that are not served; ``server``:
        the `dora reward` client (None when no source is served, or when task.reward_server is unset: then every
        sample fails with the reason)."""
        self.weights = dict(weights)
        self.rules = dict(rules)
        self.server = server
        self.served = tuple(name for name in SERVED if name in self.weights)
        self._rules = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward-source")
        """Where the rule sources run, beside the served ones."""

    def __call__(self, completion: str, item: Item) -> dict[str, float]:
        """The sample's components and ``"reward"`` (blocks until every source answered)."""
        value: dict[str, float] = self.submit(completion, item).result()
        return value

    def submit(self, completion: str, item: Item) -> concurrent.futures.Future[Any]:
        """Start every source on the sample; the future holds its components, or ``RewardSourceFailed``."""
        parts: list[tuple[str, concurrent.futures.Future[Any]]] = []
        if self.served:
            parts.append(("server", self._serve(completion, item)))
        parts += [(name, self._rules.submit(fn, completion, item)) for name, fn in self.rules.items()]
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        left = [len(parts)]
        lock = threading.Lock()

        def one_done(_: concurrent.futures.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                out.set_result(self.combine(parts))
            except RewardSourceFailed as e:
                out.set_exception(e)

        for _, f in parts:
            f.add_done_callback(one_done)
        return out

    def _serve(self, completion: str, item: Item) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any]
        if self.server is None:
            future = concurrent.futures.Future()
            future.set_exception(RewardServiceError("task.reward_server is unset: start `dora reward` and set it to "
                                                    "the URL it prints (`dora run` does both)"))  # fmt: skip
            return future
        try:
            return self.server.submit(completion, item)
        except RewardServiceError as e:  # the client is closed
            future = concurrent.futures.Future()
            future.set_exception(e)
            return future

    def combine(self, parts: list[tuple[str, concurrent.futures.Future[Any]]]) -> dict[str, float]:
        """The finished sources' values, weighted; ``RewardSourceFailed`` naming the first that failed."""
        values: dict[str, float] = {}
        for name, future in parts:
            scored = rewards.settled(future)
            if scored.reason:
                raise RewardSourceFailed(f"{'dora reward' if name == 'server' else name}: {scored.reason}")
            if name != "server":
                values[name] = scored.reward
                values.update({f"{name}/{k}": v for k, v in scored.components.items() if len(name) + len(k) < 64})
                continue
            for served in self.served:
                if served not in scored.components:
                    raise RewardSourceFailed(f"dora reward answered no {served!r} component (is task.{SERVED[served]} "
                                             "set where it runs?)")  # fmt: skip
                values[served] = scored.components[served]
        total = sum(w * values[name] for name, w in self.weights.items())
        if not isfinite(total):
            raise RewardSourceFailed(f"the weighted sum is {total}, not a finite number")
        return {**values, "reward": total}

    def close(self) -> None:
        self._rules.shutdown(wait=False)
        if self.server is not None:
            self.server.close()


def weights(task: TaskSection) -> dict[str, float]:
    """The task's sources and their weights: task.reward_weights, else the one served source set; empty when the
    task's reward is task.reward (or its default) alone."""
    if task.reward_weights:
        return dict(task.reward_weights)
    if task.reward_model is not None:
        return {"model": 1.0}
    if task.reward_judge is not None:
        return {"judge": 1.0}
    return {}


def resolve(task: TaskSection, spec: str | None) -> rewards.RewardFn | None:
    """The task's reward: a ``Combined`` when it has several sources or a served one, else ``spec`` (task.reward
    or the task's default) resolved as ``rewards.resolve`` does; None without any. A bad source is a ConfigError."""

    def rule(spec: str) -> rewards.RewardFn:
        return rewards.resolve(spec, service_timeout_s=task.reward_service_timeout_s,
                               service_retries=task.reward_service_retries,
                               batch_size=task.reward_batch_size)  # fmt: skip

    sources = weights(task)
    if not sources:
        return rule(spec) if spec else None
    rules = {}
    for name in sources:
        if name not in SERVED:
            try:
                rules[name] = rule(name)
            except ConfigError as e:
                raise ConfigError(f"task.reward_weights source {name!r}: {e}") from None
    server = None
    if task.reward_server is not None and any(name in SERVED for name in sources):
        server = RemoteReward(task.reward_server, timeout_s=task.reward_service_timeout_s,
                              retries=task.reward_service_retries, batch_size=task.reward_batch_size)  # fmt: skip
    return Combined(sources, rules, server)


def services(fn: rewards.RewardFn | None) -> dict[str, RemoteReward]:
    """Every reward service client a task's reward holds, by a name that is the same on every worker of the run:
    ``reward_service`` (task.reward a URL, or the one URL source of a combination), ``reward_service_<i>`` (the
    i-th URL source, from 1 in task.reward_weights order, of a combination of several) and ``reward_server`` (the
    `dora reward` client of the model and judge sources)."""
    if isinstance(fn, RemoteReward):
        return {"reward_service": fn}
    if not isinstance(fn, Combined):
        return {}
    remote = [r for r in fn.rules.values() if isinstance(r, RemoteReward)]
    out = {"reward_service" if len(remote) == 1 else f"reward_service_{i}": r for i, r in enumerate(remote, 1)}
    if fn.server is not None:
        out["reward_server"] = fn.server
    return out


SERVICE_COUNTERS = {"calls": "requests", "retries": "retries", "failures": "failures", "samples": "samples",
                    "latency_s_sum": "latency_sum_s"}  # fmt: skip
"""A service's counters as workers report them (``<service>_<what>``), from ``RemoteReward.stats`` (its key)."""


def service_counters(*fns: rewards.RewardFn | None) -> dict[str, float]:
    """The cumulative counters of every reward service the reward functions ``fns`` call (``services``; a worker's
    training rows' and held-out rows' rewards hold a client each: summed by name, a client held twice counted once):
    its POSTs (``calls``, retries included), ``retries``, batches that failed every attempt (``failures``), samples
    sent, seconds waited on its answers (``latency_s_sum``)."""
    out: dict[str, float] = {}
    counted: set[int] = set()
    for fn in fns:
        for name, client in services(fn).items():
            if id(client) in counted:
                continue
            counted.add(id(client))
            stats = client.stats()
            for what, key in SERVICE_COUNTERS.items():
                out[f"{name}_{what}"] = out.get(f"{name}_{what}", 0.0) + float(stats[key])
    return out

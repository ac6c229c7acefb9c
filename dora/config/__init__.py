"""Typed configuration shared by every process.

Each section is a frozen dataclass whose ``__post_init__`` rejects bad values with a message
that names the key, so a user mistake is reported as one line, never as a traceback.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import json
import os
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from dora.ids import Mode

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """Scheduling knobs of the pure core, shared by the broker and the simulator."""

    mode: Mode = Mode.DORA
    """The paradigm: sync, one_step, partial or dora; drop_stale is a peer baseline (in-flight weight swaps,
    over-stale groups dropped) kept to be measured against."""
    max_staleness: int = 1
    """K: a trajectory dispatched on version v is trained at learner version u with u - v <= K.
    Applies to `partial` and `dora`; `sync` is K = 0 and `one_step` is K = 1 by definition."""
    train_groups: int = 8
    """B: groups per train batch (TBS = train_groups x group_size samples), exactly."""
    group_size: int = 4
    """G: samples per prompt; a group runs on one worker and carries one version."""
    rollout_groups: int | None = None
    """Watermark of outstanding (running or queued) groups in the streaming modes (RBS). None = no
    watermark: deadline admission and worker credits alone limit dispatch, so no slot idles while work
    is admissible. A lower value trades throughput for fresher data. The wave modes (sync, one_step)
    dispatch exactly train_groups groups per wave."""
    total_steps: int | None = None
    """Train steps in the run; the core never dispatches more than total_steps x train_groups groups,
    so nothing dispatched is left untrained at the end. None = unbounded."""
    legacy_fill: bool = True
    """dora: fill idle slots of non-newest, non-oldest versions when their deadline is not the next step."""
    drain_load: int = 0
    """dora: the most unfinished samples the orchestrator packs onto one worker of an older (draining) version
    when it re-partitions; that version keeps at least ceil(its unfinished samples / drain_load) of its workers.
    0: as many as the worker's free slots take (the paper's Algorithm 1). A draining version gets no new work,
    so its samples are the ones due first, and a decode step slows with every sequence in the batch: packed
    densely, they finish late and the trainer waits for them. A good value is the batch at which one decode
    step takes twice as long as it does for one sequence: with a step of a + b x n seconds for n sequences,
    a / b (`bench/engines.py` prints tokens/s r(n) at several batch sizes; a step takes n / r(n)). It helps where
    an older version holds a long tail (single-turn long-tailed lengths); where older versions hold most of the
    fleet's work (long multi-turn episodes) it keeps the newest version short of workers, so leave it at 0."""
    kv_rebalance_threshold: float = 0.9
    """dora: a worker reporting KV/slot use at or above this fraction triggers a re-partition."""
    migrate: bool = True
    """False: running groups never move between workers (agent episodes, whose agent talks to one worker's
    endpoint): a worker of an older version keeps its groups until they end and moves when empty; a yielding
    elastic worker keeps its groups paused. True: the orchestrator and elastic workers hand running groups to
    workers of the same version (dora's migration)."""
    max_group_failures: int = 3
    """A group whose generation errors this many times stops the run (it can be neither trained nor dropped)."""
    min_workers: int = 1
    """No group is leased until this many rollout workers have joined and loaded their weights, so that a fleet
    started together shares the first versions instead of the fastest starter taking them all."""
    deadlines: str = "fixed"
    """fixed: a group dispatched on version v must be trained by step v + K. adaptive: its deadline is the
    earliest step in [v + 1, v + K] that admission allows (fresh data while the fleet keeps up), and it is
    moved one step later, never past v + K, only when that lets a waiting trainer take its batch now, and
    not when the elastic workers yielding for that batch would hold a running group paused through the step.
    K stays the hard bound either way; K = 0 is synchronous training in both."""
    filter_uniform: bool = False
    """A group whose rewards are all equal (zero GRPO advantage: no signal) is consumed as filtered when it
    finishes, instead of being trained: counted once, never trained, never lost. The batch still holds exactly
    train_groups groups, filled with other whole groups, and every group filtered lets one more be dispatched
    (beyond total_steps x train_groups). A live run sets it with learner.filter_uniform_groups = "replace" (alone
    it is refused there); `dora sim` reads it here, with workload.uniform_share."""
    max_filtered: int | None = None
    """With filter_uniform: the most groups filtered per train step (None: 4 x train_groups). Past it, the step's
    uniform groups are trained as they are (zero advantage), so a run whose groups all come back uniform (a solved
    task) still makes progress and ends: it dispatches at most total_steps x (train_groups + max_filtered) groups."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ConfigError(f"mode must be one of {', '.join(m.value for m in Mode)}; got {self.mode!r}") from None
        _at_least("max_staleness", self.max_staleness, 0)
        _at_least("train_groups", self.train_groups, 1)
        _at_least("group_size", self.group_size, 1)
        _at_least("max_group_failures", self.max_group_failures, 1)
        _at_least("min_workers", self.min_workers, 1)
        _at_least("drain_load", self.drain_load, 0)
        if self.rollout_groups is not None:
            _at_least("rollout_groups", self.rollout_groups, 1)
        if self.deadlines not in ("fixed", "adaptive"):
            raise ConfigError(f"deadlines must be fixed or adaptive; got {self.deadlines!r}")
        if self.total_steps is not None:
            _at_least("total_steps", self.total_steps, 1)
        if self.max_filtered is not None:
            _at_least("max_filtered", self.max_filtered, 1)
        if not 0.0 < self.kv_rebalance_threshold <= 1.0:
            raise ConfigError(f"kv_rebalance_threshold must be in (0, 1]; got {self.kv_rebalance_threshold}")

    @property
    def staleness(self) -> int:
        """The bound K actually enforced for this mode."""
        if self.mode is Mode.SYNC:
            return 0
        if self.mode is Mode.ONE_STEP:
            return 1
        return self.max_staleness

    @property
    def watermark(self) -> float:
        """Outstanding-group target of the streaming modes (unbounded when rollout_groups is None)."""
        return self.rollout_groups if self.rollout_groups is not None else float("inf")

    @property
    def waves(self) -> bool:
        """sync and one_step dispatch whole batches (waves); partial and dora stream."""
        return self.mode in (Mode.SYNC, Mode.ONE_STEP)

    @property
    def in_flight_swap(self) -> bool:
        """partial and drop_stale load new weights under running requests (C1 is counted, not kept)."""
        return self.mode in (Mode.PARTIAL, Mode.DROP_STALE)

    @property
    def drops_stale(self) -> bool:
        """drop_stale bounds staleness by discarding, not by admission (C2 is counted, not kept)."""
        return self.mode is Mode.DROP_STALE

    @property
    def filter_cap(self) -> int:
        """Groups filtered per train step at most (0: filtering is off)."""
        if not self.filter_uniform:
            return 0
        return self.max_filtered if self.max_filtered is not None else 4 * self.train_groups

    @property
    def prompt_budget(self) -> int | None:
        """Groups the run may dispatch; unbounded when groups can be dropped (they must be replaced). With
        filter_uniform, one more for every group filtered (``dora.core.dispatch.budget_left``)."""
        if self.total_steps is None or self.drops_stale:
            return None
        return self.total_steps * self.train_groups


def _import(module: str) -> Any:
    """``module``, imported; one not found on the path is looked for in the working directory too, as ``python -m``
    would find it (the ``dora`` script's own path does not hold the directory it runs in)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module.partition(".")[0] or here in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(module)


def resolve_callable(spec: str, what: str) -> Callable[..., Any]:
    """``module:function`` -> the function, imported; a ConfigError that starts with ``what`` for a bad spec
    (no colon, a module that does not import, no such attribute, not callable)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{what} {spec!r}: expected 'module:function'")
    try:
        imported = _import(module)
    except ImportError as e:
        raise ConfigError(f"{what} {spec!r}: {e}") from None
    except Exception as e:  # the user's module failed while importing: one line, not a traceback
        raise ConfigError(f"{what} {spec!r}: importing {module} raised {type(e).__name__}: {e}") from None
    fn: Any = imported
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{what} {spec!r}: module {module!r} has no attribute {name!r}")
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return fn


def _at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")


# ---------------------------------------------------------------- loading: defaults < TOML < env < CLI


MOVED = {
    "learner.scale_by_std": "set learner.advantage = 'grpo' (what true meant) or 'dr_grpo' (false)",
    "broker.shutdown_s": "nothing read it; the broker stops at once on SIGTERM, after telling its peers",
    "rollout.slots": "set rollout.max_slots (sequences decoded at once) and rollout.credit_slots (sequences leased "
    "at once) to it",
    "engine.max_slots": "a live worker's decoded sequences are rollout.max_slots ([engine] is the sim engine's "
    "timing model; `dora sim` keeps engine.max_slots)",
    "engine.credit_slots": "a live worker's credit is rollout.credit_slots ([engine] is the sim engine's timing "
    "model; `dora sim` keeps engine.credit_slots)",
}
"""Keys a configuration file may still hold from an earlier dora: each is refused with where its meaning went."""


def build(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Construct the (nested) config dataclass ``cls`` from plain data; unknown keys are errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__} must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for key in unknown:
        if _join(where, key) in MOVED:
            raise ConfigError(f"{_join(where, key)} is gone: {MOVED[_join(where, key)]}")
    if unknown:
        raise ConfigError(f"unknown key {_join(where, unknown[0])!r} (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], _join(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


ENV_PREFIXES = ("DORA_SIM__", "DORA_")
"""The commands' environment prefixes: `dora sim` reads DORA_SIM__SECTION__KEY, every other command
DORA_SECTION__KEY. A variable belongs to the longest prefix it starts with, so one command's settings
are never another's unknown keys."""


def load(
    cls: type[T],
    *,
    path: str | None = None,
    base: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "DORA_",
    overrides: Sequence[str] = (),
) -> T:
    """Resolve a config: defaults, then ``base`` data, then the TOML file, then ``DORA_SECTION__KEY``
    variables, then ``section.key=value`` overrides (from the command line). Every value is type-checked."""
    data: dict[str, Any] = copy.deepcopy(dict(base or {}))
    if path is not None:
        try:
            with open(path, "rb") as f:
                _merge(data, tomllib.load(f))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for name, value in sorted((env or {}).items()):
        owner = max((p for p in (*ENV_PREFIXES, env_prefix) if name.startswith(p)), key=len, default=None)
        if owner == env_prefix and "__" in name:
            _set(data, name[len(env_prefix) :].lower().split("__"), value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set(data, key.strip().split("."), value)
    return build(cls, data)


def to_data(obj: Any) -> Any:
    """A resolved config as plain TOML-able data (None left out: it is every such field's default)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = to_data(getattr(obj, f.name))
            if value is not None:
                out[f.name] = value
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


def toml_value(value: Any) -> str:
    """A plain value (str, bool, int, float, list, mapping) as TOML; mappings become inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def dumps_toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    """Tables of plain values as a TOML document (``None`` values are left out: TOML has no null)."""
    lines = []
    for section, values in data.items():
        lines.append(f"[{_toml_key(section)}]")
        lines.extend(f"{_toml_key(k)} = {toml_value(v)}" for k, v in values.items() if v is not None)
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) else json.dumps(key)


def _merge(into: dict[str, Any], data: Mapping[str, Any]) -> None:
    for k, v in data.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _set(data: dict[str, Any], path: list[str], value: str) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is not a table")
    node[path[-1]] = value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; strings from env/CLI are parsed into it."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return _coerce_union(value, args, where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = tomllib.loads(f"v = {value}")["v"]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        elem = args[0]
        return tuple(_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return {str(k): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, args))}; got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{where} must be one of {', '.join(str(m.value) for m in tp)}; got {value!r}") from None
    return _coerce_scalar(value, tp, where)


def _coerce_union(value: Any, args: tuple[Any, ...], where: str) -> Any:
    """``value`` as the first arm of the union ``args`` it fits; none (or an empty string) where it is optional."""
    empty = value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))
    if empty and type(None) in args:
        return None
    errors = []
    arms = [a for a in args if a is not type(None)]
    for arm in arms:
        try:
            return _coerce(value, arm, where)
        except ConfigError as e:
            errors.append(str(e))
    if len(errors) > 1:  # say every form the key takes, not the first one tried
        raise ConfigError(f"{where} must be {' or '.join(map(_describe, arms))}; got {value!r}")
    raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")


def _coerce_scalar(value: Any, tp: Any, where: str) -> Any:
    """``value`` as a bool, int, float or str (parsed from a string for env/CLI), or as it is for ``Any``."""
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif (tp is str and isinstance(value, str)) or tp is Any:
        return value
    raise ConfigError(f"{where} must be {getattr(tp, '__name__', tp)}; got {value!r}")


def _describe(tp: Any) -> str:
    """A type as a config error names it."""
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return str(getattr(tp, "__name__", tp))

"""A user's dataset as a task: rows from a JSONL or Parquet file or a `datasets` save_to_disk folder.

Reading is the ``datasets`` library's (``Dataset.from_json``, ``Dataset.from_parquet``, ``load_from_disk``),
kept in memory. Each row gives a prompt, either a text column (``task.prompt_field``, sent as one user
turn) or a chat column (``task.messages_field``: a list of {role, content}), and a reference answer
(``task.answer_field``); ``task.system_prompt`` adds a system turn. Every row is checked before any process
starts: a missing column, a row without its prompt or answer, a malformed chat, a non-UTF-8 or broken
JSON line is one error naming the file, the row (or line) and the field. Nothing is skipped silently.

Rows become ``Item``s exactly like the built-in tasks' generated ones, so rewards, rollout and the
learner do not care where a prompt came from.

Epochs (``Epochs``): group ``g`` is position ``g mod N`` of epoch ``g div N`` over the N kept rows, in a
permutation seeded by (task.seed, epoch). The broker hands out group ids in order and never twice, and
re-runs a lost group under the same id (C2), so every kept row is dispatched exactly once per epoch, and a
broker restarted from its journal (which holds the cursor) continues the same permutation.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dora.config import ConfigError

LAYOUTS = "a .jsonl or .json file (JSON lines), a .parquet file, or a folder written by datasets' save_to_disk"


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One dataset row, checked: its messages (the system prompt included) and the reference answer."""

    index: int
    messages: tuple[dict[str, str], ...]
    answer: str


def read_table(path: str, split: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a dataset file or folder as dicts, and its column names."""
    p = pathlib.Path(path)
    if not p.exists():
        raise ConfigError(f"task.dataset: {path}: no such file or folder")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if p.is_dir():
        try:
            data = datasets.load_from_disk(str(p), keep_in_memory=True)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"task.dataset: {path}: not a folder written by datasets' save_to_disk ({e})") from None
        if isinstance(data, datasets.DatasetDict):
            names = sorted(data)
            chosen = split or ("train" if "train" in data else names[0] if len(names) == 1 else None)
            if chosen not in data:
                raise ConfigError(f"task.split: {path} holds the splits {', '.join(names)}; choose one with task.split")
            data = data[chosen]
        elif split is not None:
            raise ConfigError(f"task.split = {split!r}: {path} holds one dataset, not several splits")
        return _rows(data, path), list(data.column_names)
    if split is not None:
        raise ConfigError(f"task.split = {split!r}: {path} is one file (one split); task.split is for a folder")
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ConfigError(f"task.dataset: {path}: unknown layout; use {LAYOUTS}")
    if suffix != ".parquet" and _blank(p):
        raise ConfigError(f"task.dataset: {path} holds no rows")
    with tempfile.TemporaryDirectory(prefix="dora-data-") as cache:
        try:
            if suffix == ".parquet":
                data = datasets.Dataset.from_parquet(str(p), keep_in_memory=True, cache_dir=cache)
            else:
                data = datasets.Dataset.from_json(str(p), keep_in_memory=True, cache_dir=cache)
            return data.to_list(), list(data.column_names)
        except Exception as e:  # the libraries' errors name no line: find it, or pass their words on
            raise ConfigError(f"task.dataset: {path}: {_json_fault(p) if suffix != '.parquet' else e}") from None


def _rows(data: Any, path: str) -> list[dict[str, Any]]:
    try:
        return data.to_list()
    except UnicodeDecodeError as e:
        raise ConfigError(f"task.dataset: {path}: a text that is not UTF-8 ({e.reason} at byte {e.start})") from None


def _blank(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return not any(raw.strip() for raw in f)


def _json_fault(path: pathlib.Path) -> str:
    """Which line of a JSON-lines file cannot be read, and why."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 (byte {e.start})"
            if text.strip():
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    return f"line {number} is not JSON ({e.msg} at column {e.colno})"
                if not isinstance(value, dict):
                    return f"line {number} is a JSON {type(value).__name__}, not an object"
    return "the file cannot be read as JSON lines"


def check_rows(
    raw: Sequence[dict[str, Any]],
    columns: Sequence[str],
    *,
    where: str,
    prompt_field: str,
    messages_field: str | None,
    answer_field: str,
    system_prompt: str | None,
) -> list[Row]:
    """Every row checked and turned into messages and an answer; the first fault is one ConfigError."""
    if not raw:
        raise ConfigError(f"task.dataset: {where} holds no rows")
    field_key = "messages_field" if messages_field else "prompt_field"
    prompt_column = messages_field or prompt_field
    for key, column in ((field_key, prompt_column), ("answer_field", answer_field)):
        if column not in columns:
            raise ConfigError(f"task.{key} = {column!r}: {where} has no such column (columns: {', '.join(columns)})")
    system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
    rows = []
    for i, r in enumerate(raw):
        at = f"{where} row {i}"
        answer = r.get(answer_field)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise ConfigError(f"{at}: no answer in column {answer_field!r}")
        if isinstance(answer, dict | list):
            raise ConfigError(f"{at}: column {answer_field!r} holds a {type(answer).__name__}, not a text or number")
        value = r.get(prompt_column)
        if messages_field:
            turns = _messages(value, at, messages_field)
        elif not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{at}: column {prompt_field!r} must hold the prompt text; got {_show(value)}")
        else:
            turns = ({"role": "user", "content": value},)
        rows.append(Row(index=i, messages=system + turns, answer=str(answer)))
    return rows


def _messages(value: Any, at: str, column: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{at}: column {column!r} must hold a list of {{role, content}} turns; got {_show(value)}")
    turns = []
    for j, turn in enumerate(value):
        ok = isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
        if not ok:
            raise ConfigError(f"{at}: column {column!r} turn {j} must be {{role, content}} texts; got {_show(turn)}")
        turns.append({"role": turn["role"], "content": turn["content"]})
    return tuple(turns)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Epochs:
    """Group id -> row: position ``g mod N`` of a permutation of the N kept rows seeded by (seed, epoch)."""

    def __init__(self, kept: Sequence[int], seed: int) -> None:
        if not kept:
            raise ConfigError("task.dataset: every row was filtered out (task.max_prompt_tokens)")
        self.kept = np.asarray(kept, dtype=np.int64)
        self.seed = seed
        self._order: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.kept)

    def epoch_of(self, group: int) -> int:
        return group // len(self.kept)

    def order(self, epoch: int) -> np.ndarray:
        """The rows of an epoch in dispatch order."""
        if epoch not in self._order:
            if len(self._order) > 4:
                self._order.clear()
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.kept))
            self._order[epoch] = self.kept[perm]
        return self._order[epoch]

    def row(self, group: int) -> int:
        return int(self.order(self.epoch_of(group))[group % len(self.kept)])


def kept_rows(rows: Sequence[Row], length: Callable[[Row], int], max_tokens: int | None) -> tuple[list[int], list[int]]:
    """(kept, filtered) row indices: a row whose rendered prompt is longer than ``max_tokens`` is filtered."""
    if max_tokens is None:
        return [r.index for r in rows], []
    kept: list[int] = []
    filtered: list[int] = []
    for r in rows:
        (kept if length(r) <= max_tokens else filtered).append(r.index)
    return kept, filtered

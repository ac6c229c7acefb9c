"""Identifier types and enums shared by the wire protocol and the pure core."""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import NewType

WorkerId = NewType("WorkerId", str)
"""A rollout worker (one inference-engine replica, i.e. one DP group)."""

GroupId = NewType("GroupId", int)
"""Position of a prompt group in the run's prompt stream (epoch-major)."""

AttemptId = NewType("AttemptId", int)
"""Fencing token of one lease; fresh for every lease, never reused within a broker epoch."""


class Mode(StrEnum):
    """Training paradigm; all four are policies over the same core."""

    SYNC = "sync"
    ONE_STEP = "one_step"
    PARTIAL = "partial"
    DORA = "dora"
    DROP_STALE = "drop_stale"
    """Peer baseline: in-flight weight swaps and no admission bound; over-stale groups are dropped
    at consumption (breaks C1 and C2; measured to show the length bias of dropping)."""


class Finish(IntEnum):
    """Why a sample stopped."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

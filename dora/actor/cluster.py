"""Where this process runs: Slurm's and torchrun's variables, read in exactly one place.

``ClusterInfo.from_env(os.environ)`` is called once in each process's ``main``; everything else takes
the resulting object. Nothing else in dora reads ``SLURM_*`` (a test checks this), so what a process
learns from the launcher is written down here:

- Slurm: the job id, how many times the job was requeued (``SLURM_RESTART_COUNT``), the task's global
  rank (``SLURM_PROCID``), its rank on the node (``SLURM_LOCALID``), the step's task count and nodes
  (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``: set inside an srun step only).
- torchrun: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (they win over
  Slurm's when both are set: torchrun started inside an srun step sets them per worker).

A learner started by ``srun`` (one task per rank) needs a rendezvous address that no one exported: the
first node of its step, and a port derived from the job id, so every rank of one job agrees on it
and two jobs sharing a node do not collide.
"""

from __future__ import annotations

import itertools
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

RENDEZVOUS_PORT_BASE = 20_000
RENDEZVOUS_PORT_SPAN = 20_000


def expand_hostlist(hostlist: str) -> tuple[str, ...]:
    """Slurm's compressed host list as names: ``gpu[01-03,07],cpu1`` -> gpu01 gpu02 gpu03 gpu07 cpu1.

    Ranges keep their zero padding; several bracket groups in one name expand as their product
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), as Slurm's own ``scontrol show hostnames`` does."""
    names: list[str] = []
    for item in _split_top_level(hostlist):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], hostlist))
            elif part:
                choices.append([part])
        names.extend("".join(p) for p in itertools.product(*choices))
    return tuple(names)


def _split_top_level(hostlist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"bad Slurm host list {hostlist!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"bad Slurm host list {hostlist!r}: unbalanced '['")
    items.append(hostlist[start:])
    return [x.strip() for x in items if x.strip()]


def _expand_ranges(spec: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for piece in spec.split(","):
        low, sep, high = piece.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad Slurm host list {hostlist!r}: range {piece!r}")
        if not sep:
            out.append(low)
            continue
        width = len(low)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def _int(environ: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer; got {value!r}") from None
    return default


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterInfo:
    host: str
    """This node's name (``SLURMD_NODENAME`` under Slurm, else the host name)."""
    job_id: str | None = None
    """``SLURM_JOB_ID``; None outside Slurm."""
    restart_count: int = 0
    """Times Slurm requeued or restarted this job (``SLURM_RESTART_COUNT``; 0 on the first attempt)."""
    step_id: str | None = None
    rank: int = 0
    """Global rank of this process among the learner's ranks (``RANK``, else ``SLURM_PROCID``)."""
    local_rank: int = 0
    """Rank on this node (``LOCAL_RANK``, else ``SLURM_LOCALID``): the accelerator this process uses."""
    world: int = 1
    """Ranks in the process group (``WORLD_SIZE``, else the srun step's task count). A batch shell or an
    salloc session has ``SLURM_NTASKS`` too, but a process started there is one rank, not the allocation."""
    step_nodes: tuple[str, ...] = ()
    """Nodes of this job step, expanded (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host for torch.distributed: ``MASTER_ADDR``, else the step's first node under Slurm."""
    master_port: int = 29_500
    """Rendezvous port: ``MASTER_PORT``, else one derived from the Slurm job id, else 29500."""

    @property
    def under_slurm(self) -> bool:
        return self.job_id is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ClusterInfo:
        """Read the launcher's variables. A malformed value is a ValueError naming the variable."""
        job_id = environ.get("SLURM_JOB_ID") or None
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
        nodes = expand_hostlist(nodelist) if nodelist else ()
        host = environ.get("SLURMD_NODENAME") or socket.gethostname()
        if job_id is not None and not job_id.isdigit():
            raise ValueError(f"SLURM_JOB_ID must be a number; got {job_id!r}")
        default_port = RENDEZVOUS_PORT_BASE + int(job_id) % RENDEZVOUS_PORT_SPAN if job_id else 29_500
        return cls(
            host=host,
            job_id=job_id,
            restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0),
            step_id=environ.get("SLURM_STEP_ID") or None,
            rank=_int(environ, "RANK", "SLURM_PROCID", default=0),
            local_rank=_int(environ, "LOCAL_RANK", "SLURM_LOCALID", default=0),
            world=_int(environ, "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", default=1),
            step_nodes=nodes,
            master_addr=environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
            master_port=_int(environ, "MASTER_PORT", default=default_port),
        )

    def log_fields(self) -> dict[str, object]:
        """What every log line of this process carries about where it runs."""
        fields: dict[str, object] = {"host": self.host}
        if self.job_id is not None:
            fields.update(slurm_job_id=self.job_id, slurm_restart=self.restart_count)
        return fields

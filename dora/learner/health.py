"""A step's health numbers: what a practitioner watches to tell a healthy run from one about to diverge.

- ``Tally``: the sums and maxima a step accumulates over its micro-batches (on each rank), combined over ranks by
  two all-reduces (``reduce``) and turned into means by token counts (``mean``).
- ``batch_health``: what the batch itself says, the same on every rank: response length (mean, p50, p95, max, in
  tokens the model sampled or the episode holds), the share truncated at ``max_tokens`` (``finish`` LENGTH), the
  share of uniform groups (all rewards equal: no signal).
- ``mismatch``: the engine-learner gap on tokens of staleness 0 (sampled by the version the learner holds, so the
  same weights on both sides and the gap is numerics alone, apart from staleness): ``|logp_learner - logp_engine|``
  summed, the k3 estimate of KL(mu || pi_learner) ``r - 1 - log r`` with ``r = pi_learner / mu`` summed, and the
  largest ``|p_learner - p_engine|`` of one token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from dora.ids import Finish
from dora.samples import Batch


class Tally:
    """Sums and maxima of one step on one rank; ``reduce`` makes them the whole batch's."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.highs: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] += value

    def high(self, key: str, value: float) -> None:
        self.highs[key] = max(self.highs.get(key, float("-inf")), value)

    def reduce(self, world: int, device: torch.device, sum_keys: Sequence[str], high_keys: Sequence[str]) -> None:
        """Every rank's sums added and maxima taken (a collective: every rank calls it with the same keys)."""
        if world == 1:
            return
        import torch.distributed as dist

        sums = torch.tensor([self.sums[k] for k in sum_keys], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        highs = torch.tensor([self.highs.get(k, float("-inf")) for k in high_keys], dtype=torch.float64,
                             device=device)  # fmt: skip
        dist.all_reduce(highs, op=dist.ReduceOp.MAX)
        self.sums.update(zip(sum_keys, sums.tolist(), strict=True))
        self.highs.update(zip(high_keys, highs.tolist(), strict=True))

    def mean(self, key: str, weight: str, default: float = 0.0) -> float:
        n = self.sums.get(weight, 0.0)
        return self.sums[key] / n if n else default

    def highest(self, key: str, default: float) -> float:
        v = self.highs.get(key, float("-inf"))
        return v if v != float("-inf") else default


def batch_health(batch: Batch, uniform: torch.Tensor) -> dict[str, float]:
    """Length, truncation and uniform-group shares of a batch (``uniform``: per group, all rewards equal)."""
    lengths = np.array([len(s.token_ids) for g in batch.groups for s in g.samples], dtype=np.float64)
    truncated = [s.finish == Finish.LENGTH for g in batch.groups for s in g.samples]
    if not len(lengths):
        return {}
    return {
        "length_mean": float(lengths.mean()),
        "length_p50": float(np.percentile(lengths, 50)),
        "length_p95": float(np.percentile(lengths, 95)),
        "length_max": float(lengths.max()),
        "truncated_share": float(np.mean(truncated)),
        "uniform_share": float(uniform.float().mean()),
    }


def mismatch(tally: Tally, logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
             fresh: torch.Tensor) -> None:  # fmt: skip
    """Add the engine-learner gap of the staleness-0 rows (``fresh``, bool [B]) of a scored micro-batch to ``tally``:
    ``logp`` is the learner's log-prob at the weights the batch started with, ``behaviour`` the engine's."""
    with torch.no_grad():
        live = (mask > 0) & fresh[:, None].to(mask.device)
        if not live.any():
            return
        lrn, eng = logp[live].double(), behaviour[live].double()
        log_r = lrn - eng
        tally.add("mismatch_tokens", float(live.sum()))
        tally.add("mismatch_abs", float(log_r.abs().sum()))
        tally.add("mismatch_kl", float((log_r.exp() - 1 - log_r).sum()))
        tally.high("mismatch_prob_max", float((lrn.exp() - eng.exp()).abs().max()))

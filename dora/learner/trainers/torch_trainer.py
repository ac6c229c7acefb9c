"""The torch trainer: a train batch in ``mini_batches x epochs`` optimizer steps on a transformers model, then a
published version.

Per batch:
1. Every trajectory's advantage comes from its group's rewards (``dora.learner.loss``: GRPO, Dr. GRPO, RLOO,
   REINFORCE++).
2. The batch's groups are cut into mini-batches of whole groups, passed over ``epochs`` times
   (``dora.learner.schedule``). With more than one optimizer step, the batch is first scored without gradients at
   its starting weights: the proximal policy's log-probs (``_proximal``).
3. In each mini-batch the trajectories are assigned to ranks (``learner.balance``: by tokens, or every world-th)
   and each rank cuts its share into micro-batches, a group's samples together, groups by length:
   ``micro_batch`` trajectories each, or as many as fit ``micro_batch_tokens`` (``dora.balance``).
4. The model scores the sampled tokens under the distribution the engines sampled from (temperature and top-p
   nucleus), each distinct prompt run once per micro-batch (``dora.learner.trainers.forward``), a chunk of
   positions at a time: no float32 tensor of the whole vocabulary at every position is ever made
   (``dora.learner.scoring``). The same pass gives each position's entropy and the whole-vocabulary log-prob, for
   the entropy bonus and the KL term (the reference scored likewise: a frozen copy, or the LoRA model with its
   adapters off). The clipped surrogate plus the regularisers is back-propagated, and micro-batches are weighted
   so the accumulated gradient equals the mini-batch's.
5. One AdamW step per mini-batch at the schedule's learning rate. After the last, ``publish`` writes the new version
   to the weight store: a model folder (the start folder's config, generation config and tokenizer beside the
   weights) in ``publish_dtype``, each tied tensor once (``dora.hf.tensors``). Between steps the weights are
   offloaded, checkpointed, restored or adopted (``dora.learner.trainers.weights``).

With one mini-batch, one epoch and no correction the step is the one this trainer took before mini-batches
existed, bit for bit. The step's metrics include its health (``dora.learner.health``).

The model is built as `dora sft` builds its own (``dora.learner.setup``). Single process, or sharded with FSDP2 when
a process group of several ranks is initialised (each decoder block the model declares in ``_no_split_modules`` is a
shard unit, then the root; gradients are reduced by FSDP, metrics by an all-reduce). With
``activation_checkpointing`` each decoder block's activations are recomputed in the backward (transformers' gradient
checkpointing, non-reentrant), and samples are scored as whole rows: a block replayed on a shared prompt's cache
would write it twice. A step's metrics include its speed (``dora.learner.throughput``: tokens per second, MFU) and
how evenly the ranks' tokens were spread.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from dora.balance import plan
from dora.hf import lora as adapters
from dora.hf.tensors import padding_gap
from dora.learner.health import Tally, batch_health, mismatch
from dora.learner.logprobs import Stats
from dora.learner.loss import (SUMMED, LossConfig, LossFn, advantages, checked, policy_loss, regularizers, takes_prox,
                               uniform_groups)  # fmt: skip
from dora.learner.schedule import LrSchedule, mini_batches
from dora.learner.scoring import Scorer
from dora.learner.setup import adapt, load_model, optimizer, shard, trainable
from dora.learner.throughput import flop_params, peak_tflops, speed
from dora.learner.trainers.forward import Row, score
from dora.learner.trainers.torch_config import TrainerConfig
from dora.learner.trainers.weights import Weights
from dora.samples import Batch, TrainSample
from dora.store import WeightStore
from dora.store.snapshot import HostSnapshot


def trained_tokens(s: TrainSample) -> int:
    """The tokens of a trajectory the loss sees: the model's own (an episode's environment tokens are not)."""
    return len(s.token_ids) if s.loss_mask is None else int(s.loss_mask.sum())


def _takes_prox(loss: LossConfig, loss_fn: LossFn) -> bool:
    """Whether ``loss_fn`` is given the proximal log-probs; a loss that cannot take them while ``loss`` asks for the
    correction is a ConfigError."""
    takes = takes_prox(loss_fn)
    if loss.decoupled and not takes:
        from dora.config import ConfigError

        raise ConfigError(f"learner.is_cap / learner.is_mask: the loss {loss_fn.__module__}:{loss_fn.__qualname__} "
                          "takes no logp_prox keyword, so it cannot apply the correction")  # fmt: skip
    return takes


class TorchTrainer(Weights):
    keeps_weights = True

    def __init__(self, model_dir: str | pathlib.Path, store: WeightStore, loss: LossConfig, cfg: TrainerConfig,
                 *, device: str = "cpu", loss_fn: LossFn = policy_loss) -> None:  # fmt: skip
        """Under an initialised process group of more than one rank the model is sharded with FSDP2
        (``fully_shard`` per decoder layer, then the root): every rank must then call ``train`` and
        ``publish`` with the same batch, each working on its share of the trajectories. ``loss_fn`` is
        called as ``policy_loss`` is, per micro-batch (the contract is in ``dora.learner.loss``)."""
        import torch.distributed as dist

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.device = torch.device(device)
        self.model_dir = str(model_dir)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.bf16 = cfg.dtype == "bfloat16"
        self.model = load_model(self.model_dir).to(self.device)
        adapted = adapt(self.model, cfg.lora)
        self.copies = adapted.copies
        self.lora = adapted.lora
        self.initial_adapters = {n: p.detach().clone() for n, p in self.model.named_parameters()
                                 if self.lora is not None and p.requires_grad}  # fmt: skip
        self.whole_rows = padding_gap(self.model) is not None or cfg.activation_checkpointing
        """Its sequences cannot be batched by left padding (layers that keep a state, or positions padding moves),
        or its blocks are checkpointed (a replay would write a shared prompt's cache twice): each sample is scored
        as one whole row, its prompt included (``dora.learner.trainers.forward``)."""
        self.scorer = Scorer(self.model, temperature=cfg.temperature, top_p=cfg.top_p,
                             chunk_bytes=cfg.logprob_chunk_bytes)  # fmt: skip
        """Log-probs from the last hidden states through the output embedding, or from the logits when the model's
        logits are something else; a chunk of positions at a time either way."""
        self.flop_params = flop_params(self.model)
        self.peak_tflops = peak_tflops(cfg.peak_tflops, self.device)
        self.fed_tokens = 0
        """Tokens the model's forward has run this step (prompts and completions, this rank)."""
        self.publish_dtype = getattr(torch, cfg.publish_dtype)
        self.beside = self._beside()
        self.trained_steps = 0
        self.reference = self._reference_model(loss)
        """KL's reference, the start model (with a KL term only): with LoRA the model itself with its adapters
        off (``None`` here); with full weights a frozen copy, on the learner's device (sharded as the model is)."""
        self._wrap()
        self.reference_scorer = None if self.reference is None else Scorer(
            self.reference, temperature=cfg.temperature, chunk_bytes=cfg.logprob_chunk_bytes)  # fmt: skip
        self.opt = optimizer(trainable(self.model), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.schedule = LrSchedule(lr=cfg.lr, kind=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                   min_lr_ratio=cfg.min_lr_ratio,
                                   total_steps=None if cfg.total_steps is None else
                                   cfg.total_steps * self.steps_per_batch)  # fmt: skip
        self.store = store
        self.host = HostSnapshot(shard_bytes=store.shard_bytes)
        self.loss_cfg = loss
        self.loss_fn = loss_fn
        self.takes_prox = _takes_prox(loss, loss_fn)
        """Whether the loss is given the proximal log-probs (``logp_prox=``): the built-in one, or one that asks."""
        self.offloads = cfg.offload_between_steps and self.device.type == "cuda"
        self.offloaded = False
        self.parking = self._parking()

    def _wrap(self) -> None:
        """The model (and a KL reference copy) made ready to train: gradient checkpointing (the reference is
        copied before, and never checkpoints), FSDP2 over several ranks, and each module's mode: scored as the
        engines sample, so no dropout (GPT-2's configs set 0.1; gradients still flow), but LoRA's own dropout where
        asked for, and checkpointed blocks in training mode (a block checkpoints only then; its dropout stays off)."""
        if self.cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        modules = [self.model] if self.reference is None else [self.model, self.reference]
        shard(modules, device=self.device, world=self.world, bf16=self.bf16)
        self.model.eval()
        if self.cfg.lora is not None and self.cfg.lora.dropout > 0:
            for name, module in self.model.named_modules():
                if name.endswith(f"lora_dropout.{adapters.NAME}"):
                    module.train()
        if self.cfg.activation_checkpointing:
            from transformers.modeling_layers import GradientCheckpointingLayer

            for module in self.model.modules():
                if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
                    module.training = True

    # ------------------------------------------------------------------ steps

    def _reference_model(self, loss: LossConfig) -> torch.nn.Module | None:
        """A frozen copy of the start model for the KL term, or None (no KL term, or LoRA: its adapters go off)."""
        if loss.kl_coef <= 0 or self.lora is not None:
            return None
        import copy

        reference = copy.deepcopy(self.model)
        reference.requires_grad_(False)
        return reference.eval()

    @contextlib.contextmanager
    def _adapters_off(self) -> Iterator[None]:
        """The LoRA model as the start model: every adapter layer off, then on again."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [mod for mod in self.model.modules() if isinstance(mod, BaseTunerLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def _reference_logp(self, rows: list[Row]) -> torch.Tensor | None:
        """The reference's log-probs of the rows' sampled tokens over the tempered vocabulary ([B, T], no gradient),
        when the loss has a KL term."""
        if self.loss_cfg.kl_coef <= 0:
            return None
        fed = self.fed_tokens
        with torch.no_grad():
            if self.reference is not None:
                assert self.reference_scorer is not None
                stats, _, _ = self._score(rows, self.reference, self.reference_scorer)
            else:
                with self._adapters_off():
                    stats, _, _ = self._score(rows)
        self.fed_tokens = fed  # work done, but not a training pass
        return stats.full

    @property
    def steps_per_batch(self) -> int:
        return self.cfg.mini_batches * self.cfg.epochs

    def train(self, batch: Batch) -> dict[str, float]:
        """One train batch: ``mini_batches x epochs`` optimizer steps (``dora.learner.schedule``), the last one's
        weights published after. The step's metrics are the batch's (every optimizer step's, every rank's)."""
        self._onload()
        started = time.perf_counter()
        rows = [(g.prompt_ids.tolist(), s, gi) for gi, g in enumerate(batch.groups) for s in g.samples]
        rewards = torch.tensor([s.reward for _, s, _ in rows], dtype=torch.float64)
        groups = torch.tensor([gi for _, _, gi in rows])
        adv = advantages(rewards, groups, self.loss_cfg.advantage, eps=self.loss_cfg.eps)
        flat = uniform_groups(rewards, groups)
        keep = ~flat[groups] if self.loss_cfg.filter_uniform_groups else torch.ones(len(rows), dtype=torch.bool)
        keep &= torch.tensor([trained_tokens(s) > 0 for _, s, _ in rows])  # an episode masked whole trains nothing
        fresh = torch.tensor([batch.groups[gi].version == batch.step for _, _, gi in rows])
        sizes = [len(p) + len(s.token_ids) for p, s, _ in rows]
        tally = Tally()
        self.fed_tokens = 0
        # several optimizer steps: the proximal policy (the weights now) scored first, for the clip, the correction
        # and the engine-learner gap; with one, the step's own pass is at those weights
        prox = self._proximal(rows, sizes, fresh, tally) if self.steps_per_batch > 1 else None
        lr = self.cfg.lr
        for epoch in range(self.cfg.epochs):
            for part in mini_batches(len(batch.groups), self.cfg.mini_batches, epoch=epoch, seed=self.cfg.seed,
                                     step=batch.step):  # fmt: skip
                chosen = set(part)
                index = [i for i, (_, _, gi) in enumerate(rows) if gi in chosen]
                k = batch.step * self.steps_per_batch + int(tally.sums["optimizer_steps"])
                lr = self.schedule.at(k)
                self._optimizer_step(rows, index, sizes, adv, keep, fresh, prox, tally, lr)
        self.trained_steps += 1
        tally.add("fed", float(self.fed_tokens))
        tally.reduce(self.world, self.device, ["loss", "tokens", "fed", "clip_fraction", "ratio_mean", *SUMMED,
                                               "entropy", "kl_ref", "kept_tokens", "mismatch_tokens", "mismatch_abs",
                                               "mismatch_kl"],
                     ["ratio_max", "ratio_min_neg", "is_weight_max", "mismatch_prob_max"])  # fmt: skip
        train_s = time.perf_counter() - started
        return self._metrics(batch, tally, rewards, flat, lr, train_s)

    def _metrics(self, batch: Batch, tally: Tally, rewards: torch.Tensor, flat: torch.Tensor, lr: float,
                 train_s: float) -> dict[str, float]:  # fmt: skip
        steps = max(tally.sums["optimizer_steps"], 1)
        tokens = tally.sums["tokens"]
        out = {
            "loss": tally.sums["loss"] / steps,
            "reward_mean": float(rewards.mean()),
            "clip_fraction": tally.mean("clip_fraction", "tokens"),
            "ratio_mean": tally.mean("ratio_mean", "tokens", 1.0),
            "ratio_min": -tally.highest("ratio_min_neg", -1.0) if tokens else 1.0,
            "ratio_max": tally.highest("ratio_max", 1.0) if tokens else 1.0,
            "grad_norm": tally.sums["grad_norm"] / steps,
            "filtered_groups": float(flat.sum()) if self.loss_cfg.filter_uniform_groups else 0.0,
            "tokens": float(sum(len(s.token_ids) for g in batch.groups for s in g.samples)),
            "train_s": train_s,
            **speed(tally.sums["fed"], train_s, params=self.flop_params, ranks=self.world, peak=self.peak_tflops),
            "micro_batches": tally.sums["micro_batches"],
            "rank_imbalance": tally.highest("rank_imbalance", 1.0),
            "optimizer_steps": steps,
            "lr": lr,
            "clip_low_fraction": tally.mean("clip_low_fraction", "tokens"),
            "clip_high_fraction": tally.mean("clip_high_fraction", "tokens"),
            "entropy": tally.mean("entropy", "kept_tokens"),
            **batch_health(batch, flat),
        }
        if self.loss_cfg.decoupled:
            out.update(is_weight_mean=tally.mean("is_weight_mean", "tokens", 1.0),
                       is_weight_max=tally.highest("is_weight_max", 1.0),
                       is_corrected=tally.mean("is_corrected", "tokens"))  # fmt: skip
        if self.loss_cfg.kl_coef > 0:
            out["kl_ref"] = tally.mean("kl_ref", "kept_tokens")
        if tally.sums["mismatch_tokens"]:
            out.update(mismatch_abs=tally.mean("mismatch_abs", "mismatch_tokens"),
                       mismatch_kl=tally.mean("mismatch_kl", "mismatch_tokens"),
                       mismatch_prob_max=tally.highest("mismatch_prob_max", 0.0),
                       mismatch_tokens=tally.sums["mismatch_tokens"])  # fmt: skip
        return out

    def _plan(self, index: list[int], sizes: list[int], rows: list[Row]) -> Any:
        """This rank's micro-batches of the rows ``index`` (as indices into ``rows``), a group's samples together,
        groups in order of their longest sample: little padding. The accumulated gradient depends on neither the
        share nor the order."""
        step = plan([sizes[i] for i in index], [rows[i][2] for i in index], rank=self.rank, world=self.world,
                    balance=self.cfg.balance, micro_batch=self.cfg.micro_batch,
                    micro_batch_tokens=self.cfg.micro_batch_tokens)  # fmt: skip
        return step, [[index[j] for j in part] for part in step.micro_batches]

    def _proximal(self, rows: list[Row], sizes: list[int], fresh: torch.Tensor,
                  tally: Tally) -> dict[int, torch.Tensor]:  # fmt: skip
        """Every row's log-probs at the weights the batch starts with (per row, its sampled positions; no
        gradient), and the engine-learner gap of its staleness-0 rows into ``tally``. Sharded, each rank scores its
        share, and one all-reduce gives every rank every row's (a later mini-batch may put a row on another rank)."""
        lengths = [len(s.token_ids) for _, s, _ in rows]
        starts = [0, *itertools.accumulate(lengths)]
        flat = torch.zeros(starts[-1], dtype=torch.float32, device=self.device)
        _, parts = self._plan(list(range(len(rows))), sizes, rows)
        fed = self.fed_tokens
        with torch.no_grad():
            for part in parts:
                if not part:  # sharded: every rank runs as many forwards
                    self._score([rows[min(range(len(rows)), key=sizes.__getitem__)]])
                    continue
                stats, beh, mask = self._score([rows[i] for i in part])
                mismatch(tally, stats.logp, beh, mask, fresh[part])
                for b, i in enumerate(part):
                    flat[starts[i] : starts[i + 1]] = stats.logp[b, : lengths[i]]
        self.fed_tokens = fed
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)  # each position is one rank's, zero on the others
        return {i: flat[starts[i] : starts[i + 1]] for i in range(len(rows))}

    def _optimizer_step(self, rows: list[Row], index: list[int], sizes: list[int],
                        adv: torch.Tensor, keep: torch.Tensor, fresh: torch.Tensor,
                        prox: dict[int, torch.Tensor] | None, tally: Tally, lr: float) -> None:  # fmt: skip
        """One mini-batch (the rows ``index``): its micro-batches' gradients accumulated, clipped, one AdamW step
        at ``lr``."""
        kept_rows = int(keep[index].sum())
        kept_tokens = sum(trained_tokens(rows[i][1]) for i in index if keep[i])
        self.opt.zero_grad(set_to_none=True)
        step, parts = self._plan(index, sizes, rows)
        for part in parts:
            if not part:  # this rank's share ran out before another's: FSDP's collectives must pair up
                self._idle_pass(rows[min(range(len(rows)), key=sizes.__getitem__)])
                continue
            if self.world == 1 and not any(keep[i] for i in part):
                continue  # sharded, every rank runs every micro-batch: FSDP's collectives must pair up
            self._micro_step([rows[i] for i in part], part, adv, keep, fresh, prox, tally,
                             kept_rows=kept_rows, kept_tokens=kept_tokens)  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        tally.add("grad_norm", float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        tally.add("optimizer_steps", 1)
        tally.add("micro_batches", len(step.micro_batches))
        tally.high("rank_imbalance", step.imbalance)

    def _micro_step(self, part_rows: list[Row], part: list[int], adv: torch.Tensor,
                    keep: torch.Tensor, fresh: torch.Tensor, prox: dict[int, torch.Tensor] | None, tally: Tally, *,
                    kept_rows: int, kept_tokens: int) -> None:  # fmt: skip
        """One micro-batch's forward and backward, weighted by its share of its mini-batch."""
        reference = self._reference_logp(part_rows)
        stats, beh, mask = self._score(part_rows)
        logp = stats.logp
        if prox is None:  # one optimizer step: this pass is at the weights the batch started with
            mismatch(tally, logp.detach(), beh, mask, fresh[part])
            logp_prox = logp.detach()
        else:
            logp_prox = torch.zeros_like(logp)
            for b, i in enumerate(part):
                logp_prox[b, : len(prox[i])] = prox[i]
        kept = keep[part].to(self.device)
        extra = {"logp_prox": logp_prox} if self.takes_prox else {}
        out = self.loss_fn(logp, beh, adv[part].to(self.device), mask, self.loss_cfg, keep=kept, **extra)
        loss, met = checked(out, self.loss_fn)
        reg, health = regularizers(stats.full, stats.entropy, reference, mask * kept[:, None], self.loss_cfg)
        if reg is not None:
            loss = loss + reg
        share = met["tokens"] / max(kept_tokens, 1) if self.loss_cfg.token_level else (
            int(keep[part].sum()) / max(kept_rows, 1))  # fmt: skip
        (loss * share * self.world).backward()  # FSDP averages gradients over ranks: undo the mean
        tally.add("loss", float(loss.detach()) * share)
        for key in ("clip_fraction", "ratio_mean", *SUMMED):
            tally.add(key, met.get(key, 0.0) * met["tokens"])
        tally.add("tokens", met["tokens"])
        live = float((mask * kept[:, None]).sum())
        tally.add("kept_tokens", live)
        for key, value in health.items():
            tally.add(key, value * live)
        if met["tokens"]:  # a micro-batch of filtered groups has no ratios
            tally.high("ratio_max", met["ratio_max"])
            tally.high("ratio_min_neg", -met["ratio_min"])
            tally.high("is_weight_max", met.get("is_weight_max", 1.0))

    def _idle_pass(self, row: Row) -> None:
        """A forward and backward that changes no gradient (its loss is zero), for a rank whose share has no
        micro-batch left while another's has: FSDP's all-gathers and reduce-scatters happen in every pass (the
        reference's too). Its tokens are not counted as work done."""
        fed = self.fed_tokens
        self._reference_logp([row])
        stats, _, _ = self._score([row])
        (stats.logp.sum() * 0.0).backward()
        self.fed_tokens = fed

    def _score(self, rows: list[Row], model: torch.nn.Module | None = None,
               scorer: Scorer | None = None) -> tuple[Stats, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The ``Stats`` of the sampled tokens under ``model``'s weights (the trained model's by default), the
        behaviour log-probs, and the mask: [B, T] each (``dora.learner.trainers.forward``). The tokens the forward
        ran are counted in ``fed_tokens``."""
        stats, beh, mask, fed = score(rows, self.model if model is None else model,
                                      self.scorer if scorer is None else scorer, device=self.device,
                                      whole_rows=self.whole_rows, autocast=self.bf16 and self.world == 1,
                                      sharded=self.world > 1)  # fmt: skip
        self.fed_tokens += fed
        return stats, beh, mask

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
   nucleus), each distinct prompt run once per micro-batch (``_score``), a chunk of positions at a time: no float32
   tensor of the whole vocabulary at every position is ever made (``dora.learner.scoring``). The same pass gives
   each position's entropy and the whole-vocabulary log-prob, for the entropy bonus and the KL term (the
   reference scored likewise: a frozen copy, or the LoRA model with its adapters off). The clipped surrogate plus
   the regularisers is back-propagated, and micro-batches are weighted so the accumulated gradient equals the
   mini-batch's.
5. One AdamW step per mini-batch at the schedule's learning rate. After the last, ``publish`` writes the new version
   to the weight store: a model folder (the start folder's config, generation config and tokenizer beside the
   weights) in ``publish_dtype``, each tied tensor once (``dora.hf.tensors``).

With one mini-batch, one epoch and no correction the step is the one this trainer took before mini-batches
existed, bit for bit. The step's metrics include its health (``dora.learner.health``).

Single process, or sharded with FSDP2 when a process group of several ranks is initialised (each decoder block
the model declares in ``_no_split_modules`` is a shard unit, then the root; gradients are reduced by FSDP,
metrics by an all-reduce). With ``activation_checkpointing`` each decoder block's activations are recomputed in
the backward (transformers' gradient checkpointing, non-reentrant), and samples are scored as whole rows: a
block replayed on a shared prompt's cache would write it twice. A step's metrics include its speed
(``dora.learner.throughput``: tokens per second, MFU) and how evenly the ranks' tokens were spread.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dora.balance import plan
from dora.hf import lora as adapters
from dora.hf.folder import companion_files, with_dtype
from dora.hf.tensors import padding_gap, publishable, with_copies
from dora.hostmem import Parking, module_tensors
from dora.learner.health import Tally, batch_health, mismatch
from dora.learner.logprobs import CHUNK_BYTES, Stats
from dora.learner.loss import (SUMMED, LossConfig, LossFn, advantages, checked, policy_loss, regularizers, takes_prox,
                               uniform_groups)  # fmt: skip
from dora.learner.schedule import LrSchedule, mini_batches
from dora.learner.scoring import Scorer
from dora.learner.setup import adapt, load_model, optimizer, shard, trainable
from dora.learner.throughput import flop_params, peak_tflops, speed
from dora.samples import Batch, TrainSample
from dora.store import WeightStore

if TYPE_CHECKING:
    from dora.config.models import LoraSection


def trained_tokens(s: TrainSample) -> int:
    """The tokens of a trajectory the loss sees: the model's own (an episode's environment tokens are not)."""
    return len(s.token_ids) if s.loss_mask is None else int(s.loss_mask.sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    lr: float = 1e-4
    micro_batch: int = 16
    """Trajectories per forward/backward (gradient accumulation over a batch)."""
    micro_batch_tokens: int | None = None
    """A token budget per forward/backward instead: trajectories in order while rows x the longest prompt +
    completion stays within it (one longer than it alone). None or 0: ``micro_batch`` trajectories each."""
    balance: str = "tokens"
    """How trajectories go to ranks (``dora.balance``): ``tokens`` (greedy, longest first, a group whole where
    its rank stays within an even share) or ``stride`` (every world-th, in length order)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward instead of keeping them."""
    peak_tflops: float | None = None
    """The accelerator's peak (TFLOP/s) an MFU is reckoned against; None: by CUDA device name, none on a CPU."""
    logprob_chunk_bytes: int = CHUNK_BYTES
    """Float32 logits made at once when scoring (``dora.learner.logprobs``)."""
    temperature: float = 1.0
    """The rollout temperature: the behaviour log-probs were taken at it, so the learner scores at it too."""
    top_p: float = 1.0
    """The rollout nucleus: the engines sampled from it, so the learner scores over the same nucleus."""
    mini_batches: int = 1
    """Optimizer steps per pass over a train batch (``dora.learner.schedule``: whole groups in each)."""
    epochs: int = 1
    """Passes over each train batch."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on matrices (parameters of two or more dimensions) only."""
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    """Train batches in the run (``core.total_steps``): the length a decay of the learning rate spans."""
    max_grad_norm: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    """``bfloat16``: compute in bf16 (FSDP2 MixedPrecisionPolicy, or autocast on one rank); fp32 master weights."""
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    offload_between_steps: bool = False
    """On a GPU: weights and optimizer state to host memory after each publish, back for the next use."""
    publish_dtype: str = "float32"
    """The dtype of the published versions' floating-point weights (the engines')."""
    lora: LoraSection | None = None
    """Train LoRA adapters on the frozen model (``dora.hf.lora``); a version is an adapter folder."""


def _takes_prox(loss: LossConfig, loss_fn: LossFn) -> bool:
    """Whether ``loss_fn`` is given the proximal log-probs; a loss that cannot take them while ``loss`` asks for the
    correction is a ConfigError."""
    takes = takes_prox(loss_fn)
    if loss.decoupled and not takes:
        from dora.config import ConfigError

        raise ConfigError(f"learner.is_cap / learner.is_mask: the loss {loss_fn.__module__}:{loss_fn.__qualname__} "
                          "takes no logp_prox keyword, so it cannot apply the correction")  # fmt: skip
    return takes


class TorchTrainer:
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
        """The PEFT config of the adapters trained on the frozen model (a LoRA run), or None (full weights)."""
        self.initial_adapters = {n: p.detach().clone() for n, p in self.model.named_parameters()
                                 if self.lora is not None and p.requires_grad}  # fmt: skip
        """A LoRA run's adapters as made (B zero: the start model's policy), for going back to version 0."""
        self.whole_rows = padding_gap(self.model) is not None or cfg.activation_checkpointing
        """Its sequences cannot be batched by left padding (layers that keep a state, or positions padding moves),
        or its blocks are checkpointed (a replay would write a shared prompt's cache twice): each sample is scored
        as one whole row, its prompt included (``_row_inputs``)."""
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
        """Steps taken since the weights were last loaded (from the model folder or a checkpoint)."""
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
        self.loss_cfg = loss
        self.loss_fn = loss_fn
        self.takes_prox = _takes_prox(loss, loss_fn)
        """Whether the loss is given the proximal log-probs (``logp_prox=``): the built-in one, or one that asks."""
        self.offloads = cfg.offload_between_steps and self.device.type == "cuda"
        """Between steps the weights and optimizer state wait in host memory (elastic workers use the GPU)."""
        self.offloaded = False
        self.parking = self._parking()
        """Host memory of the offloaded state (one pinned buffer, reused by every offload)."""

    def _parking(self) -> Parking:
        """Offloading on one rank: the pinned buffer, reserved in the background for the model's tensors and
        AdamW's two moments per trained parameter."""
        parking = Parking()
        if self.offloads and self.world == 1:
            trained = trainable(self.model)
            parking.reserve([*module_tensors(self.model)[0], *trained, *trained])
        return parking

    def _beside(self) -> dict[str, bytes]:
        """What a version holds besides its weights, so that every version is a model folder: the start folder's
        config (naming the dtype written), generation config and tokenizer files; with LoRA an adapter folder's
        config naming the base model, and on the rank that publishes ``BASE_FILE``, its digest."""
        if self.lora is not None:
            beside = {adapters.ADAPTER_CONFIG: adapters.config_file(self.lora, base=self.model_dir)}
            if self.rank == 0:
                beside[adapters.BASE_FILE] = adapters.base_record(self.model_dir)
            return beside
        beside = companion_files(self.model_dir)
        if "config.json" in beside:
            beside["config.json"] = with_dtype(beside["config.json"], self.cfg.publish_dtype)
        return beside

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

    # ------------------------------------------------------------------ offload between steps

    def _move(self, device: torch.device) -> None:
        """Weights and optimizer state to ``device``. One rank parks them in one pinned host buffer
        (``dora.hostmem``); FSDP2 ranks use the module's ``to``, on which FSDP2 re-registers its shards. The KL
        reference, if there is one, goes with its ``to``."""
        if self.reference is not None:
            self.reference.to(device)
        # AdamW keeps its step count on the CPU
        slots = [(state, key) for state in self.opt.state.values() for key, value in state.items()
                 if torch.is_tensor(value) and key != "step"]  # fmt: skip
        if self.world > 1:
            self.model.to(device)
            for state, key in slots:
                state[key] = state[key].to(device)
            return
        tensors, put = module_tensors(self.model)
        every = [*tensors, *(state[key] for state, key in slots)]
        moved = self.parking.park(every) if device.type == "cpu" else self.parking.unpark(every, device)
        put(moved[: len(tensors)])
        for (state, key), t in zip(slots, moved[len(tensors) :], strict=True):
            state[key] = t

    def offload(self) -> None:
        """The step is published: weights and optimizer state wait in host memory (with offload_between_steps)."""
        if self.offloads and not self.offloaded:
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
            self.offloaded = True

    def _onload(self) -> bool:
        """Bring offloaded state back to the device; True if it was offloaded."""
        if not self.offloaded:
            return False
        self._move(self.device)
        self.offloaded = False
        return True

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Checkpoint, adopt, restore: on the device meanwhile, and back in host memory after if it was there."""
        was = self._onload()
        try:
            yield
        finally:
            if was:
                self.offload()

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

    def _reference_logp(self, rows: list[tuple[list[int], Any, int]]) -> torch.Tensor | None:
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

    def _plan(self, index: list[int], sizes: list[int], rows: list[tuple[list[int], Any, int]]) -> Any:
        """This rank's micro-batches of the rows ``index`` (as indices into ``rows``), a group's samples together,
        groups in order of their longest sample: little padding. The accumulated gradient depends on neither the
        share nor the order."""
        step = plan([sizes[i] for i in index], [rows[i][2] for i in index], rank=self.rank, world=self.world,
                    balance=self.cfg.balance, micro_batch=self.cfg.micro_batch,
                    micro_batch_tokens=self.cfg.micro_batch_tokens)  # fmt: skip
        return step, [[index[j] for j in part] for part in step.micro_batches]

    def _proximal(self, rows: list[tuple[list[int], Any, int]], sizes: list[int], fresh: torch.Tensor,
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

    def _optimizer_step(self, rows: list[tuple[list[int], Any, int]], index: list[int], sizes: list[int],
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

    def _micro_step(self, part_rows: list[tuple[list[int], Any, int]], part: list[int], adv: torch.Tensor,
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

    def _idle_pass(self, row: tuple[list[int], Any, int]) -> None:
        """A forward and backward that changes no gradient (its loss is zero), for a rank whose share has no
        micro-batch left while another's has: FSDP's all-gathers and reduce-scatters happen in every pass (the
        reference's too). Its tokens are not counted as work done."""
        fed = self.fed_tokens
        self._reference_logp([row])
        stats, _, _ = self._score([row])
        (stats.logp.sum() * 0.0).backward()
        self.fed_tokens = fed

    def _score(self, rows: list[tuple[list[int], Any, int]], model: torch.nn.Module | None = None,
               scorer: Scorer | None = None) -> tuple[Stats, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The ``Stats`` of the sampled tokens under ``model``'s weights (the trained model's by default), the
        behaviour log-probs, and the mask: [B, T] each.

        A group's samples share their prompt, so each distinct prompt is run once, and every sample continues
        from its prompt's keys and values (gradients flow back through them to the shared prompt pass):
        1. The distinct prompts, left-padded (position ids counted from each one's first token): their caches, and
           the last position, which predicts every sample's first token. Left, so each prompt's keys sit next to
           its samples' in the cache: a sliding window (Gemma 2, Mistral) counts cache slots.
        2. Every sample's tokens but the last, on its prompt's cache: the positions predicting the rest. The
           attention mask leaves out the prompt's padding; position ids continue from the prompt's length.
        Causal attention keeps every real position from seeing padding after it, so each sample computes what
        it would alone (to float rounding). Only positions predicting a trained token (mask 1) are scored, a
        chunk at a time (``self.scorer``); the rest are 0. A model that cannot be batched so (``whole_rows``) is
        scored one whole row per sample instead."""
        from transformers import DynamicCache

        distinct: dict[tuple[int, ...], int] = {}
        which = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p, _, _ in rows])
        plen = torch.tensor([len(p) for p in distinct])
        width = int(plen.max())
        lengths = [len(s.token_ids) for _, s, _ in rows]
        longest = max(lengths)
        pids = torch.zeros((len(distinct), width), dtype=torch.long)
        pattn = torch.zeros((len(distinct), width), dtype=torch.long)
        for u, p in enumerate(distinct):
            pids[u, width - len(p) :] = torch.tensor(p)
            pattn[u, width - len(p) :] = 1
        tokens = torch.zeros((len(rows), longest), dtype=torch.long)
        beh = torch.zeros((len(rows), longest), dtype=torch.float32)
        real = torch.zeros((len(rows), longest), dtype=torch.long)  # attended to: every token, the env's too
        mask = torch.zeros((len(rows), longest), dtype=torch.float32)  # trained on: the model's tokens only
        for b, ((_, s, _), n) in enumerate(zip(rows, lengths, strict=True)):
            tokens[b, :n] = torch.from_numpy(s.token_ids.astype("int64"))
            beh[b, :n] = torch.from_numpy(s.logprobs.astype("float32"))
            real[b, :n] = 1
            mask[b, :n] = 1 if s.loss_mask is None else torch.from_numpy(s.loss_mask.astype("float32"))
        dev = self.device
        model = self.model if model is None else model
        scorer = self.scorer if scorer is None else scorer
        at, pos = (mask > 0).nonzero(as_tuple=True)  # the trained positions: (sample, token)
        autocast = self.bf16 and self.world == 1  # sharded: the FSDP2 policy casts instead
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            if self.whole_rows:
                ids, attn, starts = self._row_inputs([p for p, _, _ in rows], tokens, lengths)
                scored, _ = scorer(model, {"input_ids": ids.to(dev), "attention_mask": attn.to(dev), "use_cache": False},
                                   at.to(dev), (starts[at] + pos).to(dev), tokens[at, pos].to(dev))  # fmt: skip
                self.fed_tokens += int(attn.sum())
            else:
                first = pos == 0
                at, pos = torch.cat([at[first], at[~first]]), torch.cat([pos[first], pos[~first]])
                n_first = int(first.sum())
                # a cache of every position (a model's own would keep only a sliding window's last ones)
                inputs = {"input_ids": pids.to(dev), "attention_mask": pattn.to(dev), "use_cache": True,
                          "past_key_values": DynamicCache(),
                          "position_ids": (pattn.cumsum(1) - 1).clamp(min=0).to(dev)}  # fmt: skip
                b = at[:n_first]
                firsts, out = scorer(model, inputs, which[b].to(dev), torch.full_like(b, width - 1).to(dev),
                                     tokens[b, 0].to(dev))  # fmt: skip
                self.fed_tokens += int(pattn.sum())
                scored = [firsts]
                # sharded, every rank runs both passes, even on completions of one token (then on that token)
                fed = max(longest - 1, 1 if self.world > 1 else 0)
                if fed:
                    index = which.to(dev)
                    cache = DynamicCache(ddp_cache_data=[(layer.keys[index], layer.values[index])
                                                         for layer in out.past_key_values.layers])  # fmt: skip
                    attn = torch.cat([pattn[which], real[:, :fed]], 1)
                    inputs = {"input_ids": tokens[:, :fed].to(dev), "attention_mask": attn.to(dev),
                              "position_ids": (plen[which][:, None] + torch.arange(fed)[None]).to(dev),
                              "past_key_values": cache, "use_cache": True}  # fmt: skip
                    b, t = at[n_first:], pos[n_first:]
                    rest, _ = scorer(model, inputs, b.to(dev), (t - 1).to(dev), tokens[b, t].to(dev))
                    self.fed_tokens += int(real[:, : longest - 1].sum())
                    scored.append(rest)
                scored = Stats(*(torch.cat(parts) for parts in zip(*scored, strict=True)))
        where, mask = (at.to(dev), pos.to(dev)), mask.to(dev)
        stats = Stats(*(torch.zeros((len(rows), longest), dtype=torch.float32, device=dev).index_put(where, x) * mask
                        for x in scored))  # fmt: skip
        return stats, beh.to(dev), mask

    def _row_inputs(self, prompts: list[list[int]], tokens: torch.Tensor,
                    lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """One right-padded row per sample: its prompt, then its tokens but the last (the prompt runs once per
        sample); the attention mask; and per sample the position predicting its first token (token t is predicted
        t positions after it). Each position sees only what precedes it, through attention or a recurrent state
        alike, so the padding after it changes nothing."""
        plen = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros((len(prompts), int(plen.max()) + tokens.shape[1] - 1), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
            fed = [*p, *tokens[b, : max(n - 1, 0)].tolist()]
            ids[b, : len(fed)] = torch.tensor(fed)
            attn[b, : len(fed)] = 1
        return ids, attn, plen - 1

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        """Save a checkpoint (a collective when sharded; rank 0 writes); returns the seconds it took."""
        from dora.learner import checkpoint

        started = time.perf_counter()
        assert self.cfg.checkpoint_dir is not None
        with self._on_device():
            checkpoint.save(self.model, self.opt, self.cfg.checkpoint_dir, version=version,
                            copies=self.copies if self.lora is None else {}, trained_groups=trained_groups,
                            keep=self.cfg.keep_checkpoints, frozen=self.lora is None)  # fmt: skip
        return time.perf_counter() - started

    def restore(self) -> dict[str, Any] | None:
        """Load the newest checkpoint, if there is one (every rank reads it); its meta, else None. With none,
        steps taken are undone by going back to the model folder's weights and a fresh optimizer."""
        from dora.learner import checkpoint

        with self._on_device():
            return self._restore(checkpoint)

    def _restore(self, checkpoint: Any) -> dict[str, Any] | None:
        found = checkpoint.checkpoints(self.cfg.checkpoint_dir) if self.cfg.checkpoint_dir else []
        if found:
            self.trained_steps = 0
            return checkpoint.load(self.model, self.opt, found[-1], copies=self.copies if self.lora is None else {},
                                   frozen=self.lora is None)  # fmt: skip
        if self.trained_steps:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # with LoRA the frozen model is the folder's still: the adapters as made
            initial = self.initial_adapters if self.lora is not None else load_model(self.model_dir).state_dict()
            options = StateDictOptions(full_state_dict=True, strict=self.lora is None)
            set_model_state_dict(self.model, initial, options=options)
            self.opt.state.clear()
            self.trained_steps = 0
        return None

    def adopt(self, version: int) -> None:
        """Take a published version's weights from the store (the optimizer state stays as it is)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with self._on_device():
            state = self.store.load(version)  # in the published dtype: made float32
            if self.lora is not None:  # an adapter folder: into the adapters, the frozen model as it is
                state = {adapters.model_key(k): v for k, v in state.items()}
            else:
                state = with_copies(state, self.copies)
            state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
            options = StateDictOptions(full_state_dict=True, strict=self.lora is None)
            set_model_state_dict(self.model, state, options=options)

    def publish(self, version: int) -> tuple[str, str, float] | None:
        """Write the version to the store. Sharded: a collective; rank 0 writes and returns, others None. Then,
        with offload_between_steps, the weights and optimizer state go to host memory until the next step."""
        self._onload()
        try:
            if self.world == 1:
                # offloading: park first, and write the version from the parked copies (the weights cross the
                # host link once, through the pinned buffer, instead of once more tensor by tensor)
                self.offload()
                return self._publish(version, self.model.state_dict())
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None
            )
            state = get_model_state_dict(self.model, options=options)
            return self._publish(version, state) if self.rank == 0 else None
        finally:
            self.offload()

    def _publish(self, version: int, state: dict[str, torch.Tensor]) -> tuple[str, str, float]:
        if self.lora is not None:
            return self.store.publish(version, adapters.adapter_state(state), beside=self.beside,
                                      dtype=self.publish_dtype, file=adapters.ADAPTER_FILE)  # fmt: skip
        return self.store.publish(version, publishable(state, self.copies), beside=self.beside,
                                  dtype=self.publish_dtype)  # fmt: skip

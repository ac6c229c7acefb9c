"""What training LoRA adapters changes in a simulated run, derived from the model's dimensions (``[model]``) and
the adapters' shape (``[lora]``); nothing here is fitted.

**Sizes.** A block's linear layer ``W`` (``d_in -> d_out``) with an adapter of rank ``r`` adds ``A`` (``r x d_in``)
and ``B`` (``d_out x r``): ``r (d_in + d_out)`` parameters. Over the adapted layers of every block::

    adapter_params = r x layers x sum over adapted modules of (d_in + d_out)
    adapter_bytes  = adapter_params x bytes_per_param

Qwen2.5-32B (the defaults), every linear layer, r = 16: (q 5120+5120) + (k 5120+1024) + (v 5120+1024) +
(o 5120+5120) + 3 x (gate, up, down: 5120+27648) = 131,072 per rank per block, x 64 blocks x 16 = 134.2M
parameters, 268 MB in bf16, against 65.5 GB of weights (32.76e9 parameters: 64 blocks of 487.6M plus input
embedding and output layer of 152,064 x 5,120 each).

**Loads.** A version is its adapter: a worker receives ``adapter_bytes`` at ``engine.transfer_bytes_per_s`` (the
bandwidth of full-weight loads, whose ``engine.load_s`` is 65.5 GB over it plus ~1 s into the engine in the paper
configs) and puts it in its engine in ``lora.load_fixed_s``. A worker that holds several versions goes on decoding
the ones it keeps meanwhile (``dora.sim.world``); a full-weight worker holds one and stalls, as before.

**Training.** Per token, a linear layer of ``P`` weights costs ``2P`` FLOP forward; backward, ``2P`` for the gradient
with respect to its input and ``2P`` for the gradient with respect to its weights. With ``N`` the weights a token
multiplies (every block's linear layers and the output layer; the input embedding is a lookup), full fine-tuning
costs ``6N`` per token. With the model frozen no weight gradient is computed, but the input gradients still flow
back through every layer to the first adapter: ``4N``; the adapters themselves (``A = adapter_params``) cost their
own ``6A``. With activation recomputation (``model.activation_recompute``) both pay one more forward: ``8N`` and
``6N + 8A``. So::

    train_cost_factor = (4N + 6A) / 6N = 2/3 + A/N            (no recomputation)
                      = (6N + 8A) / 8N = 3/4 + A/N            (recomputation)

Qwen2.5-32B, r = 16, every linear layer, with recomputation (the paper configs' calibration counts 8N per token):
N = 64 x 487.6M + 778.6M = 31.98e9, A/N = 0.0042, factor 0.754. It multiplies ``trainer.gpu_s_per_token``.
Left out, so the factor is a little low: the attention scores' FLOP (QK^T and AV, no weights: the same in both,
about 2 x layers x heads x head_dim x context per token forward, a few % of 2N at this workload's mean context)
and ``trainer.step_fixed_s`` (kept whole, though the optimizer now updates the adapters only).

**Publishing** moves ``adapter_bytes`` where full weights moved the model's: ``trainer.publish_s`` (the full
weights over the trainer's egress, in the paper configs) x adapter_bytes / weight_bytes, and ``trainer.weights_gb``
(when given, priced per GB) scaled alike. A trainer that shares its
accelerators moves its state on and off them (``trainer.state_bytes``, per weight: bf16 weights, fp32 master,
Adam moments, gradients); a LoRA trainer's is the frozen weights plus that much per adapter parameter.

Not modelled: the adapters' cost in each decode step (reading each held version's ``adapter_bytes`` besides the
weights: 268 MB against 65.5 GB, 0.4% of a step's weight read per version in the batch at r = 16) and the
adapters' bytes in a worker's offload at a yield.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dora.config.sim import ModelSection, SimConfig, SimLoraSection


def linear_shapes(m: ModelSection) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each linear layer of one decoder block."""
    q, kv = m.attention_heads * m.head_dim, m.kv_heads * m.head_dim
    h, f = m.hidden_size, m.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # fmt: skip


def adapter_params(m: ModelSection, lora: SimLoraSection) -> int:
    """r x layers x sum over the adapted modules of (d_in + d_out)."""
    shapes = linear_shapes(m)
    return lora.rank * m.layers * sum(sum(shapes[name]) for name in lora.modules)


def matmul_params(m: ModelSection) -> int:
    """N: the weights each token is multiplied by (every block's linear layers and the output layer)."""
    return m.layers * sum(i * o for i, o in linear_shapes(m).values()) + m.vocab_size * m.hidden_size


def weight_params(m: ModelSection) -> int:
    """Every weight of the model: the blocks' linear layers, the input embedding and (untied) the output layer.
    Norms and biases (under 0.01%) are left out."""
    embeddings = (1 if m.tied_embeddings else 2) * m.vocab_size * m.hidden_size
    return m.layers * sum(i * o for i, o in linear_shapes(m).values()) + embeddings


def train_cost_factor(m: ModelSection, lora: SimLoraSection) -> float:
    """A LoRA step's training FLOP per token over full fine-tuning's: (4N + 6A) / 6N, or (6N + 8A) / 8N with
    activation recomputation (1.0 without adapters)."""
    if not lora.rank:
        return 1.0
    n, a = matmul_params(m), adapter_params(m, lora)
    extra = 2 if m.activation_recompute else 0  # one more forward of the frozen weights and of the adapters
    return ((4 + extra) * n + (6 + extra) * a) / ((6 + extra) * n)


@dataclass(frozen=True, slots=True)
class Costs:
    """A run's version-change costs, as the simulator charges them."""

    lora: bool
    adapter_bytes: float
    """Bytes of one version's adapter (0 without LoRA)."""
    weight_bytes: float
    """Bytes of the model's weights, from ``[model]``."""
    load_s: float
    """Seconds for a worker to take a new version: its adapter, or ``engine.load_s`` for full weights."""
    load_bytes: float
    """Bytes a worker receives to take a new version."""
    train_cost_factor: float
    """Multiplies ``trainer.gpu_s_per_token``."""
    holds: int
    """Versions each rollout worker's engine holds at once."""


def costs(cfg: SimConfig) -> Costs:
    """The costs of ``cfg``'s run (``cfg.core.mode`` decides the versions a worker holds: K + 1 with adapters, in
    every mode that never swaps weights under running requests; one in partial)."""
    m, lora = cfg.model, cfg.lora
    weight_bytes = weight_params(m) * m.bytes_per_param
    if not lora.rank:
        return Costs(lora=False, adapter_bytes=0.0, weight_bytes=weight_bytes, load_s=cfg.engine.load_s,
                     load_bytes=cfg.engine.weight_bytes or weight_bytes, train_cost_factor=1.0, holds=1)  # fmt: skip
    adapter = adapter_params(m, lora) * m.bytes_per_param
    return Costs(
        lora=True, adapter_bytes=adapter, weight_bytes=weight_bytes,
        load_s=adapter / cfg.engine.transfer_bytes_per_s + lora.load_fixed_s, load_bytes=adapter,
        train_cost_factor=train_cost_factor(m, lora),
        holds=1 if cfg.core.in_flight_swap else cfg.core.staleness + 1,
    )  # fmt: skip


def priced(cfg: SimConfig) -> SimConfig:
    """``cfg`` with its trainer's costs for adapters: per-token time x the training cost factor, the publish scaled
    to the adapter's bytes, the state on shared accelerators = frozen weights + the adapters' state. Unchanged
    without adapters."""
    if not cfg.lora.rank:
        return cfg
    c, tr = costs(cfg), cfg.trainer
    weights = weight_params(cfg.model)
    state_per_param = tr.state_bytes / weights
    trainer = replace(
        tr, gpu_s_per_token=tr.gpu_s_per_token * c.train_cost_factor,
        publish_s=tr.publish_s * c.adapter_bytes / c.weight_bytes,
        weights_gb=tr.weights_gb * c.adapter_bytes / c.weight_bytes,
        state_bytes=c.weight_bytes + state_per_param * adapter_params(cfg.model, cfg.lora) if tr.state_bytes else 0.0,
    )  # fmt: skip
    return replace(cfg, trainer=trainer)

"""How the trainer gets the sampled tokens' log-probs out of a forward: from the last hidden states through the
output embedding, a chunk of positions at a time (the logits never exist whole), or from the model's logits.

The head path runs the model with ``logits_to_keep`` empty (its own output projection makes nothing), records
its base model's last hidden state with a forward hook, and inside that hook (so within the model's forward:
under FSDP2 the root's parameters are gathered there) takes the hidden states at the scored positions through
``dora.learner.logprobs.head_stats`` with the output embedding's weight and bias, and the final logit
soft-capping a config names (Gemma 2's ``final_logit_softcapping``).

Whether a model's logits are that is not assumed: ``head_gap`` runs four tokens both ways once, when the trainer
starts, and any difference (a logit scale, another transform, a head that is not a linear layer, a forward that
takes no ``logits_to_keep``) sends the model down the logits path: the model's own logits, only the positions
scored kept (``logits_to_keep`` as indices where the forward takes it), and ``sampled_stats`` on them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dora.hf.tensors import PROBE_ERRORS
from dora.learner.logprobs import CHUNK_BYTES, Stats, head_stats, sampled_stats


def _softcap(model: torch.nn.Module) -> float | None:
    config = model.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None and hasattr(config, "get_text_config"):
        cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    return float(cap) if cap else None


class Scorer:
    """Runs a model on given inputs and returns, for ``tokens`` at positions ``(rows, cols)`` of the sequences it ran,
    their ``Stats`` (the log-prob under the engines' distribution: temperature and ``top_p`` nucleus; under the
    tempered whole vocabulary; the entropy; float32 [N] each), with the model's output (for its cache)."""

    def __init__(self, model: torch.nn.Module, *, temperature: float, top_p: float = 1.0,
                 chunk_bytes: int = CHUNK_BYTES) -> None:  # fmt: skip
        self.temperature = temperature
        self.top_p = top_p
        self.chunk_bytes = chunk_bytes
        self.takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.softcap = _softcap(model)
        self.gap = head_gap(model, self)
        """Why the head path is not taken (None: it is)."""

    @property
    def path(self) -> str:
        return "head" if self.gap is None else "logits"

    def __call__(self, model: torch.nn.Module, inputs: dict[str, Any], rows: torch.Tensor, cols: torch.Tensor,
                 tokens: torch.Tensor, *, head: bool | None = None) -> tuple[Stats, Any]:  # fmt: skip
        if self.gap is None if head is None else head:
            return self._from_head(model, inputs, rows, cols, tokens)
        return self._from_logits(model, inputs, rows, cols, tokens)

    def _from_head(self, model: torch.nn.Module, inputs: dict[str, Any], rows: torch.Tensor, cols: torch.Tensor,
                   tokens: torch.Tensor) -> tuple[Stats, Any]:  # fmt: skip
        linear = model.get_output_embeddings()
        found: list[Stats] = []

        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden = output[0][rows, cols]
            device = hidden.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else linear.weight.dtype
            found.append(head_stats(hidden, linear.weight, tokens, bias=linear.bias, softcap=self.softcap,
                                    temperature=self.temperature, top_p=self.top_p, dtype=dtype,
                                    chunk_bytes=self.chunk_bytes))  # fmt: skip

        handle = model.base_model.register_forward_hook(hook)
        try:
            nothing = torch.zeros(0, dtype=torch.long, device=rows.device)
            out = model(**inputs, logits_to_keep=nothing)
        finally:
            handle.remove()
        if len(found) != 1:
            raise RuntimeError(f"{type(model).__name__}'s base model ran {len(found)} times in one forward")
        return found[0], out

    def _from_logits(self, model: torch.nn.Module, inputs: dict[str, Any], rows: torch.Tensor, cols: torch.Tensor,
                     tokens: torch.Tensor) -> tuple[Stats, Any]:  # fmt: skip
        if self.takes_keep:
            kept = torch.unique(cols)  # sorted: the logits come in this order
            out = model(**inputs, logits_to_keep=kept)
            cols = torch.searchsorted(kept, cols)
        else:
            out = model(**inputs)
        logits = out.logits[rows, cols]
        stats = sampled_stats(logits, tokens, temperature=self.temperature, top_p=self.top_p,
                              chunk_bytes=self.chunk_bytes)  # fmt: skip
        return stats, out


def head_gap(model: torch.nn.Module, scorer: Scorer) -> str | None:
    """Why the sampled log-probs cannot be taken from the base model's last hidden state through the output
    embedding (``Scorer``'s head path), or None when they can: one forward of four tokens each way, compared."""
    linear = model.get_output_embeddings()
    if not isinstance(linear, torch.nn.Linear):
        return f"its output embedding is a {type(linear).__name__}, not a linear layer"
    if getattr(model, "base_model", model) is model:
        return "it has no base model apart from its head"
    device = linear.weight.device
    ids = torch.tensor([[5, 6, 7, 8]], device=device)
    rows, cols = torch.zeros(4, dtype=torch.long, device=device), torch.arange(4, device=device)
    tokens = torch.tensor([9, 3, 7, 1], device=device)
    try:
        with torch.no_grad():
            want = torch.log_softmax(model(input_ids=ids).logits[0].float() / scorer.temperature, -1)
            got, _ = scorer(model, {"input_ids": ids}, rows, cols, tokens, head=True)
    except PROBE_ERRORS as e:
        said = (str(e).strip().splitlines() or [""])[0][:160]
        return f"its forward does not run so ({type(e).__name__}: {said})"
    gap = float((want[cols, tokens] - got.full).abs().max())
    if gap > (1e-4 if linear.weight.dtype in (torch.float32, torch.float64) else 0.05):
        return f"its logits are not its last hidden state through its output embedding (log-probs differ by {gap:.2g})"
    return None

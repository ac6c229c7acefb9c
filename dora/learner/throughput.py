"""How fast the learner trains: tokens per second and model FLOPs utilisation (MFU) of each step.

- ``tokens_per_s``: the tokens the model's forward ran in the step (prompts, once per micro-batch they are
  shared in, and completions, over every rank) per second of the step (``train_s``).
- ``mfu``: ``6 x N x tokens / train_s / (ranks x peak)``. ``N`` is the parameters a token's forward multiplies
  by (every parameter, each tied tensor once, but the embedding tables a forward only looks up: an untied
  input embedding, learned positions); 6 = 2 FLOPs a multiply-add, forward and twice that backward. Attention's
  own FLOPs (quadratic in the context) are left out, as in the usual ``6ND`` estimate, and so is the forward an
  activation checkpoint repeats: MFU counts the model's FLOPs, not the hardware's. ``peak`` is
  ``learner.peak_tflops``, or on a GPU the dense bf16 peak ``PEAK_TFLOPS`` lists for its name; otherwise
  (a CPU, or a GPU not listed) there is no mfu.
"""

from __future__ import annotations

import torch

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
"""Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, by a part of the CUDA device name (first match wins:
specific names before general ones)."""


def peak_tflops(setting: float | None, device: torch.device) -> float | None:
    """The peak an MFU is reckoned against: the setting, else the table's for this CUDA device, else None."""
    if setting:
        return float(setting)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_TFLOPS if part in name), None)


def flop_params(model: torch.nn.Module) -> int:
    """``N`` of ``6ND``: every parameter (a tied one once) but embedding tables that are only looked up."""
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    looked_up = {id(m.weight) for m in model.modules()
                 if isinstance(m, torch.nn.Embedding) and m.weight is not head_weight}  # fmt: skip
    return sum(p.numel() for p in model.parameters() if id(p) not in looked_up)  # a tied tensor comes once


def speed(fed_tokens: float, train_s: float, *, params: int, ranks: int, peak: float | None) -> dict[str, float]:
    """A step's ``tokens_per_s`` and, with a peak, its ``mfu`` (a fraction: 0.4 is 40% of peak)."""
    out = {"tokens_per_s": fed_tokens / train_s if train_s > 0 else 0.0}
    if peak and train_s > 0:
        out["mfu"] = 6.0 * params * fed_tokens / train_s / (ranks * peak * 1e12)
    return out

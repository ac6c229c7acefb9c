"""learner.loss: a `module:function` the torch trainer calls instead of the built-in policy loss."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

from dora.config import ConfigError
from dora.learner.loss import LossConfig, policy_loss, resolve_loss
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.store import WeightStore
from tests.unit import losses
from tests.unit.test_fsdp import batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
CFG = TrainerConfig(lr=1e-2, micro_batch=4)


def step(model: pathlib.Path, store: pathlib.Path, spec: str | None) -> tuple[dict[str, float], bool]:
    """One train step with learner.loss = spec: its metrics, and whether any weight moved."""
    trainer = TorchTrainer(model, WeightStore(store), LossConfig(clip_low=0.25), CFG, loss_fn=resolve_loss(spec))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train(batch())
    after = trainer.model.state_dict()
    return metrics, any(not torch.equal(before[k], after[k]) for k in after)


def test_the_custom_loss_is_the_one_trained_on(tiny_model, tmp_path):
    assert resolve_loss(None) is policy_loss
    losses.CALLS.clear()
    built_in, moved = step(tiny_model, tmp_path / "a", None)
    assert moved and not losses.CALLS
    recorded, _ = step(tiny_model, tmp_path / "b", "tests.unit.losses:recorded")
    # 12 trajectories in micro-batches of 4, with the run's loss settings and the group filter's mask
    assert losses.CALLS == [{"rows": 4, "clip_low": 0.25, "keep": True}] * 3
    assert recorded["loss"] == pytest.approx(built_in["loss"]) and recorded["grad_norm"] == pytest.approx(
        built_in["grad_norm"])  # fmt: skip
    doubled, _ = step(tiny_model, tmp_path / "c", "tests.unit.losses:doubled")
    assert doubled["loss"] == pytest.approx(2 * built_in["loss"])
    assert doubled["grad_norm"] == pytest.approx(2 * built_in["grad_norm"], rel=1e-4)
    nothing, moved = step(tiny_model, tmp_path / "d", "tests.unit.losses:nothing")
    assert nothing["grad_norm"] == 0.0 and not moved, "a loss with no gradient still changed the weights"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("no_colon", "expected 'module:function'"), ("tests.unit.no_such_module:f", "No module named"),
     ("tests.unit.losses:missing", "has no attribute 'missing'"), ("tests.unit.losses:NOT_CALLABLE", "not callable"),
     ("tests.unit.losses:two_arguments", "cannot be called as policy_loss is")],
)  # fmt: skip
def test_a_bad_spec_is_a_config_error_naming_the_key(spec, fragment):
    with pytest.raises(ConfigError, match=r"^learner\.loss") as e:
        resolve_loss(spec)
    assert fragment in str(e.value)


def test_a_result_outside_the_contract_is_named(tiny_model, tmp_path):
    trainer = TorchTrainer(tiny_model, WeightStore(tmp_path), LossConfig(), CFG, loss_fn=losses.no_metrics)
    with pytest.raises(TypeError, match=re.escape("tests.unit.losses:no_metrics: its metrics lack clip_fraction")):
        trainer.train(batch())


def test_dora_learner_reports_a_bad_loss_in_one_line(tiny_model):
    """The process's answer to a bad ``learner.loss``, once (each kind of bad spec is checked in process above)."""
    spec, fragment = "tests.unit.losses:NOT_CALLABLE", "not callable"
    r = subprocess.run([sys.executable, "-m", "dora", "learner", "--trainer", "torch", "--broker", "tcp://127.0.0.1:9",
                        "--model", str(tiny_model), "--set", f"learner.loss={spec}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"dora learner: learner.loss {spec!r}") and fragment in line, line

"""The torch trainer with [learner.lora]: a step moves the adapters alone, a version is an adapter folder that PEFT
loads into the same policy, checkpoints hold the adapters and their optimizer state, and a version adopted from
the store puts its adapters back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dora.config.models import LoraSection
from dora.learner.checkpoint import CheckpointMismatch, check_resumable
from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.store import WeightStore
from tests.unit.test_fsdp import batch

LORA = TrainerConfig(lr=1e-2, micro_batch=2, lora=LoraSection(rank=4, alpha=8.0))


def trainer(model, root, cfg: TrainerConfig = LORA) -> TorchTrainer:
    return TorchTrainer(model, WeightStore(root / "store"), LossConfig(), cfg)


def adapters_of(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}


def test_a_lora_step_moves_the_adapters_alone_and_its_version_is_an_adapter_folder_peft_loads(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = trainer(tiny_model, tmp_path)
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    before = adapters_of(t)
    assert before and all(".lora_A." in n or ".lora_B." in n for n in before)
    assert all(not v.any() for n, v in before.items() if ".lora_B." in n)  # B starts at zero: version 0's policy
    metrics = t.train(batch())
    assert metrics["grad_norm"] > 0
    assert all(torch.equal(p, frozen[n]) for n, p in t.model.named_parameters() if n in frozen), "the base moved"
    after = adapters_of(t)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    assert len(t.opt.state) == len(before)  # optimizer state for the adapters alone

    uri, _, _ = t.publish(1)
    folder = tmp_path / "store" / "v1"
    assert uri == f"file://{folder}"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "dora_base_model.json", "manifest.json"]  # fmt: skip
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["base_model_name_or_path"] == str(tiny_model)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}  # fmt: skip
    saved = t.store.load(1)  # digest checked
    assert set(saved) == set(load_file(str(folder / "adapter_model.safetensors")))
    assert len(saved) == len(before) and all(k.startswith("base_model.model.model.layers.") for k in saved)

    # PEFT's own loader on the start folder gives the trainer's policy
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32),
                                     str(folder)).eval()  # fmt: skip
    ids = torch.tensor([[11, 12, 13, 400, 401, 402]])
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
        got = peft(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-5), "the adapters changed nothing"


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_resumes_them(tiny_model, tmp_path):
    cfg = TrainerConfig(lr=1e-2, micro_batch=2, lora=LoraSection(rank=4, alpha=8.0),
                        checkpoint_dir=str(tmp_path / "ckpt"))  # fmt: skip
    t = trainer(tiny_model, tmp_path, cfg)
    t.train(batch())
    t.checkpoint(1, [0, 1, 2])
    state = load_file(str(tmp_path / "ckpt" / "ckpt-v1" / "state.safetensors"))
    weights = [k for k in state if k.startswith("model/")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), "the frozen model was written"
    assert any(k.startswith("optim/") for k in state)

    again = trainer(tiny_model, tmp_path, cfg)
    meta = again.restore()
    assert meta is not None and meta["version"] == 1 and meta["trained_groups"] == [0, 1, 2]
    mine, theirs = adapters_of(t), adapters_of(again)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    slots = lambda tr: [s["exp_avg"] for s in tr.opt.state.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(slots(t), slots(again), strict=True))
    # the next step is the one the first trainer takes
    assert again.train(batch())["loss"] == pytest.approx(t.train(batch())["loss"], rel=1e-6)

    check_resumable(tmp_path / "ckpt", adapters_only=True)
    with pytest.raises(CheckpointMismatch, match="holds LoRA adapters; this learner trains full weights"):
        check_resumable(tmp_path / "ckpt", adapters_only=False)


def test_a_version_adopted_from_the_store_puts_its_adapters_back_and_none_goes_back_to_the_start(tiny_model, tmp_path):
    t = trainer(tiny_model, tmp_path)
    start = adapters_of(t)
    t.train(batch())
    t.publish(1)
    trained = adapters_of(t)
    other = trainer(tiny_model, tmp_path)
    other.adopt(1)
    assert all(torch.equal(trained[n], p) for n, p in adapters_of(other).items())
    t.restore()  # no checkpoint: back to version 0, the adapters as made
    assert all(torch.equal(start[n], p) for n, p in adapters_of(t).items())


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("rank", 0, "rank must be >= 1"), ("alpha", 0.0, "alpha must be > 0"),
     ("dropout", 1.0, r"dropout must be in \[0, 1\)"), ("target_modules", (), "target_modules must name a module")],
)  # fmt: skip
def test_bad_lora_settings_name_their_key(key, value, message):
    from dora.config import ConfigError

    with pytest.raises(ConfigError, match=f"learner.lora.{message}"):
        LoraSection(**{key: value})


def test_target_modules_that_match_nothing_are_one_config_error(tiny_model, tmp_path):
    from dora.config import ConfigError

    cfg = TrainerConfig(lr=1e-2, lora=LoraSection(target_modules=("no_such_proj",)))
    with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules = \['no_such_proj'\]"):
        trainer(tiny_model, tmp_path, cfg)


def test_a_torch_engine_of_a_lora_run_loads_an_adapter_version_into_the_trainers_policy(tiny_model, tmp_path):
    """The engine starts as the start model (its adapters' B zero: version 0) and a published version's adapters,
    copied in after their digest is checked, give the trainer's logits. Adapters of another rank are refused."""
    from dora.rollout.engines.base import EngineError
    from dora.rollout.engines.torch.engine import TorchEngine

    t = trainer(tiny_model, tmp_path)
    ids = torch.tensor([[11, 12, 13, 400, 401, 402]])
    engine = TorchEngine(tiny_model, version=0, lora=LORA.lora)
    base = TorchEngine(tiny_model, version=0)
    with torch.no_grad():
        assert torch.allclose(engine.model(input_ids=ids).logits, base.model(input_ids=ids).logits, atol=1e-6)
    t.train(batch())
    t.publish(1)
    engine.load_weights(1, t.store.path(1), t.store.digest(1))
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
        assert torch.allclose(engine.model(input_ids=ids).logits, want, atol=1e-5)
        assert not torch.allclose(base.model(input_ids=ids).logits, want, atol=1e-5)
    assert engine.version == 1
    other = TorchEngine(tiny_model, version=0, lora=LoraSection(rank=8, alpha=8.0))
    with pytest.raises(EngineError, match=r"v1: .*adapters of rank 4 and alpha 8\.0, this engine's have rank 8"):
        other.load_weights(1, t.store.path(1), t.store.digest(1))


def test_an_engine_refuses_an_adapter_version_trained_on_another_base_model_by_its_digest(tiny_model, tmp_path):
    """A version records its base model by path and digest (config and weights, not the path: a copy elsewhere is the
    same model). An engine on a model of the same shapes but other weights refuses it before reading it; one on a
    copy of the base loads it. A version that records no base (an older dora's) is taken as it is."""
    import shutil

    from dora.hf.lora import BASE_FILE
    from dora.hf.tiny import TinySpec, build_model
    from dora.rollout.engines.base import EngineError
    from dora.rollout.engines.torch.engine import TorchEngine
    from dora.store import model_digest

    t = trainer(tiny_model, tmp_path)
    t.train(batch())
    t.publish(1)
    recorded = json.loads((t.store.path(1) / BASE_FILE).read_text())
    assert recorded == {"path": str(tiny_model), "digest": model_digest(tiny_model)}
    assert recorded["digest"].startswith("xxh3_128/16MiB/dir:")

    other = build_model(tmp_path / "other", TinySpec(seed=1))  # the same architecture, other weights
    assert model_digest(other) != recorded["digest"]
    engine = TorchEngine(other, version=0, lora=LORA.lora)
    with pytest.raises(EngineError, match=rf"v1: .*trained on the base model {tiny_model} .*not on this worker's "
                                          rf"{other} .*must start from the same model"):  # fmt: skip
        engine.load_weights(1, t.store.path(1), t.store.digest(1))
    assert engine.version == 0

    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    assert model_digest(copy) == recorded["digest"]
    engine = TorchEngine(copy, version=0, lora=LORA.lora)
    engine.load_weights(1, t.store.path(1), t.store.digest(1))
    assert engine.version == 1

    (t.store.path(1) / BASE_FILE).unlink()  # as an older version; its digest is not checked here (None)
    other_engine = TorchEngine(other, version=0, lora=LORA.lora)
    other_engine.load_weights(1, t.store.path(1), None)
    assert other_engine.version == 1


def test_dora_learner_says_in_one_line_that_target_modules_match_nothing(tiny_model):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dora", "learner", "--trainer", "torch", "--broker", "tcp://127.0.0.1:9",
                        "--model", str(tiny_model), "--set", 'learner.lora.target_modules=["no_such_proj"]'],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.startswith("dora learner:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and "learner.lora.target_modules = ['no_such_proj']" in lines[0], r.stderr


def test_a_vllm_engine_holds_adapter_versions_side_by_side_and_samples_each_request_with_its_own(tiny_model, tmp_path):
    """vLLM with LoRA: version 1's adapters are loaded, a group starts on them, version 2's are loaded while it runs,
    and a second group starts on those, a third naming version 1 (older, still held). They decode in the same
    batches; every behaviour log-prob of each group is its own version's (the trainer's policy at that version,
    through the torch engine), not the other's. A third version while both run is refused (max_loras 2)."""
    pytest.importorskip("vllm")
    from dora.rollout.engines.base import EngineError
    from dora.rollout.engines.torch.engine import TorchEngine
    from dora.rollout.engines.vllm_engine import VllmEngine

    t = trainer(tiny_model, tmp_path)
    for v in (1, 2, 3):
        t.train(batch())
        t.publish(v)
    policy = {}
    for v in (1, 2):
        policy[v] = TorchEngine(tiny_model, version=0, lora=LORA.lora)
        policy[v].load_weights(v, t.store.path(v), t.store.digest(v))
    engine = VllmEngine(tiny_model, max_slots=8, kv_cache_bytes=64 << 20, lora=LORA.lora, max_loras=2)
    prompt = [11, 12, 13, 400, 401, 402]
    engine.load_weights(1, t.store.path(1), t.store.digest(1))
    first = engine.submit(group_id=1, attempt=1, prompt=prompt, n=2, max_tokens=8, seed=1)
    engine.step()
    assert all(r.tokens and r.finish is None for r in first)  # running when version 2 comes
    engine.load_weights(2, t.store.path(2), t.store.digest(2))
    second = engine.submit(group_id=2, attempt=1, prompt=prompt, n=2, max_tokens=8, seed=2)
    third = engine.submit(group_id=3, attempt=1, prompt=prompt, n=2, max_tokens=8, seed=3, version=1)
    assert engine.max_versions == 2 and engine.held_versions() == {1, 2}
    with pytest.raises(EngineError, match=r"a request for v0: this engine holds v1, v2"):
        engine.submit(group_id=4, attempt=1, prompt=prompt, n=1, max_tokens=8, version=0)
    with pytest.raises(EngineError, match=r"cannot load v3: .* 2 versions at most \(max_loras\)"):
        engine.load_weights(3, t.store.path(3), t.store.digest(3))
    for _ in range(50):
        if all(r.finish is not None for r in first + second + third):
            break
        engine.step()
    assert all(r.finish is not None and len(r.tokens) >= 2 for r in first + second + third)
    assert engine.engine.list_loras() == {2, 3} and engine.version == 2  # vLLM's ids: version + 1

    def logprobs(v: int, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = policy[v].model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)]

    for group, v in ((first, 1), (second, 2), (third, 1)):
        for r in group:
            got = torch.tensor(r.logprobs)
            assert torch.allclose(got, logprobs(v, r.tokens), atol=1e-4), (v, got, logprobs(v, r.tokens))
            assert not torch.allclose(got, logprobs(3 - v, r.tokens), atol=1e-4), f"v{v}'s tokens fit both versions"

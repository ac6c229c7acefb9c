"""`dora sft` over ranks and on a GPU: 2 gloo ranks (FSDP2) take the one-rank steps and write the one-rank folder,
`dora sft --set sft.ranks=2` starts its ranks under torchrun, bad sft.device/dtype/ranks are one line, and on a GPU
it trains in bf16 with fp32 master weights."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from dora.actor.cluster import ClusterInfo
from dora.config import ConfigError, load
from dora.config.models import SftSection
from dora.config.run import RunConfig
from dora.hf.tensors import tied_copies
from dora.learner import sft, sft_main, sft_ranks
from tests.ranks import run_ranks
from tests.unit.test_fsdp import free_port
from tests.unit.test_sft import rows_file, task_run, write_config

SFT = SftSection(epochs=1, lr=1e-3, batch_size=5)
"""11 rows: batches of 5, 5 and 1 (the last leaves rank 1 no row: it runs one, weighted 0)."""


def examples(model: pathlib.Path, tmp_path: pathlib.Path, n: int = 11) -> list[sft.Example]:
    return sft.encode(task_run(model, rows_file(tmp_path, n)), eos=0, max_answer_tokens=64).items


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class GradSpy:
    """Stands in for clip_grad_norm_: records each step's gradient norm, and the first step's gradients whole."""

    def __init__(self) -> None:
        self.clip = torch.nn.utils.clip_grad_norm_
        self.norms: list[float] = []
        self.first: list[torch.Tensor] | None = None

    def __call__(self, params, max_norm):
        params = list(params)
        if self.first is None:  # a collective when sharded: every rank gets here in step
            self.first = [full(p.grad).detach().cpu().clone() for p in params]
        norm = self.clip(params, max_norm)
        self.norms.append(float(full(norm)))
        return norm


def one_rank(model: pathlib.Path, rows: list[sft.Example], out: pathlib.Path) -> tuple[list, GradSpy]:
    spy = GradSpy()
    torch.nn.utils.clip_grad_norm_ = spy
    try:
        net = sft.load_model(model)
        reports = sft.train(net, rows, SFT, pad_id=0)
    finally:
        torch.nn.utils.clip_grad_norm_ = spy.clip
    sft.write(net, model, out)
    return reports, spy


def rank_main(rank: int, world: int, port: int, model: str, rows: list[sft.Example], out: str) -> None:
    torch.set_num_threads(1)
    spy = GradSpy()
    torch.nn.utils.clip_grad_norm_ = spy
    cluster = ClusterInfo(host="test", rank=rank, local_rank=rank, world=world, master_port=port)
    where = sft_ranks.place(dataclasses.replace(SFT, ranks=world), cluster)
    done = False
    try:
        net = sft.load_model(pathlib.Path(model))
        copies = tied_copies(net)
        net = sft_ranks.shard(net, where)
        reports = sft.train(net, rows, SFT, pad_id=0, where=where)
        state = sft_ranks.full_state(net, copies, where)
        if rank == 0:
            sft.write(net, pathlib.Path(model), pathlib.Path(out), state=state)
            torch.save({"reports": reports, "norms": spy.norms, "first": spy.first}, pathlib.Path(out).parent / "r0.pt")
        else:
            assert state is None
        done = True
    finally:
        sft_ranks.leave(where)
    if done:  # skip exit-time destructors: gloo's threads can abort a rank whose peer has gone (see test_fsdp)
        os._exit(0)


@pytest.fixture(scope="module")
def tied_model(tiny_model, tmp_path_factory) -> pathlib.Path:
    """The tiny model with its output projection tied to the embedding (as Qwen2.5-0.5B), with its tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tied") / "model"
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(tiny_model), tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    assert tied_copies(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    model.save_pretrained(out)
    for f in tiny_model.iterdir():
        if not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True], ids=["untied", "tied"])
def test_two_gloo_ranks_take_the_one_rank_steps_and_write_its_folder(tied, tiny_model, tied_model, tmp_path):
    from safetensors.torch import load_file

    model = tied_model if tied else tiny_model
    rows = examples(model, tmp_path)
    run_ranks(rank_main, (2, free_port(), str(model), rows, str(tmp_path / "two" / "out")))
    got = torch.load(tmp_path / "two" / "r0.pt", weights_only=False)
    want, spy = one_rank(model, rows, tmp_path / "one" / "out")
    # the gradient of the first step is the one-rank gradient (the mean over the whole batch's answer tokens)
    assert len(got["first"]) == len(spy.first)
    for g, w in zip(got["first"], spy.first, strict=True):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-7), (g - w).abs().max()
    assert got["norms"] == pytest.approx(spy.norms, rel=1e-4) and len(spy.norms) == 3
    assert got["reports"][0].loss == pytest.approx(want[0].loss, rel=1e-5)
    assert got["reports"][0].tokens == want[0].tokens
    one, two = tmp_path / "one" / "out", tmp_path / "two" / "out"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert json.loads((two / "config.json").read_text()) == json.loads((one / "config.json").read_text())
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert sorted(a) == sorted(b) and ("lm_head.weight" in a) is not tied  # a tied tensor is stored once
    for k, v in a.items():  # AdamW moves each weight by about lr a step: rounding may flip a near-zero gradient's
        diff = (b[k] - v).abs()
        assert diff.gt(1e-5).sum().item() <= max(1, v.numel() // 10_000), (k, diff.max().item())
        assert diff.max().item() <= 2 * 3 * SFT.lr, k


@pytest.mark.slow  # three processes importing torch: the default run keeps the gloo ranks above and the command's test
@pytest.mark.timeout(120)
def test_dora_sft_with_two_ranks_starts_them_under_torchrun_and_writes_a_loadable_folder(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, rows_file(tmp_path, 12), tiny_model, batch_size=4, ranks=2, threads=1)
    r = subprocess.run([sys.executable, "-m", "dora", "sft", "--config", str(config)], capture_output=True,
                       text=True, timeout=110)  # fmt: skip
    assert r.returncode == 0, r.stderr
    started = "starting 2 ranks on this node: python -m torch.distributed.run --standalone --nproc-per-node=2 -m dora"
    assert started in r.stderr, r.stderr
    assert "OMP_NUM_THREADS" not in r.stderr, r.stderr  # set for torchrun: it has no warning to print
    assert "12 rows" in r.stderr and "on cpu x 2 ranks (FSDP2), float32" in r.stderr, r.stderr
    assert len(re.findall(r"epoch 1/1  loss [\d.]+", r.stderr)) == 1, r.stderr  # rank 0 alone reports
    assert r.stderr.count(f"wrote {tmp_path / 'out'}") == 1, r.stderr
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "rows.jsonl", "sft.toml"]


@pytest.mark.parametrize(
    ("sets", "fragment"),
    [(["sft.device=gpu"], "sft.device must be auto, cpu, cuda"), (["sft.dtype=float16"], "sft.dtype must be auto"),
     (["sft.ranks=0"], "sft.ranks must be >= 1"), (["sft.ranks=2", "sft.device=cuda:1"], "with sft.ranks = 2")],
)  # fmt: skip
def test_bad_device_dtype_or_ranks_is_one_line_and_exit_2(sets, fragment, tiny_model, tmp_path, capsys):
    config = write_config(tmp_path, rows_file(tmp_path, 3), tiny_model)
    code = sft_main.main(["--config", str(config), *(a for s in sets for a in ("--set", s))])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1 and err.startswith("dora sft: "), err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_gpu_asked_for_where_there_is_none_is_one_line_and_exit_2(ranks, tiny_model, tmp_path, capsys):
    config = write_config(tmp_path, rows_file(tmp_path, 3), tiny_model, device="cuda", ranks=ranks)
    code = sft_main.main(["--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and "torch sees 0 CUDA devices" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("ranks", "world", "starts"), [(1, 1, False), (2, 1, True), (2, 2, False), (4, 4, False)],
)  # fmt: skip
def test_only_a_lone_process_asked_for_ranks_starts_them(ranks, world, starts):
    assert sft_ranks.relaunches(SftSection(ranks=ranks), ClusterInfo(host="h", world=world)) is starts


def test_the_ranks_started_are_this_command_under_torchrun():
    assert sft_ranks.relaunch_command(["--config", "a.toml", "--set", "sft.epochs=2"], 3) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "-m", "dora", "sft", "--config", "a.toml", "--set", "sft.epochs=2",
    ]  # fmt: skip


def test_a_rank_of_another_number_of_ranks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rank 1 of 4 .* set sft\.ranks = 4"):
        sft_ranks.place(SftSection(ranks=2), ClusterInfo(host="h", rank=1, local_rank=1, world=4))


@pytest.mark.parametrize(
    ("device", "dtype", "want"), [("cpu", "auto", False), ("cpu", "bfloat16", True), ("auto", "float32", False)],
)  # fmt: skip
def test_auto_dtype_is_float32_on_the_cpu(device, dtype, want):
    where = sft_ranks.place(SftSection(device=device, dtype=dtype), ClusterInfo(host="h"))
    if device == "auto" and torch.cuda.is_available():
        assert where.device == torch.device("cuda", 0)
    else:
        assert where.device == torch.device("cpu")
    assert where.bf16 is want and where.world == 1 and where.autocast is want


@pytest.mark.parametrize(("key", "value"), [("device", "gpu"), ("dtype", "float16"), ("ranks", 0)])
def test_bad_values_name_their_key(key, value):
    with pytest.raises(ConfigError, match=f"sft.{key} must"):
        SftSection(**{key: value})


# ---------------------------------------------------------------- on a GPU (skipped without CUDA; .ci/gpu runs it)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_sft_trains_in_bf16_with_fp32_master_weights(tiny_model, tmp_path, monkeypatch):
    rows = examples(tiny_model, tmp_path, 12)
    where = sft_ranks.place(SftSection(), ClusterInfo(host="n1"))  # auto: this rank's GPU, bf16
    assert where.device == torch.device("cuda", 0) and where.bf16 and where.autocast
    model = sft_ranks.shard(sft.load_model(tiny_model), where)
    ids, labels = (t.to(where.device) for t in sft.collate(rows, pad_id=0))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        before = float(sft.answer_loss(model, ids, labels)[0])
    seen = []
    nll = sft.answer_nll

    def spy(logits, labels):
        seen.append(logits.dtype)
        return nll(logits, labels)

    monkeypatch.setattr(sft, "answer_nll", spy)
    reports = sft.train(model, rows, SftSection(epochs=4, lr=3e-3, batch_size=6), pad_id=0, where=where)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        after = float(sft.answer_loss(model, ids, labels)[0])
    assert seen and all(d == torch.bfloat16 for d in seen)  # computed in bf16 ...
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())  # ... on fp32 master weights
    assert after < 0.8 * before and reports[-1].loss < reports[0].loss
    out = sft.write(model, tiny_model, tmp_path / "out")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


def test_a_start_folder_that_does_not_exist_is_refused_on_every_rank_never_built(tmp_path):
    """Only ``"dora:tiny"`` is built (atomically: ranks asking at once share one folder); a path is taken as is."""
    cfg = load(RunConfig, path=str(write_config(tmp_path, rows_file(tmp_path, 3), tmp_path / "start")))
    with pytest.raises(ConfigError, match=r"sft\.model = .*: no such folder"):
        sft.plan(cfg)
    assert not (tmp_path / "start").exists()


def test_a_process_group_sft_did_not_start_is_left_alone(tiny_model, tmp_path):
    """One rank starts no group, and ends none: vLLM's, in the same process, must outlive `dora sft`'s run."""
    import torch.distributed as dist

    cfg = load(RunConfig, path=str(write_config(tmp_path, rows_file(tmp_path, 3), tiny_model, threads=1)))
    ours = not dist.is_initialized()  # a vLLM engine made by an earlier test in this process holds one already
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert sft.run(cfg, ClusterInfo(host="h")) == tmp_path / "out"
        assert dist.is_initialized()
    finally:
        if ours:
            dist.destroy_process_group()

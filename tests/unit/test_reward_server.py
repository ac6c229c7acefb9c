"""`dora reward` as a real process on 127.0.0.1, serving tiny random-weight models built here (a one-label Qwen2
sequence classifier and a Qwen2 causal LM judge with a chat template, on a small byte-level BPE tokenizer), called
through the workers' own reward client: the reward model's scores are its direct forward pass on the prompt and
completion, concurrent clients' samples share its batches (its /stats), and the judge's component is the first number
of its own greedy answer to the filled template (answered by dora's torch engine, as ``generate`` answers), scaled
(or the sample's reason when there is none), the same each time. The weights are random: this is the plumbing, not
the judge's quality. Both servers start at once, in the module's fixture; stopped by PID."""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from dora.config.run import TaskSection
from dora.hf.tiny import CHAT_TEMPLATE
from dora.tasks import combine, rewards
from dora.tasks.remote_reward import RemoteReward
from dora.tasks.tasks import Item

CORPUS = ["What is 3 + 4? The answer is 7.", "Rate the response from 0 to 10. Score: 8 of 10.",
          "Prompt: Response: reference answer 12 = 5 + 7", "def f(x): return x * 2  # 0.5"] * 8  # fmt: skip
pytestmark = pytest.mark.slow
SAMPLES = [("What is 3 + 4?", "= 7", "7"), ("What is 2 + 2?", "4, surely", "4"), ("Say hi.", "hi", "hi"),
           ("Add 5 and 7.", "5 + 7 = 12", "12"), ("", "no prompt at all", "none")]  # fmt: skip


def build(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A reward model and a judge sharing one tokenizer (the judge's with a ChatML template). The judge's logits of
    digit tokens are doubled, so its greedy answers start with numbers: here " 4 ..." (0.4) for most samples and one
    "...086" (8.6, clipped to 1.0); a judge's answer without a number is tests/unit/test_reward_sources.py's."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    shape = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                 eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    rm, judge = out / "rm", out / "judge"
    Qwen2ForSequenceClassification(Qwen2Config(num_labels=1, **shape)).save_pretrained(rm)
    tok.save_pretrained(rm)
    judge_lm = Qwen2ForCausalLM(Qwen2Config(**shape))
    digits = [i for i in range(len(tok)) if tok.decode([i]).strip().isdigit()]
    with torch.no_grad():  # numbers come out first (random weights seldom write one): the scaled score is exercised
        judge_lm.lm_head.weight[digits] *= 2.0
    judge_lm.save_pretrained(judge)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(judge)
    return rm, judge


def start(tmp: pathlib.Path, name: str, task: dict[str, Any]) -> subprocess.Popen[bytes]:
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in task.items())
    (tmp / f"{name}.toml").write_text(f'[task]\n{lines}\n[log]\nformat = "json"\n')
    return subprocess.Popen([sys.executable, "-m", "dora", "reward", "--config", str(tmp / f"{name}.toml"),
                             "--url-file", str(tmp / f"{name}.json")], stdout=open(tmp / f"{name}.out", "wb"),
                            stderr=subprocess.STDOUT)  # fmt: skip


def url(tmp: pathlib.Path, name: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (tmp / f"{name}.json").exists():
        assert proc.poll() is None, (tmp / f"{name}.out").read_text()
        assert time.monotonic() < deadline, f"dora reward did not serve within {timeout_s} s"
        time.sleep(0.05)
    return str(json.loads((tmp / f"{name}.json").read_text())["url"])


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("reward")
    rm, judge = build(tmp)
    procs = {"rm": start(tmp, "rm", {"reward_model": str(rm), "reward_server_batch_size": 6,
                                     "reward_server_wait_s": 0.3}),
             "judge": start(tmp, "judge", {"reward_judge": str(judge), "judge_max_tokens": 6})}  # fmt: skip
    try:
        urls = {name: url(tmp, name, p) for name, p in procs.items()}
        yield {"rm": rm, "judge": judge, "urls": urls, "tmp": tmp, "procs": procs}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def item(prompt: str, answer: str) -> Item:
    return Item(task="dataset", index=0, prompt=prompt, answer=answer)


def stats(reward_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(reward_url.removesuffix("/score") + "/stats", timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def test_reward_model_scores_are_its_forward_pass_on_prompt_and_completion(servers: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    section = TaskSection(name="arithmetic", reward_weights={"exact": 1.0, "model": 0.5}, reward_model="rm",
                          reward_server=servers["urls"]["rm"])  # fmt: skip
    fn = combine.resolve(section, None)
    assert isinstance(fn, combine.Combined)
    scored = rewards.score_many(fn, [(c, item(p, a)) for p, c, a in SAMPLES], timeout_s=30.0)
    fn.close()
    model = AutoModelForSequenceClassification.from_pretrained(str(servers["rm"]), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(servers["rm"]))
    with torch.inference_mode():
        direct = [float(model(**tok(p + c, return_tensors="pt")).logits[0, 0]) for p, c, _ in SAMPLES]
    assert [s.reason for s in scored] == [""] * len(SAMPLES)
    assert [s.components["model"] for s in scored] == pytest.approx(direct, abs=1e-5)
    assert len(set(direct)) == len(direct)  # the texts differ, and so do their scores
    exact = [float(rewards.exact(c, item(p, a))) for p, c, a in SAMPLES]
    assert [s.reward for s in scored] == pytest.approx([e + 0.5 * d for e, d in zip(exact, direct, strict=True)])


def test_concurrent_clients_share_the_server_batches(servers: dict[str, Any]) -> None:
    reward_url = servers["urls"]["rm"]
    before = stats(reward_url)
    clients = [RemoteReward(reward_url, timeout_s=30.0, retries=0, batch_size=2, batch_wait_s=0.0) for _ in range(4)]
    barrier = threading.Barrier(len(clients))

    def score(k: int) -> list[Any]:
        barrier.wait()
        futures = [clients[k].submit(f"answer {k}.{i}", item("Q?", "")) for i in range(2)]
        return [f.result(timeout=30) for f in futures]

    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        got = list(pool.map(score, range(len(clients))))
    for c in clients:
        c.close()
    after = stats(reward_url)
    assert all(set(r) == {"model"} for answers in got for r in answers)
    assert after["requests"] - before["requests"] >= 4 and after["samples"] - before["samples"] == 8
    new = {int(size): n - before["batch_sizes"].get(size, 0) for size, n in after["batch_sizes"].items()}
    sizes = sorted(size for size, n in new.items() for _ in range(n))
    assert max(sizes) > 2, sizes  # one forward held the samples of several workers' requests
    assert max(sizes) <= 6 and sum(sizes) == 8, sizes


def judge_expected(judge: pathlib.Path, template: str, samples: list[tuple[str, str, str]]) -> list[str]:
    """The judge's greedy answers computed here with ``generate``, one sample at a time, from its folder, ending on
    its stop ids (its EOS and its chat template's end of turn), as the server's engine ends them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dora.hf.folder import facts

    model = AutoModelForCausalLM.from_pretrained(str(judge), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(judge))
    stops = sorted(facts(judge).stop_ids)
    assert len(stops) == 2  # <|endoftext|> and <|im_end|>
    out = []
    for p, c, a in samples:
        text = template.replace("{prompt}", p).replace("{completion}", c).replace("{answer}", a)
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False, return_tensors="pt")
        with torch.inference_mode():
            gen = model.generate(**ids, max_new_tokens=6, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        out.append(tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


def test_the_judge_answers_the_filled_template_greedily_and_its_number_is_the_score(servers: dict[str, Any]) -> None:
    fn = combine.resolve(TaskSection(name="arithmetic", reward_judge="judge", reward_server=servers["urls"]["judge"]),
                         None)  # fmt: skip
    assert fn is not None
    pairs = [(c, item(p, a)) for p, c, a in SAMPLES]
    first = rewards.score_many(fn, pairs, timeout_s=30.0)
    again = rewards.score_many(fn, pairs, timeout_s=30.0)
    assert first == again  # greedy, at fixed weights
    answers = judge_expected(servers["judge"], TaskSection().judge_template, SAMPLES)
    assert any(s.reason == "" and 0 < s.reward < 1 for s in first), answers  # a number, scaled (digits doubled)
    for answer, scored in zip(answers, first, strict=True):
        number = re.search(r"[-+]?(\d+(\.\d*)?|\.\d+)", answer)
        if number is None:
            assert scored.reward == 0.0 and f"the judge's answer holds no number: {answer[:80]!r}" in scored.reason
        else:
            value = min(1.0, max(0.0, float(number.group()) / 10.0))
            assert scored.reason == "" and scored.components == {"judge": value, "reward": value}, (answer, scored)

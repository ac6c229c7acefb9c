"""Verifiable rewards: final-answer extraction, the exact / numeric / math built-ins, rewards that return a dict
of components, and the failures ``score`` turns into a zero with a reason."""

from __future__ import annotations

import sys
import threading
import time
from fractions import Fraction

import pytest

from dora.config import ConfigError
from dora.ids import Finish
from dora.rollout.engines.versions import Versions
from dora.tasks import rewards, verify
from dora.tasks.tasks import Item
from dora.wire import codec, packed


def item(answer: str) -> Item:
    return Item(task="dataset", index=0, prompt="q", answer=answer)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} first, then \boxed{ 2 } at last", "2"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{5} and then \boxed{6", "5"),  # cut off by max_tokens: the last box that closes
        (r"\boxed {x = 3}", "x = 3"),
        ("48/2 = 24 apples\n#### 72", "72"),
        ("#### 72\nthat is all = 5", "72"),  # #### comes before =, wherever they are
        ("reasoning = 3 <<1+2=3>>\n#### 3", "3"),
        ("12+30=42", "42"),
        ("= 42\nbecause", "42"),
        ("first line\nsecond line\n\n  ", "second line"),
        ("just 9", "just 9"),
        ("", ""),
        ("  \n ", ""),
        ("ends with =", ""),
        (r"\boxed{}", ""),
    ],
)
def test_final_answer_extraction(text, expected):
    assert verify.final_answer(text) == expected


def test_final_answer_reads_many_unclosed_boxes_in_linear_time():
    text = r"\boxed{" * 50_000 + r"\boxed{8}"
    started = time.perf_counter()
    assert verify.final_answer(text) == "8"
    assert verify.last_boxed(r"\boxed{" * 50_000) is None
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("42", "42", 1.0),
        ("The answer is\n42.", "42", 1.0),
        ("#### 1,234", "reasoning\n#### 1234", 1.0),
        (r"\boxed{Paris}", "Paris", 1.0),
        (r"\boxed{paris}", "Paris", 0.0),  # case kept
        ("42", "43", 0.0),
        ("0.5", "1/2", 0.0),  # text, not value
        ("", "42", 0.0),
        ("=", "42", 0.0),
    ],
)
def test_exact(completion, reference, expected):
    assert rewards.exact(completion, item(reference)) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("+3.5", Fraction(7, 2)),
        ("1,234,567", Fraction(1234567)),
        ("1,234.5", Fraction(2469, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3 / 4", Fraction(-3, 4)),
        ("50%", Fraction(50)),
        ("1.5e-3", Fraction(3, 2000)),
        ("2E+3", Fraction(2000)),
        (".5", Fraction(1, 2)),
        ("42.", Fraction(42)),
        ("3/0", None),
        ("x", None),
        ("1e99999", None),  # an exponent of more than 3 digits is not read (10**99999 is no answer)
        ("12,34", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert verify.parse_number(text) == value


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("1,234", "1234", 1.0),
        (r"\boxed{0.5}", "1/2", 1.0),
        ("#### 50%", "#### 50", 1.0),
        ("1e-3", "0.001", 1.0),
        ("0.3333333", "1/3", 1.0),  # within a relative 1e-6
        ("0.333", "1/3", 0.0),
        ("0.5", "0.51", 0.0),
        ("1000001", "1000000", 0.0),  # integers: exact, though within 1e-6 relatively
        ("12345678901234567890123", "12345678901234567890124", 0.0),
        ("-5", "5", 0.0),
        ("five", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_numeric(completion, reference, expected):
    assert rewards.numeric(completion, item(reference)) == expected


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        (r"\frac{1}{2}", "0.5", 1.0),
        (r"so \boxed{\frac{1}{2}}", "1/2", 1.0),
        ("1/2", "0.5", 1.0),
        (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("1e-3", "0.001", 1.0),
        (r"\boxed{2\pi}", r"2\pi", 1.0),
        ("x^2 + 2x + 1", "(x+1)^2", 1.0),
        ("0.5", "0.51", 0.0),
        (r"\frac{1}{3}", "0.5", 0.0),
        (r"\boxed{2\pi}", "2", 0.0),
        ("", "0.5", 0.0),
    ],
)
def test_math(completion, reference, expected):
    assert rewards.math(completion, item(reference)) == expected


def test_math_works_off_the_main_thread_where_score_runs_it():
    got: dict[str, float] = {}

    def run() -> None:
        got["reward"] = rewards.math(r"\boxed{\frac{1}{2}}", item("0.5"))
        got["wrong"] = rewards.math(r"\boxed{\frac{1}{3}}", item("0.5"))

    t = threading.Thread(target=run, name="not-main")
    t.start()
    t.join(30)
    assert got == {"reward": 1.0, "wrong": 0.0}
    # score() runs it in its pool: math-verify's signal.alarm would raise there if its timeouts were on
    assert rewards.score(rewards.math, r"\boxed{\frac{1}{2}}", item("0.5"), timeout_s=30) == rewards.Scored(1.0)


def test_a_reference_that_does_not_fit_the_reward_fails_with_the_reason():
    for fn, reference, fragment in (
        (rewards.exact, "  ", "no final answer"),
        (rewards.numeric, "Paris", "is not a number"),
        (rewards.math, "", "no final answer"),
    ):
        scored = rewards.score(fn, "42", item(reference), timeout_s=30)
        assert (
            scored.reward == 0.0
            and scored.reason.startswith("reward raised ValueError")
            and fragment in (scored.reason)
        ), scored


def _components(completion: str, it: Item) -> dict[str, float]:
    return {"correct": 1.0, "format": 0.25}


def _with_reward(completion: str, it: Item) -> dict[str, float]:
    return {"reward": 0.75, "correct": 1.0, "format": 0.25}


def _make(value: object):
    return lambda completion, it: value


def test_a_reward_may_return_named_components():
    assert rewards.score(_components, "x", item("1")) == rewards.Scored(1.25, "", {"correct": 1.0, "format": 0.25})
    scored = rewards.score(_with_reward, "x", item("1"))
    assert scored.reward == 0.75 and scored.components == {"reward": 0.75, "correct": 1.0, "format": 0.25}
    assert rewards.score(_make({"a": 2, "b": -1}), "x", item("1")) == rewards.Scored(1.0, "", {"a": 2.0, "b": -1.0})


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({}, "reward returned an empty dict"),
        ({"correct": 1.0, "format": float("nan")}, "reward component 'format' is nan, not a finite number"),
        ({"correct": float("inf")}, "reward component 'correct' is inf"),
        ({"correct": True}, "reward component 'correct' is True"),
        ({"correct": "1"}, "reward component 'correct' is '1'"),
        ({1: 1.0}, "reward component name 1 is not a string"),
        ({"": 1.0}, "reward component name '' is not a string"),
        ({f"c{i}": 1.0 for i in range(rewards.MAX_COMPONENTS + 1)}, "33 components, more than 32"),
        ({"a": 1e308, "b": 1e308}, "reward components sum to inf"),
        ("1.0", "reward returned '1.0', not a finite number"),
        (None, "reward returned None, not a finite number"),
    ],
)
def test_a_bad_dict_or_value_scores_zero_with_the_reason(value, fragment):
    scored = rewards.score(_make(value), "x", item("1"))
    assert scored.reward == 0.0 and scored.components == {} and fragment in scored.reason, scored


def _raises(completion: str, it: Item) -> float:
    raise RuntimeError("the grader broke")


def test_a_reward_that_raises_scores_zero_with_the_reason():
    assert rewards.score(_raises, "x", item("1")) == rewards.Scored(0.0, "reward raised RuntimeError: the grader broke")


@pytest.mark.parametrize("name", ["exact", "numeric", "math", "exact_match", "countdown"])
def test_short_names_and_full_specs_resolve_to_the_built_ins(name):
    fn = getattr(rewards, name)
    assert rewards.resolve(name) is fn
    assert rewards.resolve(f"dora.tasks.rewards:{name}") is fn


def test_any_module_function_still_resolves():
    assert rewards.resolve("tests.unit.test_rewards:_components") is _components
    with pytest.raises(ConfigError, match="module:function"):
        rewards.resolve("maths")


def test_math_without_math_verify_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # an import of it now fails, as if not installed
    assert not verify.math_verify_installed()
    with pytest.raises(ConfigError) as e:
        rewards.resolve("math")
    assert str(e.value) == "task.reward = \"math\" needs the math extra: pip install 'dora-rl[math]'"
    assert isinstance(e.value, ValueError)  # what the processes print as one line, exiting 2
    with pytest.raises(ConfigError, match="needs the math extra"):
        rewards.resolve("dora.tasks.rewards:math")
    assert rewards.resolve("numeric") is rewards.numeric  # the others need nothing
    scored = rewards.score(rewards.math, "1", item("1"))
    assert scored.reward == 0.0 and "ModuleNotFoundError" in scored.reason, scored


def test_a_worker_sends_the_components_and_the_reason_with_its_sample():
    from dora.rollout.engines.base import Sample
    from dora.rollout.engines.stepped import StepWorkerEngine

    class Task:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def score(self, group: int, tokens: list[int]) -> rewards.Scored:
            return rewards.score(self.fn, " ".join(map(str, tokens)), item("1"))

    class Engine:
        name, version, versions = "fake", 3, Versions(1, 3, None)

    sample = Sample(group_id=5, attempt=1, index=2, prompt=[1], max_tokens=4, temperature=1.0, top_p=1.0,
                    tokens=[7, 8], logprobs=[-0.5, -0.25], finish=Finish.STOP)  # fmt: skip
    good = StepWorkerEngine(Engine(), Task(_components)).result(sample, broker_epoch=9)
    assert (good.reward, good.reward_components, good.reward_error) == (1.25, {"correct": 1.0, "format": 0.25}, "")
    (back,) = codec.decode(codec.encode(packed.pack_samples([good]))).samples
    assert back.reward_components == {"correct": 1.0, "format": 0.25} and back.broker_epoch == 9
    bad = StepWorkerEngine(Engine(), Task(_raises)).result(sample, broker_epoch=9)
    assert (bad.reward, bad.reward_components) == (0.0, {})
    (back,) = codec.decode(codec.encode(packed.pack_samples([bad]))).samples
    assert back.reward_error == "reward raised RuntimeError: the grader broke"

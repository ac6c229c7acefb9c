"""bench/convergence_summary.py: final accuracy, parity, time to sync's final accuracy and throughput, on
hand-made runs whose figures are worked out by hand below."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "convergence_summary.py"
spec = importlib.util.spec_from_file_location("convergence_summary", PATH)
summary_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary_module)


def run(step_s: float, evals: list[tuple[int, float, float]], final: float, *, staleness: int = 0,
        last_reward: float = 1.0) -> dict:  # fmt: skip
    """Five steps of 100 tokens, one every ``step_s`` seconds, rewards 0.2 then ``last_reward``; the curve on 20
    rows, the final on 50."""
    steps = [{"step": i, "reward_mean": 0.2 if i < 4 else last_reward, "tokens": 100.0, "elapsed_s": step_s * (i + 1),
              "staleness_max": staleness} for i in range(5)]  # fmt: skip
    curve = [{"version": v, "elapsed_s": t, "accuracy": a, "rows": 20.0} for v, t, a in evals]
    return {"steps": steps, "evals": curve[::-1], "final": {"version": 5, "accuracy": final, "rows": 50.0}}


RUNS = {
    "sync": [
        run(1.0, [(0, 0.0, 0.40), (2, 2.0, 0.50), (5, 5.0, 0.60)], 0.62),  # never reaches 0.70
        run(1.0, [(0, 0.0, 0.40), (2, 2.0, 0.70), (5, 5.0, 0.80)], 0.58, last_reward=0.5),  # 0.70 at 2.0 s
    ],
    "dora-k1": [
        run(0.5, [(0, 0.0, 0.40), (2, 1.0, 0.70), (5, 2.5, 0.75)], 0.64, staleness=1),  # 1.0 s
        run(0.6, [(0, 0.0, 0.40), (2, 1.5, 0.71), (5, 3.0, 0.72)], 0.70, staleness=1),  # 1.5 s
    ],
    "dora-k3": [
        run(0.5, [(0, 0.0, 0.40), (2, 1.0, 0.50), (5, 2.5, 0.60)], 0.80, staleness=3),
        run(0.5, [(0, 0.0, 0.40), (2, 1.0, 0.50), (5, 2.5, 0.69)], 0.84, staleness=2),
    ],
}


def test_target_is_syncs_last_evaluation_on_the_curves_rows() -> None:
    s = summary_module.summarize(RUNS)
    assert s["target_accuracy"] == pytest.approx((0.60 + 0.80) / 2)
    assert s["target_rows"] == 20.0


def test_final_accuracy_se_and_parity() -> None:
    v = summary_module.summarize(RUNS)["variants"]
    # sync: mean(0.62, 0.58) = 0.60; stdev = 0.04 / sqrt(2); SE = stdev / sqrt(2) = 0.02
    assert v["sync"]["final_accuracy"] == pytest.approx(0.60)
    assert v["sync"]["final_accuracy_se"] == pytest.approx(0.02)
    assert v["sync"]["final_rows"] == 50.0
    # dora-k1: mean 0.67, SE 0.03; SE of the difference sqrt(0.02² + 0.03²) = 0.03606; |0.07| <= 0.0721: parity
    assert v["dora-k1"]["final_accuracy"] == pytest.approx(0.67)
    assert v["dora-k1"]["final_accuracy_se"] == pytest.approx(0.03)
    assert v["dora-k1"]["diff_se"] == pytest.approx(math.sqrt(0.0013))
    assert v["dora-k1"]["parity"] is True
    # dora-k3: mean 0.82, SE 0.02; |0.22| > 2 * sqrt(0.0008) = 0.0566: no parity
    assert v["dora-k3"]["final_accuracy"] == pytest.approx(0.82)
    assert v["dora-k3"]["parity"] is False
    assert v["sync"]["parity"] is True


def test_time_to_syncs_final_accuracy() -> None:
    v = summary_module.summarize(RUNS)["variants"]
    # target 0.70: sync seed 0 never gets there, seed 1 at 2.0 s (0.70 counts: at or above)
    assert (v["sync"]["time_to_target_s"], v["sync"]["reached"], v["sync"]["seeds"]) == (pytest.approx(2.0), 1, 2)
    # dora-k1 at 1.0 s and 1.5 s: mean 1.25 s, 0.625 of sync's 2.0 s
    assert v["dora-k1"]["time_to_target_s"] == pytest.approx(1.25)
    assert v["dora-k1"]["reached"] == 2
    assert v["dora-k1"]["time_ratio"] == pytest.approx(0.625)
    # dora-k3 peaks at 0.69: never
    assert (v["dora-k3"]["time_to_target_s"], v["dora-k3"]["reached"], v["dora-k3"]["time_ratio"]) == (None, 0, None)


def test_throughput_reward_and_staleness() -> None:
    v = summary_module.summarize(RUNS)["variants"]
    # sync: 500 tokens in 5 s per seed; dora-k1: 500 / 2.5 = 200 and 500 / 3.0 = 166.67
    assert v["sync"]["wall_s"] == pytest.approx(5.0)
    assert v["sync"]["s_per_step"] == pytest.approx(1.0)
    assert v["sync"]["tokens_per_s"] == pytest.approx(100.0)
    assert v["dora-k1"]["wall_s"] == pytest.approx(2.75)
    assert v["dora-k1"]["s_per_step"] == pytest.approx(0.55)
    assert v["dora-k1"]["tokens_per_s"] == pytest.approx((200.0 + 500.0 / 3.0) / 2)
    # final reward: the last 20% of 5 steps is the last step: mean(1.0, 0.5)
    assert v["sync"]["final_reward"] == pytest.approx(0.75)
    assert (v["sync"]["max_staleness"], v["dora-k1"]["max_staleness"], v["dora-k3"]["max_staleness"]) == (0, 1, 3)


def test_plot_writes_a_figure(tmp_path: pathlib.Path) -> None:
    summary_module.plot(RUNS, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0

"""`dora plot`: a bad run directory is one line and exit 2; spans come from the timeline events; figures are PNGs.
(The figures of a real run are drawn in tests/live/test_dora_run.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dora.ops import plot
from dora.ops.plot import Span, render, spans


def dora_plot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dora", "plot", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (lambda d: None, "no such directory"),
        (lambda d: d.mkdir(), "no metrics.jsonl"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("")), "no train step"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')), ":2 is not"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("[1, 2]\n")), "not a JSON object"),
    ],
    ids=["missing", "empty dir", "empty file", "bad line", "not an object"],
)
def test_a_bad_run_directory_is_one_line_and_exit_2(tmp_path, setup, says):
    rundir = tmp_path / "run"
    setup(rundir)
    r = dora_plot(str(rundir))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and says in r.stderr and r.stderr.startswith("dora plot: "), r.stderr


def test_plot_help_never_imports_torch():
    code = (
        "import sys\nfrom dora.cli import main\ntry:\n    main(['plot', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout, r.stdout + r.stderr


def test_spans_follow_each_worker_from_assign_to_load_to_loss():
    events = [
        {"t": 0.0, "event": "started", "max_staleness": 1},
        {"t": 0.5, "event": "joined", "worker": "rollout/a/1"},
        {"t": 1.0, "event": "assigned", "worker": "rollout/a/1", "version": 0},
        {"t": 1.2, "event": "joined", "worker": "rollout/b/1"},
        {"t": 1.3, "event": "assigned", "worker": "rollout/b/1", "version": 0},
        {"t": 2.0, "event": "ready", "worker": "rollout/a/1", "version": 0},
        {"t": 2.5, "event": "ready", "worker": "rollout/b/1", "version": 0},
        {"t": 5.0, "event": "published", "version": 1},
        {"t": 5.0, "event": "assigned", "worker": "rollout/a/1", "version": 1},
        {"t": 6.0, "event": "ready", "worker": "rollout/a/1", "version": 1},
        {"t": 8.0, "event": "lost", "worker": "rollout/a/1", "reason": "silent"},
        {"t": 8.5, "event": "joined", "worker": "rollout/b/1"},  # a restart under the same name ends its spans
        {"t": 9.0, "event": "assigned", "worker": "rollout/b/1", "version": 1},
    ]
    got = spans(events[::-1], end=10.0)  # the order in the file does not matter: time does
    assert list(got) == ["rollout/a/1", "rollout/b/1"]
    assert got["rollout/a/1"] == [Span(1.0, 2.0, 0, True), Span(2.0, 5.0, 0, False), Span(5.0, 6.0, 1, True),
                                  Span(6.0, 8.0, 1, False)]  # fmt: skip
    assert got["rollout/b/1"] == [Span(1.3, 2.5, 0, True), Span(2.5, 8.5, 0, False), Span(9.0, 10.0, 1, True)]


def test_a_cut_last_line_is_left_out_and_no_timeline_means_no_timeline_png(tmp_path):
    rows = [{"step": s, "version": s + 1, "reward_mean": 0.1 * s, "staleness": {"0": 4, "1": 4 * s},
             "max_staleness": 1, "elapsed_s": 1.0 + s, "t": 100.0 + s} for s in range(3)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "ver')
    paths = render(tmp_path, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["health.png", "reward.png", "staleness.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def noted(monkeypatch) -> dict[str, list[str]]:
    """The notes written on each figure's panels, by file name, as render saves them."""
    notes: dict[str, list[str]] = {}
    save = plot._save

    def noting(fig, path):
        notes[path.name] = [t.get_text() for ax in fig.axes for t in ax.texts]
        return save(fig, path)

    monkeypatch.setattr(plot, "_save", noting)
    return notes


def health_run(rundir, *, kl: bool) -> None:
    """A run's metrics.jsonl (with or without kl_ref, as learner.kl_coef is set or not) and eval.jsonl."""
    rundir.mkdir()
    rows = [{"step": s, "version": s + 1, "reward_mean": 0.1 * s, "entropy": 1.2 - 0.05 * s, "staleness": {"0": 8},
             **({"kl_ref": 0.001 * s} if kl else {})} for s in range(12)]  # fmt: skip
    (rundir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": v, "version": v, "accuracy": 0.3 + 0.02 * v, "rows": 50} for v in (0, 4, 8, 12)]
    (rundir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


@pytest.mark.parametrize("kl", [True, False], ids=["with kl_ref", "without kl_ref"])
def test_the_health_page_draws_four_panels_and_says_which_number_the_run_lacks(tmp_path, monkeypatch, kl):
    import matplotlib.image

    notes = noted(monkeypatch)
    health_run(tmp_path / "run", kl=kl)
    paths = render(tmp_path / "run")
    assert sorted(p.name for p in paths) == ["eval.png", "health.png", "reward.png", "staleness.png"]
    page = matplotlib.image.imread(tmp_path / "run" / "health.png")
    assert page.ndim == 3 and page.shape[0] > 500 and page.shape[1] > 800
    assert page.std() > 0.01  # drawn on, not blank
    assert notes["health.png"] == ([] if kl else ["no kl_ref in metrics.jsonl (learner.kl_coef is 0)"])


def test_a_run_without_held_out_rounds_or_health_numbers_still_gets_its_health_page(tmp_path, monkeypatch):
    notes = noted(monkeypatch)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "staleness": {}}\n')
    (health,) = [p for p in render(tmp_path) if p.name == "health.png"]
    assert health.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert notes["health.png"] == ["no entropy in metrics.jsonl", "no kl_ref in metrics.jsonl (learner.kl_coef is 0)",
                                   "no reward_mean in metrics.jsonl", "no held-out rounds (eval.jsonl)"]  # fmt: skip

"""examples/slurm/dora.sbatch keeps each step's exit status, and every signal it is sent, whatever lands meanwhile.

Slurm and its users send the batch script TERM (scancel, the time limit) and USR1 (the early warning) while
steps end. bash 5.2 loses a child's status when a trapped signal lands in `wait` for a child it has already
reaped (the `wait` returns 128 + the signal, and a second one 127), and loses the trap itself when it lands while
a command or process substitution runs (the handler fails to parse). The script's own functions (`log`, `step`,
`reap`, `count_running`), taken from it as they are, run forty steps here under a storm of trapped signals: every
status must come back, no trap may fail, and a step sent TERM itself still takes it."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "slurm" / "dora.sbatch"
pytestmark = pytest.mark.timeout(60)

DRIVER = r"""
on_sig() { SIGNALS=$((SIGNALS + 1)); log "signal $SIGNALS"; }
trap on_sig TERM USR1
SIGNALS=0
declare -A PID=() CODE=()
STEPS=()
for ((i = 1; i <= 40; i++)); do step "s$i" bash -c "sleep 0.0$((i % 9 + 1)); exit $((i % 4))"; done
step takes-term bash -c 'trap "exit 7" TERM; while :; do sleep 0.05; done'
( for ((k = 0; k < 400; k++)); do kill -"$( ((k % 2)) && echo TERM || echo USR1)" $$; sleep 0.001; done ) &
STORM=$!
for ((round = 1; round <= 600; round++)); do
    reap
    if (( round == 20 )) && read -r pid < "$STEP_DIR/takes-term.pid"; then kill -TERM "$pid"; fi
    count_running
    (( RUNNING == 0 )) && break
    sleep 0.01 & wait $!
done
wait "$STORM"
for name in "${STEPS[@]}"; do echo "status $name ${CODE[$name]:-none}"; done
echo "signals $SIGNALS"
"""


def function(script: str, name: str) -> str:
    """The definition of bash function ``name`` in ``script``, as written there."""
    one_line = re.search(rf"^{name}\(\) {{.*}}.*$", script, re.M)
    return one_line.group(0) if one_line else re.search(rf"^{name}\(\) {{.*?^}}$", script, re.M | re.S).group(0)


def test_forty_steps_ending_under_a_storm_of_trapped_signals_keep_their_statuses_and_no_trap_is_lost(tmp_path):
    script = SCRIPT.read_text()
    functions = "\n".join(function(script, f) for f in ("log", "step", "reap", "count_running"))
    steps = tmp_path / "steps"
    steps.mkdir()
    env = {"STEP_DIR": str(steps), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-c", f"{functions}\n{DRIVER}"], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0 and "unexpected EOF" not in proc.stderr, proc.stderr
    got = dict(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("status "))
    assert got == {**{f"s{i}": str(i % 4) for i in range(1, 41)}, "takes-term": "7"}, proc.stdout
    assert "s40 step exited with 0" in proc.stdout
    signals = int(proc.stdout.rsplit("signals ", 1)[1])
    assert signals > 20 and f"signal {signals}" in proc.stdout, proc.stdout  # the storm landed while steps ended


def test_once_its_traps_are_set_the_script_runs_no_command_or_process_substitution():
    lines = SCRIPT.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("trap on_usr1 USR1"))
    remote = False  # the sentinel's command, run by a bash srun starts on another node
    for number, line in enumerate(lines[first:], first + 1):
        remote = remote or "bash -c 'while sleep 5; do" in line
        if not remote:
            assert not re.search(r"\$\((?!\()|<\(", line), f"dora.sbatch:{number}: {line.strip()}"
        remote = remote and 'done\' "$BATCH_HOST"' not in line

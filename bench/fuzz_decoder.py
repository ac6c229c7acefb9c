"""Coverage-guided fuzzing of the wire decoder with atheris (``pip install atheris``).

    python bench/fuzz_decoder.py --runs 1000000          # about a minute or two on one core

The input is split into frames (a length byte before each); the first runs start from the canonical
message of every kind, so the fuzzer mutates valid messages as well as noise. Any exception other than
``DecodeError`` is a finding: atheris prints the input and the run stops with status 1. At the end it
prints executions, the slowest decode and peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.wire import codec  # noqa: E402

SLOWEST = [0.0]


def split(data: bytes) -> list[bytes]:
    frames, i = [], 0
    while i < len(data) and len(frames) < 64:
        n = data[i]
        frames.append(data[i + 1 : i + 1 + n * 8])
        i += 1 + n * 8
    return frames


def join(frames: list[bytes]) -> bytes:
    out = bytearray()
    for f in frames:
        f = bytes(f) + b"\0" * (-len(f) % 8)  # lengths are in 8-byte units so one byte covers a frame
        out += bytes([len(f) // 8]) + f
    return bytes(out)


def one(data: bytes) -> None:
    started = time.perf_counter()
    with contextlib.suppress(codec.DecodeError):
        codec.decode(split(data))
    SLOWEST[0] = max(SLOWEST[0], time.perf_counter() - started)


def seeds(folder: pathlib.Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.unit.wire_samples import canonical

    for kind, msg in canonical().items():
        frames = [bytes(f) for f in codec.encode(msg)]
        if all(len(f) < 255 * 8 for f in frames):
            (folder / kind).write_bytes(join(frames))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1_000_000)
    p.add_argument("--stats", help=argparse.SUPPRESS)  # set in the child that fuzzes
    args = p.parse_args(argv)
    if args.stats:
        return fuzz(args.runs, pathlib.Path(args.stats))
    # libFuzzer ends its process itself, so the fuzzing runs in a child that leaves its figures in a file
    stats = pathlib.Path(tempfile.mkdtemp(prefix="dora-fuzz-")) / "stats.json"
    started = time.monotonic()
    code = subprocess.call([sys.executable, __file__, "--runs", str(args.runs), "--stats", str(stats)])
    if stats.exists():
        s = json.loads(stats.read_text())
        print(
            f"\n{s['decodes']} decodes in {time.monotonic() - started:.0f} s, slowest {s['slowest_ms']:.2f} ms, "
            f"peak RSS {s['peak_mib']:.0f} MiB; " + ("a finding (above)" if code else "no exception but DecodeError")
        )
    return 1 if code else 0


def fuzz(runs: int, stats: pathlib.Path) -> int:
    import atheris

    corpus = stats.parent / "corpus"
    corpus.mkdir()
    seeds(corpus)
    count = [0]

    def counted(data: bytes) -> None:
        one(data)
        count[0] += 1
        if count[0] % 10_000 == 0 or count[0] >= runs:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            stats.write_text(json.dumps({"decodes": count[0], "slowest_ms": 1000 * SLOWEST[0], "peak_mib": peak}))

    atheris.instrument_all()
    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=4096", str(corpus)], counted)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

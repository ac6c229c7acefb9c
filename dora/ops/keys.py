"""`dora keys generate DIR`: CURVE keypairs for the broker and each role (see dora.actor.security)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dora keys", description=__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="write broker.key(_secret) and rollout/learner/client keypairs")
    gen.add_argument("dir")
    args = p.parse_args(argv)
    from dora.actor.security import generate

    try:
        made = generate(args.dir)
    except (FileExistsError, OSError) as e:
        print(f"dora keys: {e}", file=sys.stderr)
        return 2
    print(f"dora keys: wrote {', '.join(p.stem for p in made)} keypairs to {args.dir}; give every process "
          f"security.keys = {args.dir!r} (clients need broker.key and their own <role>.key_secret only)")  # fmt: skip
    return 0

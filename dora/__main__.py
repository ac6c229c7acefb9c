import sys

from dora.cli import main

if __name__ == "__main__":  # not when a spawned child (vLLM's shard processes, __mp_main__) imports this module
    sys.exit(main())

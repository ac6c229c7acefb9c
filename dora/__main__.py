import sys

from dora.cli import main

sys.exit(main())

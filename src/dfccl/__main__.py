"""``python -m dfccl demo | bench | info`` (also the ``dfccl`` console script)."""

import sys

from dfccl.cli import main

if __name__ == "__main__":
    sys.exit(main())

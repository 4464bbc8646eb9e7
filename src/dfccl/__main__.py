"""``python -m dfccl demo`` (also the ``dfccl`` console script)."""

import sys

from dfccl.demo import main

if __name__ == "__main__":
    sys.exit(main())

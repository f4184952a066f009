"""``python -m dtdsl.cli``: ``dtc``."""

import sys

from dtdsl.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m shmgate.node ...`` is ``shmgate ...``."""

import sys

from shmgate.node.cli import main

if __name__ == "__main__":
    sys.exit(main())

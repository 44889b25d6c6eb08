"""``python -m shmgate ...`` is the ``shmgate`` command."""

import sys

from shmgate.node.cli import main

if __name__ == "__main__":
    sys.exit(main())

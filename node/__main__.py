"""``python -m node ...`` is ``shmgate ...``."""

import sys

from node.cli import main

if __name__ == "__main__":
    sys.exit(main())

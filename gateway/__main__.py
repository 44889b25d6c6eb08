"""``python -m gateway ...`` is ``shmgate ...`` (the supervisor starts frontends this way)."""

import sys

from node.cli import main

if __name__ == "__main__":
    sys.exit(main())

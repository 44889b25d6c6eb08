"""``python -m shmgate.gateway ...`` is ``shmgate ...`` (the supervisor starts frontends this way)."""

import sys

from shmgate.gateway.cli import main

if __name__ == "__main__":
    sys.exit(main())

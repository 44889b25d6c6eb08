"""``python -m shmgate.gateway``: one HTTP frontend, as the supervisor of ``shmgate serve`` / ``gateway`` starts it.

Its configuration comes whole in its environment (gateway/config.py ``FrontendConfig``); the arguments
the supervisor adds (``frontend --slot N``) only name it in ps. Without that configuration,
``python -m shmgate.gateway ...`` is the ``shmgate`` command (``python -m shmgate.node``), as it always was.
"""

import os
import subprocess
import sys

from shmgate.gateway.config import FrontendConfig
from shmgate.gateway.process import run_frontend
from shmgate.shared.options import child_config

if __name__ == "__main__":
    config = child_config(FrontendConfig)
    if config is None:
        # the command line of the node (node/cli.py); exec, so that gateway/ imports nothing above it,
        # with this interpreter's own flags (-S, -X ...) kept
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        os.execv(sys.executable, [sys.executable, *flags, "-m", "shmgate.node", *sys.argv[1:]])
    sys.exit(run_frontend(config))

"""The node: what ``shmgate serve`` and ``shmgate gateway`` decide before any child starts, and the command
line above it.

- config.py: the supervisor's options and each command's configuration (typed, generating its flags);
- models.py: the models served, from ``--model`` flags or a ``--config`` TOML file;
- plan.py: placement of the workers, and each child's configuration;
- placement.py, gpu_fit.py, checks.py: which GPU each worker gets, whether the models fit, whether
  the machine has what the configuration asks for;
- listen.py: the listening socket; startup_log.py: what the supervisor logs;
- serve.py: the plan turned into supervised processes; cli.py: the ``shmgate`` subcommands.

It imports gateway/ (the frontends' configuration), worker/ (the workers'), supervise/ and shared/;
none of them imports it.
"""

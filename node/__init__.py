"""The node: what ``shmgate serve`` and ``shmgate gateway`` decide before any child starts, and the command line."""

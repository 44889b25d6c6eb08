"""shmgate: one installed import name; shmgate/ links to each top-level folder."""

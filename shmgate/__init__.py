"""shmgate: an OpenAI-compatible gateway for vision models with a shared-memory handoff.

One installed import name for the whole project. The repository keeps its parts as top-level folders
(gateway/, worker/, shared/, supervise/, bench_client/, ...); ``shmgate/`` holds a link to each, so the
source tree, mypy and the wheel all see them as ``shmgate.gateway``, ``shmgate.worker``, ... and an
installed shmgate never claims a top-level name such as ``shared`` or ``worker`` that another
distribution may own.
"""

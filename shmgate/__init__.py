"""shmgate: an OpenAI-compatible gateway for vision models with a shared-memory handoff.

One installed import name for the whole project. The repository keeps its parts as top-level folders
(gateway/, worker/, shared/, supervise/, bench_client/, node/); setup.py maps each into this package, so
the wheel and an editable install both see them as ``shmgate.gateway``, ``shmgate.worker``, ... and an
installed shmgate never claims a top-level name such as ``shared`` or ``worker`` that another
distribution may own. Nothing imports a bare ``gateway``: each file has one import name and one path.
"""

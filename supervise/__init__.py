"""The supervisor process of ``shmgate serve``: it starts, watches and restarts frontends and workers.

Its own package, beside gateway/ and worker/, because it supervises both and is neither: it knows
processes and the instance's slot rows, not HTTP or models. node/serve.py builds it.
"""

"""shmgate's benchmark suite: ``python -m bench <scenario> [options]``, run from the repository root.

bench/ is not installed with shmgate: run it from a checkout, where ``python -m`` finds it in the
current directory. ``bench/__main__.py`` lists the scenarios; ``bench/servers.py`` starts every server
under test and ``bench/report.py`` writes their tables; the load comes from ``bench_client.loadgen``.
docs/BENCHMARKS.md names each scenario with its command and its figures.
"""

"""Benchmarks (docs/performance.md). `python -m bench` is the serving
benchmark against the Scheduler API (bench/README.md); other modules here
are standalone benchmarks run as `python -m bench.<name>`."""

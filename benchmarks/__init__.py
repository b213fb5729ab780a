"""Benchmarks for asyncpipe on the reference workload (run ``python -m benchmarks.gpipe``)."""

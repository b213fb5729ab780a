"""Benchmarks on the reference workload (``python -m benchmarks.gpipe``, ``.schedules``)."""

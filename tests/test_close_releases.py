"""AsyncPipe.close() releases what the pipeline created: process groups, connections, mailboxes."""

from __future__ import annotations

import pytest
from close_job import PIPELINES, many_pipelines, refused_pipelines
from spawn import run_ranks

pytestmark = pytest.mark.slow

FDS, THREADS = 4, 2
"""How many file descriptors and OS threads the count may still grow by from the second
pipeline to the last (a leak adds about 9 and 6 per data-parallel pipeline, 5 and 3 per
pipeline with shared weights)."""


@pytest.mark.parametrize("kind", ["data_parallel", "shared", "rpc"])
def test_pipelines_built_and_closed_in_one_process_release_their_groups(kind: str) -> None:
    for rank, result in enumerate(run_ranks(many_pipelines, 2, kind, timeout=240)):
        counts = result["counts"]
        (fds, tasks, threads), (last_fds, last_tasks, last_threads) = counts[1], counts[-1]
        assert last_fds - fds <= FDS, (rank, kind, counts)
        assert last_tasks - tasks <= THREADS, (rank, kind, counts)
        assert last_threads - threads <= THREADS, (rank, kind, counts)
        before, after = result["boxes"]
        assert after == before, (rank, kind, result["boxes"])  # every mailbox removed
        assert "this pipeline was closed" in result["closed_error"], result["closed_error"]
        assert "this loss always fails" in result["failure"], result["failure"]
        assert result["grads"] > 0, result
        assert result["loss_error"] < 1e-5 and result["grad_error"] < 1e-5, (rank, kind, result)


def test_a_constructor_that_fails_after_creating_groups_releases_them() -> None:
    for rank, result in enumerate(run_ranks(refused_pipelines, 2, timeout=240)):
        counts = result["counts"]
        (fds, tasks, threads), (last_fds, last_tasks, last_threads) = counts[1], counts[-1]
        assert last_fds - fds <= FDS, (rank, counts)
        assert last_tasks - tasks <= THREADS, (rank, counts)
        assert last_threads - threads <= THREADS, (rank, counts)
        assert len(result["errors"]) == PIPELINES, result["errors"]
        assert all("this layer cannot be built" in e for e in result["errors"]), result
        assert result["loss_error"] < 1e-5, (rank, result)

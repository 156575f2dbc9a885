"""Fixtures shared by the test modules, and the thread count of pytest-xdist workers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _share_the_cores_among_xdist_workers() -> None:
    """Under pytest-xdist every worker runs a test at once: each gets its share of the cores for torch's
    intra-op threads, and so do the processes its tests start (examples, benchmark scripts), instead of
    all of them. Oversubscribed, OpenMP's busy waiting burns the cores the other workers need; the gloo
    ranks run one thread each already (tests/dist.py). An OMP_NUM_THREADS set by the user is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores_among_xdist_workers()


@pytest.fixture(scope="module")
def single_rank_group():
    """A real one-process gloo group: ops run their collectives, which are identities.

    Module-scoped: other modules initialize the fake process group, and a process has
    one default group at a time.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()

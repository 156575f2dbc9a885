"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def single_rank_group():
    """A real one-process gloo group: ops run their collectives, which are identities.

    Module-scoped: other modules initialize the fake process group, and a process has
    one default group at a time.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()

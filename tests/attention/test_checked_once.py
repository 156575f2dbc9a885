"""A pack's offsets are checked once per public call, and the ranks agree once per step.

Counted on real gloo ranks (where agreements run) by wrapping ``checks.check_cu_seqlens`` and
``comm.groups.agree`` wherever cpcompile's modules hold them: the data loader's ``shard_batch``,
eager ``cp_attention`` calls and their backward, and the steps of a compiled model after the one
that compiled it (what a step runs, not what tracing ran).
"""

from __future__ import annotations

import collections
import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

import cpcompile
from tests.dist import run_ranks

pytestmark = pytest.mark.distributed

CU = torch.tensor([0, 5, 14, 16, 24], dtype=torch.int32)


@contextlib.contextmanager
def counted():
    """Within: a counter of the calls of ``check_cu_seqlens`` (by the name it checks) and ``agree``."""
    import cpcompile.checks as checks
    import cpcompile.comm.groups as groups

    originals = {"check_cu_seqlens": checks.check_cu_seqlens, "agree": groups.agree}
    counts: collections.Counter = collections.Counter()

    def wrap(name, f):
        def counting(*args, **kwargs):
            counts[f"{name} {args[0]}" if name == "check_cu_seqlens" else name] += 1
            return f(*args, **kwargs)

        return counting

    patched = []
    for module in [m for n, m in sys.modules.items() if n == "cpcompile" or n.startswith("cpcompile.")]:
        for name, f in originals.items():
            if getattr(module, name, None) is f:
                setattr(module, name, wrap(name, f))
                patched.append((module, name, f))
    try:
        yield counts
    finally:
        for module, name, f in patched:
            setattr(module, name, f)


def _eager(rank: int, world: int) -> None:
    with counted() as counts:
        batch = cpcompile.shard_batch({"x": torch.randn(24, 2, 4)}, CU, cp_size=world, rank=rank, strategy="balanced")
    assert dict(counts) == {"check_cu_seqlens cu_seqlens": 1}, counts
    q = batch.tensors["x"].requires_grad_()
    outs = []
    for call in range(2):  # the first call makes the step's plan, the second finds it
        with counted() as counts, cpcompile.strategy(batch):
            outs.append(cpcompile.cp_attention(q, q, q, batch.cu_seqlens, cu_seqlens_padded=batch.cu_seqlens_padded))
        want = {"check_cu_seqlens cu_seqlens": 1, "check_cu_seqlens cu_seqlens_padded": 1, "agree": 1}
        assert dict(counts) == want, (call, counts)
    with counted() as counts:
        sum(o.sum() for o in outs).backward()  # one backward pass through both calls
    assert dict(counts) == {"agree": 1}, counts


def _compiled(rank: int, world: int) -> None:
    batch = cpcompile.shard_batch({"x": torch.randn(24, 2, 4)}, CU, cp_size=world, rank=rank, strategy="balanced")

    def model(q, cu_seqlens, cu_seqlens_padded):
        for _ in range(3):  # three layers over one pack
            q = cpcompile.packed_attention(q, q, q, cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        return q

    compiled = torch.compile(model, backend=cpcompile.backend(group=dist.group.WORLD), dynamic=True)
    q = batch.tensors["x"].requires_grad_()
    for step in range(3):
        with counted() as counts, cpcompile.strategy(batch):
            out = compiled(q, batch.cu_seqlens, batch.cu_seqlens_padded)
        if step:  # the first step compiled: tracing checks on fake tensors, which a step does not run
            want = {"check_cu_seqlens cu_seqlens": 1, "check_cu_seqlens cu_seqlens_padded": 1, "agree": 1}
            assert dict(counts) == want, (step, counts)
        with counted() as counts:
            out.sum().backward()
        assert dict(counts) == {"agree": 1}, (step, counts)


def test_eager_calls_check_the_offsets_once_and_agree_once():
    run_ranks(_eager, 2)


def test_a_compiled_step_checks_the_offsets_once_and_agrees_once_per_pass():
    run_ranks(_compiled, 2)

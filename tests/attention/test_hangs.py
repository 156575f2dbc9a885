"""A rank that fails in the middle of a step ends in an error on every rank, not a hang.

Two ways of failing that no check before the forward's collectives can see (issue 57, items 9
and 10), on 2 real gloo ranks:

- A rank fails after the forward, catches the error and starts the next step while the other
  runs the backward: the backward's agreement (``ops.common.communicates``) meets the next
  forward's, and both ranks raise at once, naming where each one is; eager on every K/V path, and
  a compiled model. Both ranks are in step again after the error: the cases share one spawn.
- A rank's kernel raises inside the op once its collectives began (forward and backward): it
  raises its own error with a note, and the other raises, within the process group's timeout,
  an error naming the op and the step. The group is broken after a timeout, so each case runs
  in a group of its own with a short timeout, and the world group stays usable. Where the other
  rank's op completed and both reach an agreement, the failed rank tells it there: both raise at once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import cpcompile
from tests.dist import run_ranks

pytestmark = pytest.mark.distributed

CU = torch.tensor([0, 5, 16], dtype=torch.int32)
#: (strategy, kv, head_parallel) per K/V path: all-gather, sparse exchange, ring, head-parallel (Ulysses)
PATHS = [
    ("no_load_balance", "auto", 1),
    ("balanced", "auto", 1),
    ("striped", "ring", 1),
    ("no_load_balance", "heads", 2),
]
OPS = {"auto": "cp_attention", "ring": "cp_ring_attention"}
#: the timeout of each item-10 case's group: the bound on the wait of the rank that did not fail
TIMEOUT_S = 3


def _inputs(rank: int, world: int, spec, seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = cpcompile.shard_batch(
        {n: torch.randn(16, 2, 4, generator=g) for n in "qkv"}, CU, cp_size=world, rank=rank, strategy=spec
    )
    return batch, [batch.tensors[n].clone().requires_grad_() for n in "qkv"]


def _spec(strategy: str, kv: str, head_parallel: int):
    return cpcompile.StrategySpec(cpcompile.Strategy(strategy), kv=kv, head_parallel=head_parallel)


def _attention(rank, world, path, seed, group=None):
    spec = _spec(*path)
    batch, (q, k, v) = _inputs(rank, world, spec, seed)
    kw = dict(cu_seqlens_padded=batch.cu_seqlens_padded, strategy=batch, group=group)
    return cpcompile.cp_attention(q, k, v, batch.cu_seqlens, **kw)


def _op(path) -> str:
    return "cp_head_attention" if path[2] > 1 else OPS[path[1]]


def _skips_backward(rank: int, world: int) -> None:
    """Rank 1 drops step 0's output (its loss failed, say) and starts step 1; rank 0 runs step 0's
    backward. Every rank raises at once, naming both steps; then both are in step again."""
    for path in PATHS:
        start = time.monotonic()
        out = _attention(rank, world, path, seed=0)
        with pytest.raises(RuntimeError) as raised:
            if rank == 0:
                out.sum().backward()
            else:
                _attention(rank, world, path, seed=1)
        message = str(raised.value)
        assert f"rank 0 at the backward of {_op(path)}" in message, message
        assert "rank 1 at the forward" in message and f"this is rank {rank}" in message, message
        assert time.monotonic() - start < 10, f"{path}: detected only after the timeout"
        del raised, out
        # in step again: a whole step runs on both ranks
        _attention(rank, world, path, seed=2).sum().backward()


def _told_at_the_next_agreement(rank: int, world: int) -> None:
    """Rank 1's kernel raises in the forward once K/V are gathered, so rank 0's forward completes; both
    go on to a forward (rank 0 its next layer, rank 1 its next step), where rank 1 tells rank 0: both
    raise at once, and are in step again."""
    path = PATHS[0]
    kernels = sys.modules["cpcompile.kernels"]
    select = kernels.select
    if rank == 1:
        kernels.select = lambda *a, **kw: _Raising(select(*a, **kw), "forward")
    try:
        with pytest.raises(RuntimeError, match="kernel failed on this rank") if rank == 1 else contextlib.nullcontext():
            _attention(rank, world, path, seed=0)
    finally:
        kernels.select = select
    start = time.monotonic()
    told = r"rank 1 failed inside the forward of cp_attention \(all_gather\), once its collectives had begun"
    with pytest.raises(RuntimeError, match=told):
        _attention(rank, world, path, seed=1)
    assert time.monotonic() - start < 10, "detected only after the timeout"
    _attention(rank, world, path, seed=2).sum().backward()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24, bias=False)

    def forward(self, x, cu):  # x [T, 8]
        q, k, v = self.qkv(x).view(-1, 6, 4).split(2, dim=1)
        return cpcompile.packed_attention(q, k, v, cu).flatten(1)


def _compiled_skips_backward(rank: int, world: int, overlap_kv: bool = False) -> None:
    """As :func:`_skips_backward`, a compiled model: the plan op's agreement, at the start of rank 1's
    next compiled forward, meets rank 0's compiled backward's (``overlap_kv``: with the K/V transfers as
    graph nodes, whose backward's agreement runs in the re-gather)."""
    torch.manual_seed(0)
    model = Model()
    backend = cpcompile.backend(inner="aot_eager", overlap_kv=overlap_kv)
    compiled = torch.compile(model, backend=backend, dynamic=True)

    def step(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        batch = cpcompile.shard_batch({"x": torch.randn(16, 8, generator=g)}, CU, cp_size=world, rank=rank)
        with cpcompile.strategy(batch):  # the layout the batch was sharded in
            return compiled(batch.tensors["x"], batch.cu_seqlens)

    step(0).sum().backward()  # compiled, forward and backward, alike on both ranks
    start = time.monotonic()
    out = step(1)
    with pytest.raises(RuntimeError) as raised:
        if rank == 0:
            out.sum().backward()
        else:
            step(2)
    message = str(raised.value)
    assert "rank 0 at the backward of cp_attention" in message and "rank 1 at the forward" in message, message
    assert time.monotonic() - start < 10, "detected only after the timeout"
    del raised, out
    step(3).sum().backward()


def _hybrid_skips_backward(rank: int, world: int) -> None:
    """As :func:`_skips_backward`, on the hybrid (heads inside groups of 2 of 4 ranks): its backward starts
    with an all-to-all inside a head group, which first agrees on the whole CP group, where rank 1's next
    forward meets it."""
    path = ("no_load_balance", "heads", 2)
    start = time.monotonic()
    out = _attention(rank, world, path, seed=0)
    with pytest.raises(RuntimeError) as raised:
        if rank != 1:
            out.sum().backward()
        else:
            _attention(rank, world, path, seed=1)
    message = str(raised.value)
    assert "0, 2, 3 at the backward of head_all_to_all (the hybrid's)" in message, message
    assert "rank 1 at the forward" in message and f"this is rank {rank}" in message, message
    assert time.monotonic() - start < 10, "detected only after the timeout"
    del raised, out
    _attention(rank, world, path, seed=2).sum().backward()  # in step again


def test_a_rank_that_skips_the_backward_fails_every_rank_at_once():
    run_ranks(_skips_backward, 2, timeout_s=20)


def test_a_rank_that_failed_inside_an_op_tells_the_others_at_the_next_agreement():
    run_ranks(_told_at_the_next_agreement, 2, timeout_s=20)


@pytest.mark.parametrize("overlap_kv", [False, True], ids=["one_op", "overlap_kv"])
def test_a_compiled_rank_that_skips_the_backward_fails_every_rank_at_once(overlap_kv):
    run_ranks(functools.partial(_compiled_skips_backward, overlap_kv=overlap_kv), 2, timeout_s=20)


class _Raising:
    """A kernel that raises in ``direction`` ("forward" or "backward"), else runs ``kernel``."""

    def __init__(self, kernel, direction: str) -> None:
        self.kernel, self.direction = kernel, direction

    def forward(self, *args, **kwargs):
        if self.direction == "forward":
            raise RuntimeError("kernel failed on this rank")
        return self.kernel.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        if self.direction == "backward":
            raise RuntimeError("kernel failed on this rank")
        return self.kernel.backward(*args, **kwargs)


#: (path, direction of the failure): forward and backward, every path once
FAILING_KERNELS = [
    (PATHS[0], "forward"),
    (PATHS[2], "forward"),
    (PATHS[1], "backward"),
    (PATHS[3], "backward"),
]


def _kernel_fails_on_one_rank(rank: int, world: int) -> None:
    """Rank 1's kernel raises inside the op, after its collectives began; rank 0's runs. Rank 1
    raises its error at once, noted; rank 0 raises within the group's timeout, naming the op and
    the step where it waited (the op's collective, or the agreement before the next step)."""
    kernels = sys.modules["cpcompile.kernels"]  # the ops call kernels.select at each call
    select = kernels.select
    for path, direction in FAILING_KERNELS:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
        if rank == 1:
            kernels.select = lambda *a, direction=direction, **kw: _Raising(select(*a, **kw), direction)
        start = time.monotonic()
        try:
            with pytest.raises(RuntimeError) as raised:
                _attention(rank, world, path, seed=0, group=group).sum().backward()
        finally:
            kernels.select = select
        took = time.monotonic() - start
        error, notes = raised.value, "\n".join(getattr(raised.value, "__notes__", []))
        label = f"{path} {direction}, rank {rank}: {error}\n{notes}"
        if rank == 1:
            assert str(error) == "kernel failed on this rank", label
            if sys.version_info >= (3, 11):
                assert f"raised on rank 1 inside the {direction} of {_op(path)}" in notes, label
        else:
            assert "failed on rank 0 in the " in str(error) and _op(path) in str(error), label
            assert f"timeout ({TIMEOUT_S} s)" in str(error), label
        assert took < 3 * TIMEOUT_S + 5, f"{label}: took {took:.1f} s"
        del raised, error
        dist.destroy_process_group(group)


def test_a_kernel_that_fails_on_one_rank_fails_every_rank_within_the_timeout():
    run_ranks(_kernel_fails_on_one_rank, 2, timeout_s=60)


def test_a_rank_that_skips_the_hybrids_backward_fails_every_rank_at_once():
    run_ranks(_hybrid_skips_backward, 4, timeout_s=30)

"""Run a function on real gloo ranks (``torch.multiprocessing`` spawn) and report failures."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn, args, errors, done) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A bounded timeout: a collective that never completes fails the test instead of hanging CI.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # Exiting with a live gloo group intermittently aborts the process in torch 2.13
    # ("terminate called without an active exception"); so: all done, then tear down.
    dist.barrier()
    done.put(rank)  # the checks passed: what happens in teardown is torch's, not the test's
    dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; fail with rank tracebacks."""
    ctx = mp.get_context("spawn")
    errors, done = ctx.SimpleQueue(), ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        crash = None
        try:
            mp.start_processes(
                _worker, args=(world_size, init_file, fn, args, errors, done), nprocs=world_size, start_method="spawn"
            )
        except mp.ProcessRaisedException:
            pass
        except mp.ProcessExitedException as e:  # killed by a signal, e.g. an abort in gloo's teardown
            crash = e
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        finished = set()
        while not done.empty():
            finished.add(done.get())
    if failures:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures)))
    if crash is not None and finished != set(range(world_size)):
        raise AssertionError(f"ranks {sorted(set(range(world_size)) - finished)} did not finish: {crash}")


def assert_matches_summed_over_ranks(loss, want, model, reference, label: str, tolerance: float) -> None:
    """Each rank holds part of a summed loss: add the loss and every parameter gradient over
    the group and compare them with the single-process ``want`` and ``reference`` gradients."""
    from tests.reference import relative_error

    loss = loss.detach().clone()
    dist.all_reduce(loss)
    assert relative_error(loss, want) < tolerance, f"loss {label}: {loss} vs {want}"
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        assert relative_error(grad, p_ref.grad) < tolerance, f"grad of {name} {label}"

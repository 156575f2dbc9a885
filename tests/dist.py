"""Run a function on real gloo ranks (``torch.multiprocessing`` spawn) and report failures."""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._dynamo.utils import counters

import cpcompile
from cpcompile.testing import sample_lengths, summed_loss, synthetic_pack


def _worker(rank: int, world_size: int, init_file: str, timeout_s: float, fn, args, errors) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A bounded timeout: a collective that never completes fails the test instead of hanging CI.
    timeout = timedelta(seconds=timeout_s)
    init = f"file://{init_file}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; fail with rank tracebacks.

    Every process must also exit cleanly: a crash at teardown (an abort in a library's
    exit path, say) fails the test like an error in ``fn``. ``timeout_s`` bounds each collective.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        crash = raised = None
        try:
            mp.start_processes(
                _worker,
                args=(world_size, init_file, timeout_s, fn, args, errors),
                nprocs=world_size,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as e:  # its traceback is on `errors`, unless it raised before fn ran
            raised = e
        except mp.ProcessExitedException as e:  # killed by a signal or exited non-zero after fn returned
            crash = e
        failures = []
        while not errors.empty():
            failures.append(errors.get())
    if failures:
        crashed = "" if crash is None else f"\nand a rank crashed (at teardown or exit): {crash}"
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures)) + crashed)
    if crash is not None:
        raise AssertionError(f"a rank crashed after its checks passed (at teardown or exit): {crash}")
    if raised is not None:  # e.g. the process group's start failed: never a pass
        raise AssertionError(f"a rank raised outside its test function: {raised}")


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


PACK_SIZES = [48, 71, 30]  # tokens per step: the compiled graph must not specialize on them


def compiled_graphs() -> int:
    """Graphs Dynamo compiled and installed since the last ``counters.clear()``.

    Not the number of backend calls: with ``dynamic=True`` Dynamo may restart one
    compilation (e.g. to specialize a float module attribute such as nn.Embedding's
    ``norm_type``), which calls the backend twice for one graph.
    """
    return counters["stats"]["unique_graphs"]


def compare_training_step(reference, model, compiled, pack, max_seqlen, world, rank, label, tolerance=1e-4):
    """One step of ``compiled`` on this rank's share of ``pack`` against ``reference`` on all of it:
    the loss and every gradient summed over ranks."""
    cu = pack["cu_seqlens"]
    reference.zero_grad()
    want = summed_loss(reference(pack["input_ids"], pack["position_ids"], cu, max_seqlen), pack["labels"])
    want.backward()

    batch = cpcompile.shard_batch(
        {k: pack[k] for k in ("input_ids", "labels", "position_ids")}, cu, cp_size=world, rank=rank
    )
    t = batch.tensors
    model.zero_grad()
    with cpcompile.strategy(batch):  # the caller's strategy, and whose rows these are
        loss = summed_loss(compiled(t["input_ids"], t["position_ids"], cu, max_seqlen), t["labels"])
    loss.backward()
    assert_matches_summed_over_ranks(loss, want, model, reference, label, tolerance)


def check_training_over_packs(reference, model, compiled, vocab: int, world: int, rank: int, label: str) -> None:
    """``compiled`` (under the caller's ``cpcompile.strategy``) trains like ``reference`` on every pack of
    :data:`PACK_SIZES` tokens, with one compilation for them all (after ``counters.clear()``)."""
    for step, num_tokens in enumerate(PACK_SIZES):
        g = torch.Generator().manual_seed(step)
        lengths = sample_lengths(num_tokens, g, lengths=[1, 3, 9, 17, 30])
        pack = synthetic_pack(lengths, vocab, g)
        compare_training_step(reference, model, compiled, pack, max(lengths), world, rank, f"{label} step {step}")
    assert compiled_graphs() == 1, f"{compiled_graphs()} compilations, {label}"

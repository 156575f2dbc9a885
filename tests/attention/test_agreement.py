"""Mistakes on real gloo ranks fail fast, on every rank, naming the argument and the rank.

A rank that rejects its arguments, or ranks that disagree on what to compute, must
not leave the others waiting in a collective (the process group's timeout is set to
20 s here, so a hang fails the test) nor return wrong values: every rank raises
before any communication of the op, through ``cpcompile.comm.groups.agree``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import cpcompile
from tests.dist import run_ranks
from tests.fixtures import rows_of

pytestmark = pytest.mark.distributed

CU = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32)
# Same token count, same linear checksum sum(cu[i] * (i + 1)) as CU: only a digest of the values tells them apart.
CU_COLLIDING = torch.tensor([0, 1, 6, 15, 16], dtype=torch.int32)


def _declared(strategy, cu: torch.Tensor, rank: int, world: int):
    """``strategy`` as this rank's rows of it (``ShardedBatch.sharded_for``), as attention under CP must be
    told; a strategy that cannot lay the pack out (a bad name, a meta ``cu``) as it is, for its own error."""
    try:
        return rows_of(cu, cp_size=world, rank=rank, strategy=strategy)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return strategy


def _expect(rank: int, bad_rank: int | None, own: str, others: str, **call) -> None:
    """Run ``cp_attention`` with ``call``; the bad rank raises ``own``, every other rank ``others``."""
    q = call.pop("q", torch.randn(8, 2, 4))
    kv = call.pop("kv", torch.randn(8, 2, 4))
    cu = call.pop("cu", CU)
    call["strategy"] = _declared(call.get("strategy"), cu, rank, 2)  # whose rows q holds (a plan does not say)
    message = own if rank == bad_rank else others
    with pytest.raises((ValueError, TypeError), match=message):
        cpcompile.cp_attention(q, kv, kv, cu, **call)


def _one_rank_is_wrong(rank: int, world: int) -> None:
    bad = rank == 1
    rejected = r"rank 1 rejected its arguments \(ValueError: .*{}"
    cases = [
        ("q heads", dict(q=torch.randn(8, 3 if bad else 2, 4)), r"q heads \(3\) must be a multiple"),
        ("dtype", dict(q=torch.randn(8, 2, 4, dtype=torch.float64 if bad else torch.float32)), "share dtype"),
        ("strategy", dict(strategy="stripes" if bad else "striped"), "strategy must be one of .*got 'stripes'"),
        (
            "tokens",
            dict(q=torch.randn(10 if bad else 8, 2, 4), kv=torch.randn(10 if bad else 8, 2, 4)),
            "but the 2 ranks hold 20 rows",
        ),
        ("device", dict(cu=CU.to("meta") if bad else CU), r"cu_seqlens must be on the device of q \(cpu\), got meta"),
    ]
    cases += [
        (
            "longest",
            dict(max_seqlen=3 if bad else 4),
            r"max_seqlen=3 is shorter than the longest document \(4 tokens\)",
        ),
        (
            "max_seqlen",
            dict(max_seqlen=4.5 if bad else 4),
            r"max_seqlen must be None or an int of at least 1.*got 4\.5",
        ),
        (
            "scale",
            dict(scale=float("nan") if bad else None),
            "scale must be None .* or a finite positive number, got nan",
        ),
        ("k/v heads", dict(kv=torch.randn(8, 0 if bad else 2, 4)), r"k must have at least one head .*got \(8, 0, 4\)"),
        ("sinks", dict(sinks=torch.zeros(3 if bad else 2)), r"sinks must have shape \[Hq\] = \[2\] .*got \(3,\)"),
    ]
    for _argument, call, own in cases:
        _expect(rank, 1, own, rejected.format(own), strategy=call.pop("strategy", "no_load_balance"), **call)


def _plans_of_another_call(rank: int, world: int) -> None:
    """A caller's plan made for another rank, another pack or another layout than the call's is
    refused on that rank, and the others are told, before any collective: run, it would attend over
    other documents or leave the ranks in mismatched collectives. A ring with a window runs from an
    ``AttentionPlan``: a ``RingPlan`` holds no windows."""
    bad = rank == 1
    rejected = r"rank 1 rejected its arguments \((Value|Type)Error: .*{}"
    kinds = {"ring": cpcompile.plan.ring.make_ring_plan, "all_gather": cpcompile.plan.make_plan}
    other_cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    for comm, make in kinds.items():
        plans = [make(CU, cp_size=world, rank=r, strategy="no_load_balance") for r in range(world)]
        cases = [
            ("rank", plans[0], "plan was made for rank 0 of cp_size 2, but this is rank 1 of a group of 2"),
            (
                "cu_seqlens",
                make(other_cu, cp_size=world, rank=rank, strategy="no_load_balance"),
                "plan was made from other cu_seqlens: the plan's pack holds 2 document\\(s\\), cu_seqlens 4",
            ),
            (
                "strategy",
                make(CU, cp_size=world, rank=rank, strategy="striped"),
                "plan was made for another layout or padding: this call's is 'no_load_balance' with the layout's "
                "padding, and its plan has other pieces",
            ),
        ]
        for _argument, plan, own in cases:
            spec = cpcompile.StrategySpec("no_load_balance", kv="ring" if comm == "ring" else "auto")
            call = dict(strategy=spec, plan=plan if bad else plans[rank])
            _expect(rank, 1, own, rejected.format(own), **call)
    ring = cpcompile.plan.ring.make_ring_plan(CU, cp_size=world, rank=rank, strategy="striped")
    own = r"plan must be a AttentionPlan for kv='ring' with window_size=\(2, 0\), got RingPlan"
    striped_ring = cpcompile.StrategySpec("striped", kv="ring")
    _expect(rank, rank, own, own, strategy=striped_ring, window_size=(2, 0), plan=ring)


def _ranks_disagree(rank: int, world: int) -> None:
    def disagree(argument, values):
        return f"disagree on {argument} \\(rank 0: {values[0]}; rank 1: {values[1]}\\); this is rank {rank}"

    cases = [
        ("strategy", dict(strategy=("dual_chunk_swap", "no_load_balance")), ("'dual_chunk_swap'", "'no_load_balance'")),
        ("strategy", dict(strategy=("balanced", "no_load_balance")), ("'balanced'", "'no_load_balance'")),
        (
            "stripe_size",
            dict(strategy=(cpcompile.StrategySpec("striped", 2), cpcompile.StrategySpec("striped", 4))),
            ("2", "4"),
        ),
        ("window", dict(causal=(True, False), strategy=("striped",) * 2), (r"\(-1, 0\)", r"\(-1, -1\)")),
        ("window", dict(window_size=((4, 0), (3, 0)), strategy=("striped",) * 2), (r"\(4, 0\)", r"\(3, 0\)")),
        (
            "kv",
            dict(strategy=tuple(cpcompile.StrategySpec("striped", kv=kv) for kv in ("ring", "auto"))),
            ("'ring'", "'auto'"),
        ),
        ("cu_seqlens", dict(cu=(CU, CU_COLLIDING), strategy=("no_load_balance",) * 2), ("'[0-9a-f]+'", "'[0-9a-f]+'")),
    ]
    gradients = r"\(True, True, True, True\)", r"\(True, False, False, False\)"
    cases.append(("gradients \\(grad mode; q, k, v requires_grad\\)", dict(grad=(True, False)), gradients))
    for argument, call, shown in cases:
        mine = {key: values[rank] for key, values in call.items()}
        if "grad" in mine:  # rank 1's output needs no gradient: its backward would leave rank 0 waiting
            q = torch.randn(8, 2, 4, requires_grad=mine.pop("grad"))
            with pytest.raises(ValueError, match=disagree(argument, shown)):
                cpcompile.cp_attention(q, q, q, CU, strategy=_declared("no_load_balance", CU, rank, world))
            continue
        with pytest.raises(ValueError, match=disagree(argument, shown)):
            q = torch.randn(8, 2, 4)
            cu = mine.pop("cu", CU)
            cpcompile.cp_attention(q, q, q, cu, **mine | {"strategy": _declared(mine.get("strategy"), cu, rank, world)})


def _compiled_ranks_disagree(rank: int, world: int) -> None:
    """A compiled graph calls the CP ops directly: its plan op compares the pack and the layout
    (the ring's and the head-parallel ops see only the plan: nothing else would tell other packs
    apart), the attention ops what they run on; a pack one rank's plan op rejects is an error on
    every rank, not a wait in the attention's collectives."""

    def model(q, k, v, cu):
        return cpcompile.packed_attention(q, k, v, cu)

    def expect(message: str, spec: dict, cu: torch.Tensor, errors=ValueError) -> pytest.ExceptionInfo:
        torch._dynamo.reset()  # a graph per case: no recompilation limit across the cases
        compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with cpcompile.strategy(**spec), pytest.raises(errors, match=message) as error:
            with contextlib.suppress(ValueError):  # the block's batch: these are this rank's rows
                cpcompile.shard_batch({"x": torch.zeros(int(cu[-1]))}, cu, cp_size=world, rank=rank)
            compiled(q, q, q, cu)
        return error

    def disagree(argument: str, values: tuple[str, str]) -> str:
        return rf"disagree on {argument} \(the plan's\) \(rank 0: {values[0]}; rank 1: {values[1]}\)"

    q = torch.randn(8, 2, 4)
    # The same padding for both layouts (documents of 8): only the layout tells them apart.
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    for kv in ("auto", "ring"):
        layouts = ("'no_load_balance'", "'dual_chunk_swap'")
        spec = dict(value=layouts[rank].strip("'"), kv=kv)
        expect(disagree("strategy", layouts), spec, cu)
        # striped's gather_index depends on the token count alone: only the pack tells the packs apart
        expect(disagree("cu_seqlens", ("'[0-9a-f]+'",) * 2), dict(value="striped", kv=kv), cu if rank else CU)
        stripes = cpcompile.StrategySpec("striped", 2 if rank else 1, kv=kv)
        expect(disagree("stripe_size", ("1", "2")), dict(value=stripes), cu)
    heads = dict(value="no_load_balance", kv="heads", head_parallel=2)
    expect(disagree("cu_seqlens", ("'[0-9a-f]+'",) * 2), heads, cu if rank else CU)
    falling = torch.tensor([0, 8, 4, 12, 16], dtype=torch.int32)
    own = r"cu_seqlens must be non-decreasing \(cumulative lengths\), got \[0, 8, 4, 12, 16\]"
    message = own if rank else r"rank 1 rejected its arguments \(ValueError: " + own
    expect(message, dict(value="no_load_balance"), falling if rank else CU)
    ops = r"disagree on the calls it feeds .*\(rank 0: \('cp_attention: .*rank 1: \('cp_ring_attention: "
    expect(ops, dict(value="striped", kv="ring" if rank else "auto"), cu)
    # rank 1's call runs no backward (grad mode off, or inputs that need no gradient): rank 0 would
    # wait in its backward's collectives
    calls = r"\(rank 0: \('cp_attention: causal, backward, .*rank 1: \('cp_attention: causal, no backward, "
    backward = r"disagree on the calls it feeds \(op, mask, backward, shapes, scale, kernel\) " + calls
    q = torch.randn(8, 2, 4, requires_grad=not rank)
    expect(backward, dict(value="no_load_balance"), cu)
    with torch.no_grad() if rank else contextlib.nullcontext():
        expect(backward, dict(value="no_load_balance"), cu)
    # q requires grad on both, and rank 1 calls under no_grad: its graph fails to compile (the pass
    # refuses the call) while rank 0 runs its own, whose plan op meets rank 1's failure in its agreement
    q = torch.randn(8, 2, 4, requires_grad=True)
    refused = "UnsupportedAttentionError: .*runs with grad mode off on q/k/v that require grad"
    failed = (ValueError, torch._dynamo.exc.BackendCompilerFailed)  # Dynamo wraps the failing rank's own error
    others = rf"rank 1 rejected its arguments \({refused}"
    with torch.no_grad() if rank else contextlib.nullcontext():
        expect(refused if rank else others, dict(value="no_load_balance"), cu, failed)
    with torch.no_grad():  # on every rank: each raises its own error
        error = expect(refused, dict(value="no_load_balance"), cu, failed)
    assert "rejected its arguments" not in str(error.value)
    # q, k, v given to the graph with other head counts per rank: with dynamic shapes the heads are
    # symbols, not constants of the calls; their values are compared all the same (else the
    # all-gathers and head all-to-alls pair different sizes: gloo aborts, the exchange runs wrong)
    q = torch.randn(8, 4 if rank else 2, 4)
    heads = r"disagree on the calls' symbolic heads and head dims \(rank 0: \(2, 2, 4, 4\); rank 1: \(4, 4, 4, 4\)\)"
    for kv in ("all_gather", "exchange", "ring"):
        expect(heads, dict(value="no_load_balance", kv=kv), cu)
    expect(heads, dict(value="no_load_balance", kv="heads", head_parallel=2), cu)


def _unshard_of_other_batches(rank: int, world: int) -> None:
    """``unshard`` on ranks holding other batches or rows of other shapes: an error on every rank
    naming what differs, not a gather of mismatched sizes (gloo aborts the process)."""
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    mine = CU if rank else cu
    sharded = cpcompile.shard_batch({"x": torch.arange(16.0)}, mine, cp_size=world, rank=rank, strategy="striped")
    with pytest.raises(ValueError, match=r"disagree on cu_seqlens_padded \(rank 0: '[0-9a-f]+'; rank 1: '[0-9a-f]+'\)"):
        cpcompile.unshard(sharded.tensors["x"], sharded)
    sharded = cpcompile.shard_batch({"x": torch.arange(16.0)}, cu, cp_size=world, rank=rank, strategy="striped")
    local = sharded.tensors["x"].unsqueeze(1).expand(-1, 2 if rank else 1)
    with pytest.raises(ValueError, match=r"disagree on local rows \(shape, dtype\) \(rank 0: \(\(8, 1\), "):
        cpcompile.unshard(local, sharded)
    torch.testing.assert_close(cpcompile.unshard(sharded.tensors["x"], sharded), torch.arange(16.0))


def _batches_of_another_rank_or_layout(rank: int, world: int) -> None:
    """A batch sharded for another rank or layout than attention runs, with the token count attention
    expects: refused on every rank by ``cp_attention`` and by a compiled graph's plan op, naming what
    differs; run, it would attend over the wrong rows without an error."""
    tokens = {"x": torch.arange(16.0)}

    def call(batch, spec, compiled=None) -> None:
        q = torch.randn(batch.tensors["x"].shape[0], 2, 4)
        with cpcompile.strategy(batch):  # the rows are the batch's; attention runs ``spec``
            if compiled is None:
                cpcompile.cp_attention(q, q, q, batch.cu_seqlens, strategy=spec)
                return
            with cpcompile.strategy(spec):
                compiled(q, q, q, batch.cu_seqlens)

    def model(q, k, v, cu):
        return cpcompile.packed_attention(q, k, v, cu)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
    rejected = r"rank 1 rejected its arguments \(ValueError: the rows are of a batch that shard_batch laid out for "
    for way in (None, compiled):
        # rank 1 holds rank 0's rows: rank 1 is told why, rank 0 that rank 1 refused
        batch = cpcompile.shard_batch(tokens, CU, cp_size=world, rank=0, strategy="dual_chunk_swap")
        own = "laid out for rank 0, but this is rank 1 of the CP group"
        with pytest.raises(ValueError, match=own if rank else rejected + "rank 0"):
            call(batch, "dual_chunk_swap", way)
        # the loader's layout is not the model's: every rank raises its own error
        batch = cpcompile.shard_batch(tokens, CU, cp_size=world, rank=rank, strategy="striped")
        with pytest.raises(ValueError, match="the layout 'striped' .*, but attention runs 'dual_chunk_swap'"):
            call(batch, "dual_chunk_swap", way)
        # sharded for one rank: its rows, doubled, are the token count of a group of two
        batch = cpcompile.shard_batch({"x": torch.arange(8.0)}, CU[:3], cp_size=1, rank=0, strategy="no_load_balance")
        with pytest.raises(ValueError, match="laid out for cp_size=1, but the CP group has 2 ranks"):
            call(batch, "no_load_balance", way)


def _configs_differ(rank: int, world: int) -> None:
    """Ranks configured for different K/V paths: every rank is told, before either path, through
    ``cp_attention`` and through a compiled graph's op. Nothing else catches it: each rank plans
    the exchange alone, and the ranks would wait in different collectives."""
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    for mine, other in (("all_gather", "exchange"), ("auto", "exchange")):
        kv = other if rank else mine
        spec = cpcompile.StrategySpec("no_load_balance", kv=kv)
        with pytest.raises(ValueError, match=rf"disagree on kv \(rank 0: '{mine}'; rank 1: '{other}'\)"):
            cpcompile.cp_attention(q, q, q, cu, strategy=_declared(spec, cu, rank, world))

        def model(q, k, v, cu):
            return cpcompile.packed_attention(q, k, v, cu)

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with cpcompile.strategy("no_load_balance", kv=kv):
            cpcompile.shard_batch({"x": torch.zeros(16)}, cu, cp_size=world, rank=rank)  # the block's batch
            # the plan op compares what each call it feeds does: its kernel and K/V transport among it
            calls = rf"disagree on the calls it feeds .*kv {mine}, .*kv {other}, "
            with pytest.raises(ValueError, match=calls):
                compiled(q, q, q, cu)


def _errors_release_the_group(rank: int, world: int) -> None:
    """The error a rank raises holds no reference cycle with the frames it passed, so the
    group dies when destroyed, not at exit (where gloo aborts the process)."""
    import gc
    import weakref

    group = dist.new_group(list(range(world)))
    alive = weakref.ref(group)
    q = torch.randn(8, 3 if rank else 2, 4)  # rank 1 rejects its q
    gc.disable()  # only plain reference counting may free it
    try:
        with pytest.raises(ValueError, match="rejected its arguments|must be a multiple"):
            rows = _declared("no_load_balance", CU, rank, world)
            cpcompile.cp_attention(q, torch.randn(8, 2, 4), torch.randn(8, 2, 4), CU, group=group, strategy=rows)
        dist.destroy_process_group(group)
        del group
        assert alive() is None, "the process group outlived destroy_process_group"
    finally:
        gc.enable()


CHECKS = (
    _one_rank_is_wrong,
    _plans_of_another_call,
    _ranks_disagree,
    _compiled_ranks_disagree,
    _unshard_of_other_batches,
    _batches_of_another_rank_or_layout,
    _configs_differ,
    _errors_release_the_group,
)


def _every_check(rank: int, world: int) -> None:
    for check in CHECKS:
        check(rank, world)


def test_every_rank_fails_fast():
    """Every check above, in turn on one pair of ranks: starting the processes costs more than the checks."""
    run_ranks(_every_check, 2, timeout_s=20)

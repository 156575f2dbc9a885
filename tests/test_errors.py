"""Crashes and unclear errors of issue 57 (items 11-14): CPU autocast around eager attention, offsets on
the meta device, ``StrategySpec(None)``, and offsets made from one rank's rows under CP.

Autocast is not part of what ranks agree on: the kernels compute in their own precision whatever
autocast says, so ranks under different autocast states still compute the same attention.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.plan.pieces import make_head_plan
from cpcompile.plan.ring import make_ring_plan
from cpcompile.spec import resolve_strategy
from tests.dist import run_ranks
from tests.fixtures import attention_case
from tests.reference import attention_fp64, attention_fp64_on_rank, relative_error

LENGTHS = [5, 17, 1, 9]
FP32 = 1e-5  # float32 inputs: the kernel's own float32, autocast or not
HALF = 2e-2  # bfloat16 / float16 inputs: their rounding of q, k, v and of the output


def _forward_backward(f, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = f(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_under_cpu_autocast(autocast, dtype, causal):
    """Was ``value cannot be converted to type c10::BFloat16 without overflow``: autocast made the reference
    kernel's scores bfloat16, then clamped them at float32's minimum. Output in the inputs' dtype, as
    the op's fake says, and as exact as without autocast."""
    cu, _, q, k, v, dout = attention_case(LENGTHS, seed=1)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    want = _forward_backward(lambda *t: attention_fp64(*t, cu, causal=causal), q, k, v, dout)
    with torch.autocast("cpu", dtype=autocast):
        got = _forward_backward(lambda *t: cpcompile.packed_attention(*t, cu, causal=causal), q, k, v, dout)
    plain = _forward_backward(lambda *t: cpcompile.packed_attention(*t, cu, causal=causal), q, k, v, dout)
    tolerance = FP32 if dtype == torch.float32 else HALF
    for name, g, p, w in zip(["out", "dq", "dk", "dv"], got, plain, want):
        assert g.dtype == dtype, f"{name} {g.dtype}"
        assert torch.equal(g, p), f"{name}: autocast changed the result"
        assert relative_error(g, w) < tolerance, f"{name} {relative_error(g, w)}"


def _cp_attention_under_autocast(rank: int, world: int) -> None:
    cu, _, q, k, v, dout = attention_case([3, 2 * world + 7, 1, 6], seed=2)
    for dtype, kv in ((torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "ring")):
        spec = cpcompile.StrategySpec(cpcompile.Strategy.DUAL_CHUNK_SWAP, kv=kv)
        tensors = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "dout": dout.to(dtype)}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        want = attention_fp64_on_rank(cu, sharded, tensors, causal=True)
        local = [sharded.tensors[name] for name in ("q", "k", "v", "dout")]

        def attend(q, k, v, cu=sharded.cu_seqlens, batch=sharded):
            return cpcompile.cp_attention(q, k, v, cu, strategy=batch)

        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _forward_backward(attend, *local)
        tolerance = FP32 if dtype == torch.float32 else HALF
        for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
            label = f"rank {rank} {name} {dtype} {kv}"
            assert g.dtype == dtype, label
            assert relative_error(g, w) < tolerance, f"{label}: {relative_error(g, w)}"


@pytest.mark.distributed
def test_cp_attention_under_cpu_autocast():
    run_ranks(_cp_attention_under_autocast, 2)


@pytest.mark.parametrize("padded", [False, True])
def test_cp_attention_names_offsets_on_meta(single_rank_group, padded):
    """Was ``NotImplementedError: Cannot copy out of meta tensor; no data!`` from inside the plan."""
    cu, _, q, k, v, _ = attention_case(LENGTHS)
    given = cpcompile.layouts.pad_for_cp(cu, cp_size=1).to("meta") if padded else None
    q, k, v, cu = (t.to("meta") for t in (q, k, v, cu))
    named = "cu_seqlens and cu_seqlens_padded are" if padded else "cu_seqlens is"
    with pytest.raises(ValueError, match=f"^{named} on the meta device, which holds no values: cp_attention"):
        cpcompile.cp_attention(q, k, v, cu, cu_seqlens_padded=given, strategy="no_load_balance")


@pytest.mark.parametrize(
    "call, message",
    [
        # StrategySpec takes no None (only functions taking a StrategyLike read None as the active strategy)
        (lambda: cpcompile.StrategySpec(None), r"^strategy must be a Strategy or a str, got NoneType \(the strings: "),
        (lambda: cpcompile.StrategySpec(3), r"^strategy must be a Strategy or a str, got int"),
        (
            lambda: cpcompile.strategy(None).__enter__(),
            r"^strategy must be a Strategy, a str, a StrategySpec or a ShardedBatch, got NoneType",
        ),
        (
            lambda: resolve_strategy(3),
            r"^strategy must be a Strategy, a str or None, got int "
            r"\(or a StrategySpec or a ShardedBatch; None: the active strategy",
        ),
    ],
)
def test_strategy_type_errors_say_what_the_parameter_takes(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def _local_offsets(world: int, rank: int, strategy: str):
    """A rank's rows of a pack of :data:`LENGTHS` and the offsets a model would build from their
    position_ids (a document starts where the position is 0): ``(rows, local cu_seqlens)``."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    batch = cpcompile.shard_batch({"position_ids": positions}, cu, cp_size=world, rank=rank, strategy=strategy)
    local = batch.tensors["position_ids"]
    starts = torch.nonzero(local == 0).flatten().tolist()
    return local.shape[0], torch.tensor([*starts, local.shape[0]], dtype=torch.int32)


@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance", "striped"])
def test_local_offsets_are_named_as_cu_seqlens(strategy):
    """Offsets built from one rank's position_ids cover that rank's rows, not the pack: the plans name
    ``cu_seqlens`` (not ``cu_seqlens_padded``, which the caller never passed) and say it must be the
    whole pack's; ``cu_seqlens_padded`` only where it was passed."""
    world, rank = 2, 0
    rows, cu_local = _local_offsets(world, rank, strategy)
    assert int(cu_local[0]) == 0  # rank 0's rows start a document under these layouts
    whole = r"must describe the whole \(global\) pack, which this rank's tokens are a share of"
    held = rf"the {world} ranks hold {rows * world} rows \({rows} local tokens in q x cp_size {world}\)"
    for make in (
        lambda: cpcompile.plan.make_plan(
            cu_local, cp_size=world, rank=rank, strategy=strategy, num_tokens=rows * world
        ),
        lambda: make_ring_plan(cu_local, cp_size=world, rank=rank, strategy=strategy, num_tokens=rows * world),
        lambda: make_head_plan(cu_local, cp_size=world, strategy=strategy, num_tokens=rows * world),
    ):
        with pytest.raises(ValueError, match=rf"^cu_seqlens describes {rows} tokens.*{held}: cu_seqlens {whole}") as e:
            make()
        assert "cu_seqlens_padded" not in str(e.value)
    padded = cpcompile.layouts.pad_for_cp(cu_local, cp_size=world, strategy=strategy)
    with pytest.raises(ValueError, match=rf"^cu_seqlens_padded\[-1\] = {int(padded[-1])}, but {held}: .* {whole}"):
        cpcompile.plan.make_plan(cu_local, padded, cp_size=world, rank=rank, strategy=strategy, num_tokens=rows * world)


def test_offsets_not_starting_at_zero_say_whose_offsets():
    """The other rank's rows of dual_chunk_swap start inside a document: its offsets start past 0."""
    rows, cu_local = _local_offsets(2, 1, "dual_chunk_swap")
    assert int(cu_local[0]) > 0
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, got \d+ \(under CP: the whole pack's offsets"):
        cpcompile.plan.make_plan(cu_local, cp_size=2, rank=1, strategy="dual_chunk_swap", num_tokens=rows * 2)

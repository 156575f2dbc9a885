"""Ring cp_attention on real gloo processes, against float64 and against all-gather.

One spawn per world size (2, 3, 4) runs every strategy, causal and not, GQA and MHA,
on packs with 1-token documents, documents shorter than cp and one spanning every
rank; forward and every gradient are checked against the float64 single-device
reference and against the all-gather path on the same inputs. At cp=3 the spawn also
compiles a model under ``cpcompile.strategy(..., kv="ring")`` of two layouts, and checks it
runs the ring op and equals eager ring.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from tests.attention.test_sinks import check_sinks_on_rank
from tests.dist import run_ranks
from tests.fixtures import SOFTCAPS, VALUE_DIMS, attention_case, doc_lengths, strategy_specs
from tests.reference import attention_fp64_on_rank, relative_error

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4  # against float64
SAME = 1e-5  # ring against all-gather: both float32, only the summation order differs
SPECS = strategy_specs(stripe_size=4)


def _run(sharded, cu, spec, causal, kv, softcap=None):
    local = [sharded.tensors[name].clone().requires_grad_() for name in "qkv"]
    with cpcompile.strategy(sharded, kv=kv):  # the batch's layout and rows, K/V moved as kv says
        kw = {"cu_seqlens_padded": sharded.cu_seqlens_padded, "causal": causal, "softcap": softcap}
        out = cpcompile.cp_attention(*local, cu, **kw)
    return [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]


def _check_rank(rank: int, world: int) -> None:
    cases = [(s, c, h) for s in SPECS for c in (True, False) for h in ((4, 2), (2, 2)) if h == (4, 2) or c]
    for case, (spec, causal, (hq, hkv)) in enumerate(cases):
        dv = VALUE_DIMS[case % len(VALUE_DIMS)]  # each layout with every value head dim
        softcap = SOFTCAPS[case % 2]  # and with soft-capping and without
        cu, _, q, k, v, dout = attention_case(doc_lengths(world, case), hq, hkv, 8, dv=dv, seed=case)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        ring = _run(sharded, cu, spec, causal, "ring", softcap)
        gathered = _run(sharded, cu, spec, causal, "auto", softcap)
        want = attention_fp64_on_rank(cu, sharded, tensors, causal=causal, softcap=softcap)
        label = f"rank {rank}/{world} {spec} causal={causal} heads={hq}/{hkv} dv={dv} softcap={softcap}"
        for name, got, same, ref in zip(("out", "dq", "dk", "dv"), ring, gathered, want):
            assert relative_error(got, ref) < TOLERANCE, f"{name} against float64, {label}"
            assert relative_error(got, same) < SAME, f"{name} against all-gather, {label}"
    check_sinks_on_rank(rank, world)  # every path with sinks, on this spawn
    if world == 3:  # compiling is the slow part: once, at an odd cp
        _check_compiled(rank, world)


def _model(q, k, v, cu_seqlens, max_seqlen):
    return cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen)


def _check_compiled(rank: int, world: int) -> None:
    """The single-device model, compiled, runs ring attention from the strategy block."""
    from torch._dynamo.backends.registry import lookup_backend

    ops = []

    def inner(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    cu, _, q, k, v, dout = attention_case(doc_lengths(world, 0), 4, 2, 8, seed=0)
    for active in (
        cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, kv="ring"),  # MaxText's pick for packing
        cpcompile.StrategySpec(cpcompile.Strategy.DUAL_CHUNK_SWAP, kv="ring"),
    ):
        torch._dynamo.reset()
        ops.clear()
        compiled = torch.compile(_model, backend=cpcompile.backend(inner=inner), dynamic=True)
        with cpcompile.strategy(active):
            sharded = cpcompile.shard_batch({"q": q, "k": k, "v": v, "dout": dout}, cu, cp_size=world, rank=rank)
            local = [sharded.tensors[name].clone().requires_grad_() for name in "qkv"]
            out = compiled(*local, cu, int((cu[1:] - cu[:-1]).max()))
            got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
        assert "cpcompile.cp_ring_attention.default" in ops and "cpcompile.cp_attention.default" not in ops, ops
        want = _run(sharded, cu, active, True, "ring")
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert relative_error(a, b) < SAME, f"compiled {name}, rank {rank}/{world} {active}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_matches_fp64_and_all_gather(world):
    run_ranks(_check_rank, world)

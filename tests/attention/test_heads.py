"""Head-parallel (Ulysses) cp_attention on real gloo ranks against float64, and its errors.

``head_parallel == cp`` (pure) and ``1 < head_parallel < cp`` (hybrid: cp=4, u=2): every
layout x causal/full x heads (MHA, GQA with ``u | Hkv``, and K/V heads replicated where
``Hkv < u``) x float32/float64, on random packs drawn alike on every rank (1-token
documents, a single document, zero-length documents, many short ones, mixed lengths;
``tests/attention/test_cp_attention_properties.py``'s generator).
"""

from __future__ import annotations

import random

import pytest
import torch

import cpcompile
from tests.dist import run_ranks
from tests.fixtures import KINDS, SOFTCAPS, TOLERANCE, VALUE_DIMS, attention_case, random_pack, rows_of, strategy_specs
from tests.reference import assert_attention_matches, attention_fp64_on_rank

pytestmark = pytest.mark.distributed

#: query and K/V heads per u: MHA, GQA with u | Hkv, and Hkv < u (K/V heads replicated)
HEADS = {2: [(2, 2), (4, 2), (4, 1)], 3: [(3, 3), (6, 2)], 4: [(4, 4), (8, 4), (8, 2), (4, 1)]}


def cases(cp: int, seed: int, u: int):
    rng = random.Random(seed)
    grid = [
        (spec, causal, heads, dtype)
        for spec in strategy_specs(stripe_size=3)
        for causal in (True, False)
        for heads in HEADS[u]
        for dtype in (torch.float32, torch.float64)
    ]
    if cp > 2:
        grid = rng.sample(grid, len(grid) // 2)
    for i, case in enumerate(grid):
        yield (*case, random_pack(rng, cp, KINDS[i % len(KINDS)]), rng.randrange(1 << 30))


#: the head-parallel sizes u checked at each CP size, on one spawn (starting the processes costs more than a u)
US = {2: [2], 3: [3], 4: [4, 2]}


def _check_rank(rank: int, world: int) -> None:
    from tests.attention.test_cp_attention import check_compiled_variant

    for u in US[world]:
        _check_u(rank, world, 2000 + world + u, u)
        # compiled: values of their own head dim and soft-capping, through the head all-to-alls (and the hybrid's)
        spec = cpcompile.StrategySpec("balanced", kv="heads", head_parallel=u)
        check_compiled_variant(rank, world, spec, heads=(2 * u, 2))


def _check_u(rank: int, world: int, seed: int, u: int) -> None:
    for spec, causal, (hq, hkv), dtype, lengths, case_seed in cases(world, seed, u):
        spec = cpcompile.StrategySpec(spec.strategy, spec.stripe_size, kv="heads", head_parallel=u)
        dv, softcap = VALUE_DIMS[case_seed % len(VALUE_DIMS)], SOFTCAPS[case_seed // 7 % 2]
        cu, _, q, k, v, dout = attention_case(lengths, hq, hkv, 8, dv=dv, seed=case_seed, dtype=dtype)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        assert sharded.spec.head_parallel == u  # auto keeps it when it picks a layout
        local = [sharded.tensors[n].clone().requires_grad_() for n in "qkv"]
        # causal attention also as its window, (-1, 0) with causal=False (every path must read the window)
        mask = {"causal": False, "window_size": (-1, 0)} if causal and case_seed % 2 else {"causal": causal}
        kw = {"cu_seqlens_padded": sharded.cu_seqlens_padded, "strategy": sharded, "softcap": softcap}
        out = cpcompile.cp_attention(*local, cu, **kw, **mask)
        got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
        label = f"rank {rank}/{world} {spec} {mask} heads={hq}/{hkv} dv={dv} softcap={softcap} {dtype} docs {lengths}"
        want = attention_fp64_on_rank(cu, sharded, tensors, causal=causal, softcap=softcap)
        assert_attention_matches(got, want, TOLERANCE[dtype], label, dtype)


@pytest.mark.parametrize("world", sorted(US))
def test_head_parallel_matches_float64(world):
    run_ranks(_check_rank, world)


def _errors(rank: int, world: int) -> None:
    """Rank 1 alone passes a bad head-parallel argument: it raises its error, rank 0 names rank 1's,
    both before any communication of the op."""
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    q = torch.randn(4, 2, 4)
    good = cpcompile.StrategySpec("no_load_balance", kv="heads", head_parallel=2)
    plan = cpcompile.plan.make_plan(cu, cp_size=2, rank=rank, strategy="no_load_balance")
    odd_heads = torch.randn(4, 3, 4), torch.randn(4, 1, 4), torch.randn(4, 1, 4)
    cases = [
        (
            dict(strategy=cpcompile.StrategySpec(kv="heads", head_parallel=3)),
            "head_parallel=3 must divide the CP size 2",
        ),
        (dict(qkv=odd_heads), "head_parallel=2 must divide the number of query heads 3"),
        (dict(plan=plan), "plan is not accepted with head_parallel > 1"),
    ]
    for call, message in cases:
        call = call if rank == 1 else {}
        qkv = call.pop("qkv", (q, q, q))
        expected = message if rank == 1 else rf"rank 1 rejected its arguments \(ValueError: .*{message}"
        with pytest.raises(ValueError, match=expected):
            cpcompile.cp_attention(*qkv, cu, **{"strategy": rows_of(cu, cp_size=2, rank=rank, strategy=good), **call})
    # ranks that disagree on head_parallel
    mine = cpcompile.StrategySpec("no_load_balance", kv="heads" if rank else "auto", head_parallel=2 if rank else 1)
    with pytest.raises(ValueError, match=r"disagree on kv \(rank 0: 'auto'; rank 1: 'heads'\)"):
        cpcompile.cp_attention(q, q, q, cu, strategy=rows_of(cu, cp_size=2, rank=rank, strategy=mine))


def _compiled_ranks_disagree(rank: int, world: int) -> None:
    """A compiled graph calls the ops directly: ranks compiled with and without head parallelism
    run different collectives, and the plan ops' agreement (the first CP op of the graph) says so on every rank."""

    def model(q, k, v, cu):
        return cpcompile.packed_attention(q, k, v, cu)

    compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with cpcompile.strategy("no_load_balance", kv="heads" if rank else "auto", head_parallel=2 if rank else 1):
        cpcompile.shard_batch({"x": torch.zeros(16)}, cu, cp_size=2, rank=rank)  # the block's batch: these rows
        with pytest.raises(ValueError, match=r"disagree on plan op \(rank 0: 'cp_plan'; rank 1: 'cp_head_plan'\)"):
            compiled(q, q, q, cu)


def _fail_fast(rank: int, world: int) -> None:
    _errors(rank, world)
    _compiled_ranks_disagree(rank, world)


def test_mistakes_fail_fast_on_every_rank():
    """Both checks above on one pair of ranks: starting the processes costs more than the checks."""
    run_ranks(_fail_fast, 2, timeout_s=20)

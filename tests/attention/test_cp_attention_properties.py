"""Random packs on real gloo ranks, forward and every gradient against float64.

Every strategy x comm (all-gather, with the exchange forced on, off or chosen, and
ring) x causal/full x GQA/MHA x float32/float64, at cp 2, 3 and 4, on packs drawn
for the shapes users' data has: 1-token documents, a single document, packs whose
padded size equals cp (one token per rank), zero-length documents, many short
documents, and mixed lengths. The reference is plain float64 softmax attention one
document at a time (``tests.reference.attention_fp64_on_rank``) on the padded physical
buffer. Cases come from a seeded generator, so every rank draws the same pack: the
cases are the property test's examples, many per process group so CI stays fast.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import cpcompile
from tests.dist import run_ranks
from tests.fixtures import KINDS, TOLERANCE, attention_case, random_pack, strategy_specs
from tests.reference import assert_attention_matches, attention_fp64_on_rank

SPECS = strategy_specs()
#: ``StrategySpec.kv``: the exchange chosen per plan, forced, or off (the all-gather), and the ring.
PATHS = ["auto", "exchange", "all_gather", "ring"]


def cases(cp: int, seed: int):
    """Every spec x path x mask x heads x dtype (at cp > 2 a seeded half of them), each with its pack."""
    rng = random.Random(seed)
    grid = [
        (spec, path, causal, heads, dtype)
        for spec in SPECS
        for path in PATHS
        for causal in (True, False)
        for heads in ((4, 2), (2, 2))
        for dtype in (torch.float32, torch.float64)
    ]
    if cp > 2:
        grid = rng.sample(grid, len(grid) // 2)
    for i, case in enumerate(grid):
        yield (*case, random_pack(rng, cp, KINDS[i % len(KINDS)]), rng.randrange(1 << 30))


def _check_rank(rank: int, world: int, seed: int) -> None:
    for spec, kv, causal, (hq, hkv), dtype, lengths, case_seed in cases(world, seed):
        spec = dataclasses.replace(spec, kv=kv)
        cu, _, q, k, v, dout = attention_case(lengths, hq, hkv, 8, seed=case_seed, dtype=dtype)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        local = [sharded.tensors[n].clone().requires_grad_() for n in "qkv"]
        out = cpcompile.cp_attention(
            *local,
            cu,
            cu_seqlens_padded=sharded.cu_seqlens_padded,
            strategy=sharded,
            causal=causal,
        )
        got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
        label = f"rank {rank}/{world} {spec} causal={causal} heads={hq}/{hkv} {dtype} docs {lengths}"
        want = attention_fp64_on_rank(cu, sharded, tensors, causal=causal)
        assert_attention_matches(got, want, TOLERANCE[dtype], label, dtype)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_packs_match_float64(world):
    run_ranks(_check_rank, world, 1000 + world)


def test_pack_kinds_cover_the_edge_cases():
    """The generator does produce what the docstring promises, at every cp tested."""
    for cp in (2, 3, 4):
        packs = [lengths for *_, lengths, _ in cases(cp, 1000 + cp)]
        assert any(all(n == 1 for n in p) and len(p) > 1 for p in packs)
        assert any(len(p) == 1 for p in packs)
        assert any(0 in p for p in packs)
        assert any(sum(p) <= cp for p in packs)  # padded to cp tokens: one per rank
        assert any(len(p) >= 10 for p in packs)

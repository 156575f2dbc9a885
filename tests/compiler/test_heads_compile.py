"""Compiled head-parallel training equals the single-device eager model on real gloo ranks.

Under ``cpcompile.strategy(..., kv="heads", head_parallel=u)`` the backend rewrites the model's packed
attention (``packed_attention`` and ``varlen_attn``) into ``cp_head_attention`` (``u == cp``)
or the hybrid's head all-to-alls around ``cp_attention`` (``1 < u < cp``); each rank
trains on packs of varying length and document count with one compilation, and the loss
and every parameter gradient, summed over ranks, match the eager model on the whole pack,
with K/V heads replicated where the model has fewer than the ranks. A compiled hybrid call
whose ``lse`` is read gives it as single-device attention does, at the rank's rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import cpcompile
from cpcompile.batch import physical_positions
from cpcompile.testing import GPTConfig, PackedGPT
from tests.dist import check_training_over_packs, run_ranks
from tests.fixtures import attention_case

pytestmark = pytest.mark.distributed


def _check_training(rank: int, world: int, u: int, kv_heads: int, inner: str, strategies: list[str]) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, dim=32, heads=4, kv_heads=kv_heads, layers=2, max_position=128, attention="mixed")
    reference = PackedGPT(dataclasses.replace(cfg, attention="packed"))
    model = PackedGPT(cfg)
    model.load_state_dict(reference.state_dict())
    for name in strategies:
        spec = cpcompile.StrategySpec(name, kv="heads", head_parallel=u)
        torch._dynamo.reset()
        counters.clear()
        backend = cpcompile.backend(inner=inner)
        compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
        with cpcompile.strategy(spec):
            label = f"rank {rank}/{world} {spec} kv_heads={kv_heads} inner={inner}"
            check_training_over_packs(reference, model, compiled, cfg.vocab, world, rank, label)


def _hybrid_lse(rank: int, world: int) -> None:
    """A compiled call that reads ``lse`` under the hybrid gets the single-device lse at its rows."""

    def attend(q, k, v, cu):
        out, lse = torch.ops.cpcompile.packed_attention(q, k, v, cu, None, None, True, None)
        return out * 2, lse

    compiled = torch.compile(attend, backend=cpcompile.backend(inner="aot_eager"), dynamic=True, fullgraph=True)
    cu, _, q, k, v, _ = attention_case([37, 5, 1, 60, 9], 4, 2, 8, dtype=torch.float64)
    for name in ("dual_chunk_swap", "balanced"):
        spec = cpcompile.StrategySpec(name, kv="heads", head_parallel=2)
        batch = cpcompile.shard_batch({"q": q, "k": k, "v": v}, cu, cp_size=world, rank=rank, strategy=spec)
        with cpcompile.strategy(batch):
            out, lse = compiled(*(batch.tensors[n] for n in "qkv"), cu)
        padded = batch.cu_seqlens_padded
        phys = physical_positions(cu, padded)
        whole = [t.new_zeros((int(padded[-1]), *t.shape[1:])).index_copy_(0, phys, t) for t in (q, k, v)]
        want_out, want_lse = torch.ops.cpcompile.packed_attention(*whole, cu, padded, None, True, None)
        torch.testing.assert_close(out, 2 * want_out[batch.indices], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lse, want_lse[:, batch.indices], rtol=1e-10, atol=1e-12)


#: per world size, the ``(u, kv_heads, inner, strategies)`` trained in turn on one spawn: starting the
#: processes costs more than a case
RUNS = {
    2: [
        (2, 2, "aot_eager", ["dual_chunk_swap", "no_load_balance", "auto"]),
        (2, 1, "aot_eager", ["balanced"]),  # one K/V head for two ranks: replicated
        (2, 2, "inductor", ["no_load_balance"]),
    ],
    4: [(2, 1, "aot_eager", ["dual_chunk_swap", "auto"])],  # the hybrid, K/V replicated
}


def _every_run(rank: int, world: int) -> None:
    for run in RUNS[world]:
        _check_training(rank, world, *run)
    if world == 4:
        _hybrid_lse(rank, world)


@pytest.mark.parametrize("world", sorted(RUNS))
def test_compiled_head_parallel_training_matches_single_device(world):
    """At 4 ranks, also: a compiled hybrid call that reads ``lse`` gets it."""
    run_ranks(_every_run, world)

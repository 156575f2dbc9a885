"""Compiled CP training equals the single-device eager model on real gloo ranks.

The model is written for one device and mixes ``cpcompile.packed_attention`` and torch's
``varlen_attn`` (by layer). Each rank compiles it with ``cpcompile.backend`` under
every strategy (through ``aot_eager``; through inductor, one strategy per world size: the pass
is the same, inductor's compile is what costs), trains on packs of varying length and document
count, and checks loss and every parameter gradient (summed over CP ranks) against the eager
model on the whole pack; it also counts compilations (one per strategy). ``varlen_attn``
has no CPU kernel, so the eager reference runs the same weights with
``packed_attention``, which computes the same function.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import cpcompile
from cpcompile.testing import GPTConfig, PackedGPT
from tests.dist import check_training_over_packs, run_ranks

pytestmark = pytest.mark.distributed

SPECS = [
    cpcompile.StrategySpec(cpcompile.Strategy.DUAL_CHUNK_SWAP),
    cpcompile.StrategySpec(cpcompile.Strategy.NO_LOAD_BALANCE),
    cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, stripe_size=2),
    cpcompile.StrategySpec(cpcompile.Strategy.BALANCED),
    cpcompile.StrategySpec(cpcompile.Strategy.AUTO),
]


def _check_training(rank: int, world: int, runs: list[tuple[str, list]]) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, dim=32, heads=4, kv_heads=2, layers=2, max_position=128, attention="mixed")
    reference = PackedGPT(dataclasses.replace(cfg, attention="packed"))
    model = PackedGPT(cfg)
    model.load_state_dict(reference.state_dict())
    for inner, specs in runs:
        for spec in specs:
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(model, backend=cpcompile.backend(inner=inner), dynamic=True, fullgraph=True)
            with cpcompile.strategy(spec):
                label = f"rank {rank}/{world} {spec} inner={inner}"
                check_training_over_packs(reference, model, compiled, cfg.vocab, world, rank, label)


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_training_matches_single_device(world):
    inductor = [SPECS[3] if world == 2 else SPECS[0]]  # balanced at 2, dual_chunk_swap at 3
    run_ranks(_check_training, world, [("aot_eager", SPECS), ("inductor", inductor)])

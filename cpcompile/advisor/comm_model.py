"""The advisor's choice of layout and path, head parallelism included, at an assumed bandwidth: :func:`choose_spec`.

Given the heads, each candidate's step is the cost model's (:func:`cpcompile.cost.predict_rank_costs`,
compute in attention pairs) plus its bytes (:func:`cpcompile.cost.comm.layer_bytes`) at an assumed
bandwidth (:class:`Link`), turned into pairs. The runtime's ``auto``, given the heads and a topology
(``shard_batch(..., heads=..., topology=...)``), weighs head parallelism too, with the step-time model
over the topology instead (:func:`cpcompile.cost.timing.resolve`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from cpcompile.checks import check_cp, check_int
from cpcompile.cost.comm import Heads, LayerBytes, check_heads, head_parallel_options, layer_bytes
from cpcompile.cost.model import CostModel, RankCosts, auto_candidates, check_candidates, predict_rank_costs
from cpcompile.spec import Strategy, StrategyLike, StrategySpec


@dataclasses.dataclass(frozen=True)
class Link:
    """What turns bytes into the cost model's attention pairs (:func:`comm_pairs`): an assumed
    bandwidth each GPU receives at, and the attention throughput the cost model's pair stands
    for (docs/cost-model.md states the throughput assumed). An assumption, not a measurement:
    cp > 2 has not been measured here (docs/communication.md)."""

    bandwidth_gbps: int = 300  # GB/s, below the H200's NVLink peak of 450 per direction
    attention_tflops: int = 330

    def __post_init__(self) -> None:
        check_int("bandwidth_gbps", self.bandwidth_gbps, minimum=1)
        check_int("attention_tflops", self.attention_tflops, minimum=1)

    def milliseconds(self, nbytes: int) -> float:
        """The modelled time of ``nbytes`` received, not overlapped with anything."""
        return nbytes / (self.bandwidth_gbps * 1e6)


def comm_pairs(nbytes: torch.Tensor, heads: Heads, link: Link) -> torch.Tensor:
    """``nbytes`` (int64) as attention pairs, rounded down: the pairs whose forward and backward
    (``14 Hq D`` FLOP: ``4 Hq D`` forward, 2.5 times that backward) take as long at
    ``link.attention_tflops`` as the bytes take at ``link.bandwidth_gbps``."""
    return nbytes * (link.attention_tflops * 1000) // (link.bandwidth_gbps * 14 * heads.q * heads.dim)


def candidates_with_heads(cp_size: int, heads: Heads, model: CostModel | None = None) -> tuple[StrategySpec, ...]:
    """``auto``'s candidates, then for each of :func:`head_parallel_options`: the pure head
    parallelism (``u == cp``) on no_load_balance, which pads least (every layout gives it the
    same attention), else the hybrid on each of ``auto``'s layouts."""
    sequence = auto_candidates(model)
    specs = list(sequence)
    for u in head_parallel_options(cp_size, check_heads(heads).q):
        if u == cp_size:
            specs.append(StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=u))
        else:
            specs += [dataclasses.replace(c, kv="heads", head_parallel=u) for c in sequence]
    return tuple(specs)


class StepPrediction(NamedTuple):
    """One spec's prediction: the cost model's :class:`~cpcompile.cost.model.RankCosts`, the layer's
    :class:`LayerBytes`, and per rank ``[cp]`` int64 the cost with the bytes as pairs added."""

    costs: RankCosts
    bytes: LayerBytes
    cost: torch.Tensor

    @property
    def step(self) -> int:
        """The slowest rank's cost with communication."""
        return int(self.cost.max())


def predict_step(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike,
    heads: Heads,
    model: CostModel | None = None,
    link: Link | None = None,
) -> StepPrediction:
    """The cost model's per-rank cost plus the layer's communication (not overlapped), in pairs."""
    link = Link() if link is None else link
    heads = check_heads(heads)
    costs = predict_rank_costs(cu_seqlens, cp_size=cp_size, strategy=strategy, model=model)
    causal = (CostModel() if model is None else model).causal
    nbytes = layer_bytes(cu_seqlens, cp_size=cp_size, strategy=strategy, heads=heads, causal=causal)
    return StepPrediction(costs, nbytes, costs.cost + comm_pairs(nbytes.total, heads, link))


def choose_spec(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    heads: Heads,
    model: CostModel | None = None,
    link: Link | None = None,
    candidates: tuple[StrategySpec, ...] | None = None,
) -> StrategySpec:
    """The candidate with the lowest :func:`predict_step`, head parallelism included (as ``auto`` given
    the heads and a topology weighs it, by the step-time model instead). Ties go to the earlier candidate.

    A pure function of its arguments: every rank gets the same answer. Resolve it in the data
    loader and pass the spec on: ``shard_batch(..., strategy=spec)``, then
    ``with cpcompile.strategy(batch)`` around the model.

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        heads: the attention's :class:`Heads` (what the all-to-all moves, which ``u`` divide).
        candidates: concrete specs (default :func:`candidates_with_heads`).
    """
    check_cp(cp_size)
    candidates = check_candidates(candidates_with_heads(cp_size, heads, model) if candidates is None else candidates)
    kw = {"cp_size": cp_size, "heads": heads, "model": model, "link": link}
    steps = [predict_step(cu_seqlens, strategy=c, **kw).step for c in candidates]
    return candidates[steps.index(min(steps))]

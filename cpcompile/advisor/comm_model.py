"""What CP attention moves between ranks per layer, and the choice of spec that weighs it.

Design constraint: like :mod:`cpcompile.cost.model`, integers on the host from ``cu_seqlens``
alone (and the model's head shape), so every rank gets the same answer; the bytes are
counted from the plans ``cp_attention`` makes, not measured.

:func:`layer_bytes` gives, per rank, the bytes it *receives* from the others in one
layer's forward and backward on the path ``cp_attention`` takes for a spec (the
all-gather, the reduce-scatter and the head all-to-alls send as much as they
receive; the sparse exchange's ranks differ). With ``T_l`` tokens per rank, ``G =
Hkv D``, ``b`` the element size of q, k, v and ``a`` the accumulation dtype's (4; 8 for
float64):

- all-gather (``head_parallel == 1``): K and V from the ``cp - 1`` others, in the forward
  and again in the backward, and the reduce-scatter of their dK/dV sums:
  ``(cp - 1) T_l G (2b + 2b + 2a)``;
- sparse exchange (where ``cp_attention`` takes it: ``comm.exchange.use_exchange``): the
  ``R_r`` K/V rows rank ``r`` reads from others, twice, and the dK/dV sums of the ``S_r``
  rows others read from it: ``G (4b R_r + 2a S_r)``;
- pure head parallelism (``u == cp``): an all-to-all moves ``(u - 1) / u`` of each tensor
  it carries (Note [head all-to-all] in ``comm/heads.py``): forward q, K, V (each K/V head
  ``f`` times: ``comm.heads.kv_replication``) and back the output and its float32 lse;
  backward dO, q, the output, K, V and lse, and back dQ, and dK/dV (``b``, or ``a`` where
  ``f > 1``: copies are summed before the one rounding);
- hybrid (``1 < u < cp``): the head all-to-alls inside the group of ``u`` (forward q, K, V
  and the output; backward the output's gradient and q's, K's and V's), and the all-gather
  path between the ``cp / u`` groups over ``u T_l`` tokens of ``Hkv f / u`` heads.

Not counted: the small cross-rank agreement (``checks``), the ring (``comm="ring"``: its bytes per
peer and step are :func:`cpcompile.advisor.timing.peer_bytes`').

:func:`choose_spec` is the opt-in that lets head parallelism compete: given the heads,
each candidate's step is the cost model's (:func:`cpcompile.cost.predict_rank_costs`, compute
in attention pairs) plus its bytes at an assumed bandwidth (:class:`Link`), turned into
pairs. ``auto`` itself keeps the requested ``head_parallel`` (``cpcompile.cost.model``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from cpcompile.checks import check_cp, check_int
from cpcompile.comm.heads import kv_replication
from cpcompile.cost.model import (
    CostModel,
    RankCosts,
    _host,
    auto_candidates,
    check_candidates,
    predict_rank_costs,
    resolve_auto,
)
from cpcompile.layouts.partition import pad_for_cp
from cpcompile.layouts.reads import read_ranges
from cpcompile.plan.exchange import SETTINGS, make_exchange
from cpcompile.plan.pieces import make_plan, pack_of
from cpcompile.spec import Strategy, StrategyLike, StrategySpec, check_head_parallel, resolve_strategy


class Heads(NamedTuple):
    """The attention's head shape: ``q`` query heads, ``kv`` key/value heads of ``dim`` elements
    of ``itemsize`` bytes (2: bf16; 4: float32; 8: float64)."""

    q: int
    kv: int
    dim: int = 128
    itemsize: int = 2

    @property
    def acc_itemsize(self) -> int:
        """Bytes of the accumulation dtype (float32; float64 for float64)."""
        return 8 if self.itemsize == 8 else 4


def check_heads(heads: object) -> Heads:
    """``heads`` as :class:`Heads`, or a ``ValueError`` naming it and what is accepted."""
    if not isinstance(heads, tuple) or not 2 <= len(heads) <= 4:
        raise ValueError(f"heads must be Heads(q, kv, dim=128, itemsize=2), got {heads!r}")
    heads = Heads(*heads)
    for name, value in heads._asdict().items():
        check_int(f"heads.{name}", value, minimum=1)
    if heads.q % heads.kv:
        raise ValueError(f"heads.q={heads.q} must be a multiple of heads.kv={heads.kv} (GQA)")
    if heads.itemsize not in (2, 4, 8):
        raise ValueError(f"heads.itemsize must be 2, 4 or 8 (bytes of q, k, v's dtype), got {heads.itemsize}")
    return heads


class LayerBytes(NamedTuple):
    """Bytes each rank receives in one layer (module docstring), ``[cp]`` int64 each, and the path."""

    forward: torch.Tensor
    backward: torch.Tensor
    path: str  # "all-gather", "exchange", "all-to-all" or "all-to-all + all-gather"

    @property
    def total(self) -> torch.Tensor:
        return self.forward + self.backward


def _all_gather(peers: int, rows: int, width: int, heads: Heads) -> tuple[int, int]:
    """(forward, backward) bytes of K and V all-gathered from ``peers`` ranks of ``rows`` rows of
    ``width`` elements, gathered again and their dK/dV sums reduce-scattered in the backward."""
    kv = 2 * peers * rows * width
    return kv * heads.itemsize, kv * (heads.itemsize + heads.acc_itemsize)


def _exchange_rows(cu, padded, cp: int, spec: StrategySpec, causal: bool, choice: str):
    """``(received, sent)`` K/V rows per rank of the sparse exchange, or ``None`` where ``cp_attention``
    takes the all-gather: the exchange's own plan of every rank (``comm.exchange.make_exchange``)."""
    plans = [make_plan(cu, padded, cp_size=cp, rank=r, strategy=spec) for r in range(cp)]
    _, pack = pack_of(cu, padded, cp, spec, None)
    reads = read_ranges(pack, (-1, 0) if causal else (-1, -1))
    exchanges = [make_exchange(p.k_start, p.k_len(causal), pack, reads, r, choice) for r, p in enumerate(plans)]
    if exchanges[0] is None:
        return None
    return [sum(e.recv_counts) for e in exchanges], [sum(e.send_counts) for e in exchanges]


def layer_arguments(cu_seqlens, cp_size: int, strategy: StrategyLike, heads, kv_exchange: str):
    """``(cu, spec, heads)``: the checked arguments of a layer's model (:func:`layer_bytes`,
    ``advisor.timing.peer_bytes``): ``cu_seqlens`` on the host, the strategy with ``auto`` resolved."""
    check_cp(cp_size)
    heads = check_heads(heads)
    if kv_exchange not in SETTINGS:
        raise ValueError(f"kv_exchange must be one of {SETTINGS}, got {kv_exchange!r}")
    cu = _host("cu_seqlens", cu_seqlens)
    return cu, resolve_auto(resolve_strategy(strategy), cu, cp_size=cp_size), heads


def layer_bytes(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike = None,
    heads: Heads,
    cu_seqlens_padded: torch.Tensor | None = None,
    causal: bool = True,
    kv_exchange: str = "auto",
) -> LayerBytes:
    """Bytes each rank receives in one layer's attention, forward and backward (module docstring).

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        strategy: any strategy (``auto`` is resolved first, keeping its ``head_parallel``);
            default the active one. ``comm="ring"`` is not modelled (a ``ValueError``).
        heads: the attention's :class:`Heads`; ``heads.q`` must divide by ``head_parallel``.
        cu_seqlens_padded: ``[B + 1]`` int32 physical offsets; default :func:`cpcompile.layouts.pad_for_cp`.
        kv_exchange: ``Config.kv_exchange`` (one of ``comm.exchange.SETTINGS``): whether sequence CP
            exchanges K/V rows where it pays (``"auto"``), always or never; the hybrid never does.
    """
    cu, spec, heads = layer_arguments(cu_seqlens, cp_size, strategy, heads, kv_exchange)
    if spec.comm != "all_gather":
        raise ValueError(f"layer_bytes models comm='all_gather' (with the exchange), got comm={spec.comm!r}")
    u = spec.head_parallel
    check_head_parallel(u, cp_size, heads.q)
    given = cu_seqlens_padded is not None
    padded = _host("cu_seqlens_padded", cu_seqlens_padded) if given else pad_for_cp(cu, cp_size=cp_size, strategy=spec)
    t_local = int(padded[-1]) // cp_size

    def per_rank(*values: int) -> list[torch.Tensor]:
        return [torch.full((cp_size,), v, dtype=torch.long) for v in values]

    if u == 1:
        if cp_size > 1 and (rows := _exchange_rows(cu, padded, cp_size, spec, causal, kv_exchange)) is not None:
            received, sent = (torch.tensor(r, dtype=torch.long) * (2 * heads.kv * heads.dim) for r in rows)
            forward = received * heads.itemsize
            return LayerBytes(forward, forward + sent * heads.acc_itemsize, "exchange")
        return LayerBytes(*per_rank(*_all_gather(cp_size - 1, t_local, heads.kv * heads.dim, heads)), "all-gather")
    f = kv_replication(heads.q, heads.kv, u)
    hq, hkv = heads.q // u, heads.kv * f // u  # each rank's heads after the all-to-all
    part = t_local * (u - 1) * heads.dim  # elements of one head slot a rank sends (and receives)
    b, a = heads.itemsize, heads.acc_itemsize
    if u == cp_size:
        lse = t_local * (u - 1) * hq * a
        forward = part * (hq + 2 * hkv) * b + part * hq * b + lse  # q, k, v; back: out, lse
        dkv = part * 2 * hkv * (b if f == 1 else a)
        backward = part * (3 * hq + 2 * hkv) * b + lse + part * hq * b + dkv  # dO, q, out, k, v, lse; dq, dk, dv
        return LayerBytes(*per_rank(forward, backward), "all-to-all")
    gather = _all_gather(cp_size // u - 1, u * t_local, hkv * heads.dim, heads)
    a2a = part * (hq + 2 * hkv) * b + part * hq * b  # q, k, v and out; in the backward their gradients
    return LayerBytes(*per_rank(a2a + gather[0], a2a + gather[1]), "all-to-all + all-gather")


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


def head_parallel_options(cp_size: int, q_heads: int) -> tuple[int, ...]:
    """Every ``u > 1`` that divides both ``cp_size`` and ``q_heads``, ascending."""
    return tuple(u for u in range(2, cp_size + 1) if cp_size % u == 0 and q_heads % u == 0)


def candidates_with_heads(cp_size: int, heads: Heads, model: CostModel | None = None) -> tuple[StrategySpec, ...]:
    """``auto``'s candidates, then for each of :func:`head_parallel_options`: the pure head
    parallelism (``u == cp``) on no_load_balance, which pads least (every layout gives it the
    same attention), else the hybrid on each of ``auto``'s layouts."""
    sequence = auto_candidates(model)
    specs = list(sequence)
    for u in head_parallel_options(cp_size, check_heads(heads).q):
        if u == cp_size:
            specs.append(StrategySpec(Strategy.NO_LOAD_BALANCE, head_parallel=u))
        else:
            specs += [dataclasses.replace(c, head_parallel=u) for c in sequence]
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
    """The candidate with the lowest :func:`predict_step`, head parallelism included: the opt-in
    to head parallelism that ``auto`` does not take by itself. Ties go to the earlier candidate.

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

"""Each rank's step time over a stated topology, and the choice of layout, K/V path and ``u`` made from it.

Design constraint: like :mod:`cpcompile.cost.model`, a pure function of ``cu_seqlens``, the
heads, the topology and the constants, computed on the host from integers (bytes, tiles, rows)
and Python floats in a fixed order, so every rank gets the same times and the same choice
without communicating.

What a rank does in one layer's attention (its phases, each a collective or ring steps, with the
bytes from each peer: :func:`peer_bytes`):

- *compute*: the cost model's kernel tiles at the kernel's speed per query head
  (:class:`KernelSpeed`: forward and backward picoseconds per tile and head, per key row the
  backward copies, per piece and key/value head a kernel sequence's own cost), plus the rows it
  copies locally (the exchange's compact keys and dK/dV, all-to-all packing) at its memory
  bandwidth and the ring's merges of partial results per step;
- *communication*: every phase over the :class:`Topology`, each collective or ring step paying
  ``call_us`` (launch, synchronisation, the copies around it) and its hops' latency: an all-to-all
  (the sparse exchange, the head all-to-alls) then takes ``max(intra bytes / intra bandwidth, inter
  bytes / inter bandwidth)``, the bytes from peers on the same node and on others; a ring collective
  (the all-gather and the reduce-scatter, ``n - 1`` hops) all its bytes at the intra-node bandwidth
  or, where the group spans nodes with ``m`` of its ranks on each, the bytes from other nodes spread
  over those ``m`` NICs (a ring enters each node once), whichever is slower; a ring step one block
  from the previous rank, over NVLink or a NIC.

A rank's time *as run* is compute + communication for the all-gather, the exchange and head
parallelism (none of them overlaps its K/V traffic with the kernel: docs/communication.md), and
for the ring, whose next block is in flight during a step, the sum over steps of the slowest
rank's ``max(step compute, step transfer)`` (its compute spread over its steps by their tiles) and
the backward's last dK/dV hand-back, which nothing hides. *Overlapped* is ``max(compute, communication)``
per rank: what a path that hid all its traffic would reach. The step is the slowest rank's.

The constants are fitted to the measured cp=2 runs on 2 x H200 (BENCHMARKS.md, "CP step with
communication"); docs/communication.md gives the fit and its error against every measured figure,
and the inter-node defaults, which are assumed, not measured.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import torch

from cpcompile.checks import check_cp, check_int
from cpcompile.comm.heads import kv_replication
from cpcompile.config import check_choice
from cpcompile.cost.comm import (
    Heads,
    Phase,
    check_heads,
    exchange_floor,
    head_parallel_options,
    layout_key,
    memoized,
    peer_bytes,
)
from cpcompile.cost.model import CostModel, auto_candidates, host_values, rank_costs, resolve_auto
from cpcompile.layouts.balanced import causal_tiles
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import padded_offsets, piece_marks, spec_runs
from cpcompile.spec import Strategy, StrategyLike, StrategySpec, resolve_strategy

#: The K/V paths :func:`predict_time` models: ``cp_attention``'s all-gather and sparse exchange, the ring
#: (``kv="ring"``), pure head parallelism (``kv="heads"``, ``head_parallel == cp``) and the hybrid (``1 < u < cp``).
PATHS = ("all-gather", "exchange", "ring", "heads", "hybrid")
PASSES = ("forward", "forward+backward")


def _check_number(name: str, value: object, *, positive: bool) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is an int or float > 0 (``positive``) or >= 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 or not positive and value == 0)
    if not ok:
        raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the ranks sit and what links them: ``gpus_per_node`` consecutive ranks share a node
    (NVLink, ``intra_gbps`` GB/s received per GPU), nodes are linked at ``inter_gbps`` GB/s per GPU
    (its NIC); latencies per hop in microseconds, and ``call_us`` per collective or ring step, whatever
    its size (its launch, its synchronisation and the copies around it)."""

    gpus_per_node: int = 8
    intra_gbps: float = 294.0
    inter_gbps: float = 50.0
    intra_latency_us: float = 3.0
    inter_latency_us: float = 10.0
    call_us: float = 254.0

    def __post_init__(self) -> None:
        check_int("gpus_per_node", self.gpus_per_node, minimum=1)
        for f in dataclasses.fields(self)[1:]:
            _check_number(f"Topology.{f.name}", getattr(self, f.name), positive=f.name.endswith("gbps"))

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


#: H200 nodes of 8 GPUs: NVLink as fitted to the cp=2 runs, and one 400 Gb/s NIC per GPU (assumed,
#: typical of InfiniBand NDR or RoCE clusters, not measured here: docs/communication.md).
H200 = Topology()
#: Named topologies for ``--topology``.
TOPOLOGIES = {
    "h200": H200,
    "h200-200g": dataclasses.replace(H200, inter_gbps=25.0),  # one 200 Gb/s NIC per GPU
    "h200-4": dataclasses.replace(H200, gpus_per_node=4),  # 4 GPUs per node
}


def parse_topology(text: str) -> Topology:
    """``NAME[,field=value...]``: a named topology (:data:`TOPOLOGIES`) with fields replaced, e.g.
    ``h200,inter_gbps=25,gpus_per_node=4``; a ``ValueError`` naming what is accepted otherwise."""
    name, *fields = text.split(",")
    if name not in TOPOLOGIES:
        raise ValueError(f"topology must start with one of {sorted(TOPOLOGIES)}, got {name!r} in {text!r}")
    topology, known = TOPOLOGIES[name], {f.name: f.type for f in dataclasses.fields(Topology)}
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq or key not in known:
            raise ValueError(f"topology fields are {sorted(known)} as field=value, got {field!r} in {text!r}")
        try:
            number = int(value) if key == "gpus_per_node" else float(value)
        except ValueError:
            raise ValueError(f"topology field {key} needs a number, got {value!r} in {text!r}") from None
        topology = dataclasses.replace(topology, **{key: number})
    return topology


@dataclasses.dataclass(frozen=True)
class KernelSpeed:
    """A rank's compute, per query head of 128 elements (time scales with ``dim / 128``): fitted to
    the cp=2 runs and the single-GPU times beside them (FlashAttention-4 on H200, bf16).

    ``token_ns``: a token's projections and MLP, forward and backward, per layer (0: attention alone,
    as ``benchmarks/cp_step.py`` times it; :data:`LLAMA_8B_TOKEN_NS` for a Llama-3-8B-like layer)."""

    forward_ps: float = 13_560.0  # per 128 x 128 tile and query head, forward
    backward_ps: float = 33_330.0  # per tile and query head, backward
    key_row_ps: float = 713.0  # per key row of the backward's pieces and query head (flash's copies)
    memory_gbps: float = 2910.0  # local copies
    ring_row_ps: float = 1820.0  # per ring step, row and head (query and key/value): merging, block copies
    piece_ps: float = 86_300.0  # per piece, key/value head and pass: a kernel sequence's own first and last tiles
    token_ns: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_number(f"KernelSpeed.{f.name}", getattr(self, f.name), positive=f.name.endswith("gbps"))


#: Projections and MLP of a Llama-3-8B-like layer per token, forward and backward: 6 x 218M FLOP at the
#: matmul throughput docs/cost-model.md assumes ("Where the default weights come from").
LLAMA_8B_TOKEN_NS = 2180.0


def phase_times(phase: Phase, topology: Topology, ranks: tuple[int, ...] | None = None) -> list[float]:
    """Microseconds each rank spends in ``phase`` (module docstring), all its ``count`` collectives or steps;
    ``ranks``: those ranks' alone, in that order."""
    cp, per_node = len(phase.recv), topology.gpus_per_node
    times = []
    # per rank, exact integers: bytes from its node (consecutive ranks) and from others, its peers and
    # those on its node; list operations, not tensors: a phase of cp squared counts is priced per option
    for r in range(cp) if ranks is None else ranks:
        row = phase.recv[r]
        node = row[r // per_node * per_node : (r // per_node + 1) * per_node]
        intra, inter = sum(node), sum(row) - sum(node)
        peers, near = cp - row.count(0), len(node) - node.count(0)
        times.append(_rank_us(phase, topology, intra, inter, peers, near) if peers and phase.count else 0.0)
    return times


def _rank_us(phase: Phase, topology: Topology, intra: int, inter: int, peers: int, near: int) -> float:
    """One rank's time in ``phase``: ``intra`` and ``inter`` bytes from its node and from others, from
    ``peers`` ranks, ``near`` of them on its node."""
    hop = topology.inter_latency_us if inter else topology.intra_latency_us
    intra_us = intra / (topology.intra_gbps * 1e3)
    if phase.kind == "ring":  # one block per step from the previous rank
        bandwidth = topology.inter_gbps if inter else topology.intra_gbps
        return phase.count * (topology.call_us + hop) + (intra + inter) / (bandwidth * 1e3)
    if phase.kind == "all-to-all":
        return phase.count * (topology.call_us + hop) + max(intra_us, inter / (topology.inter_gbps * 1e3))
    # a ring collective over this rank and its peers: every byte arrives over NVLink within the node;
    # those from other nodes enter the node once, through the NICs of the group's ranks on it
    inter_us = inter / ((1 + near) * topology.inter_gbps * 1e3)
    return phase.count * (topology.call_us + peers * hop) + max((intra + inter) / (topology.intra_gbps * 1e3), inter_us)


def _phase_us(phase: Phase, rank: int, topology: Topology) -> float:
    """:func:`phase_times` of one rank."""
    return phase_times(phase, topology)[rank]


def ring_step_tiles(cu: torch.Tensor, cp: int, spec: StrategySpec, causal: bool, pack: Pack | None = None):
    """``[cp][cp]``: kernel tiles rank ``r`` visits at ring step ``i`` (block of rank ``(r - i) % cp``), as
    the ring plans (:func:`cpcompile.plan.ring.make_ring_plan`) lay them out, for every rank at once: a
    piece (consecutive physical positions of one document) sees in another rank's block, causal, the
    block's rows of its document before its first row (non-causal: all of the document's), every query
    row alike; in its own block those up to its last row, bottom-right aligned."""
    pack = Pack.build(cu, None, spec=spec, cp_size=cp) if pack is None else pack
    layout, padded = pack.layout, pack.cu_seqlens_padded.long()  # [cp, T_local], each row ascending
    t_local = layout.shape[1]
    doc, _, real, start = piece_marks(layout, cu, padded)
    rank, row = start.nonzero(as_tuple=True)  # [P]
    first = rank * t_local + row
    q_len = torch.diff(first, append=first.new_full((1,), cp * t_local))
    live = real.reshape(-1)[first]
    where, d = layout.reshape(-1)[first], doc.reshape(-1)[first]  # physical first row, document
    lo = padded[d]
    hi = where if causal else lo + (cu[1:] - cu[:-1]).long()[d]

    def rows(bound: torch.Tensor) -> torch.Tensor:  # [cp, P]: each block's rows below each piece's bound
        return torch.searchsorted(layout, bound.expand(cp, -1).contiguous())

    keys = rows(hi) - rows(lo)  # [cp, P]
    if causal:  # the own block: its rows of the document up to the piece's last
        keys.scatter_(0, rank[None], rows(where + q_len).gather(0, rank[None]) - rows(lo).gather(0, rank[None]))
    tiles = (q_len + 127) // 128 * ((keys + 127) // 128)
    if causal:
        own = keys.gather(0, rank[None]).squeeze(0)
        tiles.scatter_(0, rank[None], causal_tiles(q_len, own - q_len)[None])
    tiles = torch.where(live & (keys > 0), tiles, 0)  # [block, piece]
    by_rank = torch.zeros(cp, cp, dtype=torch.long).index_add_(1, rank, tiles)  # [block, rank]
    steps = (torch.arange(cp)[:, None] - torch.arange(cp)[None, :]) % cp  # [rank, step]: the block at that step
    return by_rank.T.gather(1, steps).tolist()


class LayerTerms(NamedTuple):
    """What a layer's time is made of before the constants: per rank the kernel tiles, the backward's
    key rows, the bytes copied locally, and the phases (:func:`layer_terms`)."""

    spec: StrategySpec
    path: str
    heads: Heads
    backward: bool
    tokens: int  # rows per rank
    tiles: list[int]
    key_rows: list[int]  # 0 unless backward
    pieces: list[int]  # kernel sequences
    copied: list[int]  # bytes written by local copies
    merges: int  # ring steps whose partial results are merged, both passes
    phases: list[Phase]  # those of the passes
    ring_tiles: list[list[int]] | None  # ring: [rank][step] tiles


def layer_terms(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike,
    heads: Heads,
    passes: str = "forward+backward",
    causal: bool = True,
    _memo: dict | None = None,
) -> LayerTerms:
    """The terms of :func:`predict_time`, computed once (the plans): :func:`evaluate` prices them.

    ``_memo``: a dict that options of one pack share (:func:`decide`): packs, costs and ring steps by layout."""
    check_choice("passes", passes, PASSES)
    heads = check_heads(heads)
    cu = host_values("cu_seqlens", cu_seqlens)
    kw = {"cp_size": cp_size, "heads": heads, "causal": causal}
    layer = peer_bytes(cu, strategy=strategy, _memo=_memo, **kw)
    spec, cp, u = layer.spec, cp_size, layer.spec.head_parallel
    key = layout_key(spec)
    # the layout's runs, found once (peer_bytes may have): the options of every path and u count their
    # pieces from them; the pack is laid out token by token only where a capacity is checked, or for the
    # ring's steps
    pack = (_memo or {}).get(("pack", key))
    if spec.capacity is None and not spec.head_parallel == cp > 1:  # (u == cp: the pack in physical order)
        padded = padded_offsets(cu, key, cp)
        runs = memoized(_memo, ("runs", key), lambda: spec_runs(cu, padded, key, cp))
    else:
        runs = None
    costs = memoized(
        _memo,
        ("costs", key, spec.head_parallel, causal),
        lambda: rank_costs(cu, cp, spec, None, CostModel(causal=causal), pack, runs),
    )
    backward = passes == "forward+backward"
    b, a = heads.itemsize, heads.acc_itemsize
    f = kv_replication(heads.q, heads.kv, u) if u > 1 else 1
    kv_row = heads.kv * f // u * (heads.dim + heads.value_dim)  # elements of a K and a V row of the rank's heads
    phases = [p for p in layer.phases if p.direction == "forward" or backward]
    row_bytes = b + (b + a if backward else 0)  # K/V copied; in the backward again, and their dK/dV sums
    copied = []
    for r in range(cp):
        # the keys the kernel reads, put into one buffer: the gathered pack, or the exchange's compact keys
        rows = int(costs.keys_read[r]) if layer.path == "exchange" else 0
        n = rows * kv_row * row_bytes if cp > 1 else 0
        if layer.path in ("heads", "hybrid"):  # all-to-all packing: what a rank sends and receives
            n += 2 * sum(sum(p.recv[r]) for p in phases if p.kind == "all-to-all")
        copied.append(n)
    ring = layer.path == "ring" and cp > 1
    return LayerTerms(
        spec=spec,
        path=layer.path,
        heads=heads,
        backward=backward,
        tokens=int(costs.tokens[0]),
        tiles=costs.tiles.tolist(),
        key_rows=costs.key_rows.tolist() if backward else [0] * cp,
        pieces=costs.pieces.tolist(),
        copied=copied,
        merges=(cp - 1) * (2 if backward else 1) if ring else 0,
        phases=phases,
        ring_tiles=memoized(
            _memo,
            ("ring", key, causal),
            lambda: ring_step_tiles(cu, cp, spec, causal, pack),
        )
        if ring
        else None,
    )


class StepTime(NamedTuple):
    """One option's predicted layer, microseconds; per rank lists of ``cp`` floats."""

    spec: StrategySpec
    path: str
    compute: list[float]  # kernel tiles, key rows, local copies and ring merges (and the token term)
    comm: list[float]  # every phase, not overlapped
    received: list[int]  # bytes each rank receives
    as_run: float  # the slowest rank as the path runs (module docstring)
    overlapped: float  # the slowest rank's max(compute, comm)

    @property
    def serial(self) -> float:
        """The slowest rank's compute + communication."""
        return max(c + m for c, m in zip(self.compute, self.comm, strict=True))


def evaluate(terms: LayerTerms, topology: Topology = H200, speed: KernelSpeed | None = None) -> StepTime:
    """:class:`StepTime` of ``terms`` at ``topology`` and ``speed`` (cheap: no plans)."""
    speed = KernelSpeed() if speed is None else speed
    dims = (terms.heads.dim + terms.heads.value_dim) / 2  # QK^T over dim, PV over value_dim
    scale = terms.heads.q * dims / 128  # query heads of 128 elements
    per_tile = speed.forward_ps + (speed.backward_ps if terms.backward else 0.0)
    kv_scale = terms.heads.kv * dims / 128
    passes = 2 if terms.backward else 1
    merge = terms.merges * speed.ring_row_ps * (scale + kv_scale)
    fixed = terms.tokens * (speed.token_ns * 1e3 + merge)  # ps
    compute, comm = [], []
    phases = [phase_times(p, topology) for p in terms.phases]  # [phase][rank]
    per_rank = zip(terms.tiles, terms.key_rows, terms.pieces, terms.copied, strict=True)
    for r, (tiles, key_rows, pieces, copied) in enumerate(per_rank):
        ps = (tiles * per_tile + key_rows * speed.key_row_ps) * scale + pieces * passes * speed.piece_ps * kv_scale
        ps += fixed
        compute.append(ps / 1e6 + copied / (speed.memory_gbps * 1e3))
        comm.append(sum(times[r] for times in phases))
    received = [sum(sum(p.recv[r]) for p in terms.phases) for r in range(len(compute))]
    both = list(zip(compute, comm, strict=True))
    as_run = max(c + m for c, m in both)
    if terms.ring_tiles is not None:  # per step, the slowest rank's compute or its block's transfer
        cp = len(compute)
        shares = [[t / max(sum(row), 1) for t in row] for row in terms.ring_tiles]
        as_run = sum(max(max(c * shares[r][i], m / cp) for r, (c, m) in enumerate(both)) for i in range(cp))
        # the backward's last dK/dV block travels to its owner after the last step, hidden behind nothing
        tail = [p for p in terms.phases if p.direction == "backward" and p.count == cp]
        as_run += max((t / p.count for p in tail for t in phase_times(p, topology)), default=0.0)
    return StepTime(terms.spec, terms.path, compute, comm, received, as_run, max(max(c, m) for c, m in both))


def predict_time(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike,
    heads: Heads,
    topology: Topology = H200,
    speed: KernelSpeed | None = None,
    passes: str = "forward+backward",
    causal: bool = True,
) -> StepTime:
    """Each rank's predicted time of one layer (attention, plus ``speed.token_ns`` per token) under
    ``strategy`` (its ``kv`` and ``head_parallel`` included) over ``topology`` (module docstring).

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        heads: the attention's :class:`~cpcompile.cost.comm.Heads`.
        passes: ``"forward"`` or ``"forward+backward"``.
    """
    kw = {"heads": heads, "passes": passes, "causal": causal}
    return evaluate(layer_terms(cu_seqlens, cp_size=cp_size, strategy=strategy, **kw), topology, speed)


def option_name(spec: StrategySpec, cp_size: int) -> str:
    """A choice :func:`decide` weighs (a spec: its layout and ``kv``), by name: ``balanced exchange``,
    ``dual_chunk_swap ring``, ``no_load_balance heads u=8``, ``balanced hybrid u=2``."""
    layout, u = spec.strategy.value, spec.head_parallel
    if spec.strategy is Strategy.STRIPED and spec.stripe_size != 1:
        layout = f"striped_{spec.stripe_size}"
    if spec.kv == "ring":
        return f"{layout} ring"
    if u > 1:
        return f"{layout} {'heads' if u == cp_size else 'hybrid'} u={u}"
    return f"{layout} {'exchange' if spec.kv == 'exchange' else 'all-gather'}"


def options(cp_size: int, heads: Heads, paths: tuple[str, ...] = PATHS) -> tuple[StrategySpec, ...]:
    """The options :func:`decide` weighs, in tie-breaking order: each of ``auto``'s layouts with the
    all-gather, then the exchange, then the ring; pure head parallelism (``u == cp``) on no_load_balance
    (every layout gives it the same attention); the hybrid for each ``1 < u < cp`` that divides ``cp`` and
    the query heads, on each layout. ``paths``: those of :data:`PATHS` to include."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"paths must be among {PATHS}, got {sorted(unknown)}")
    layouts = auto_candidates()
    found = []
    if cp_size == 1:
        return (dataclasses.replace(layouts[0], kv="all_gather"),)
    for path, kv in (("all-gather", "all_gather"), ("exchange", "exchange"), ("ring", "ring")):
        if path in paths:
            found += [dataclasses.replace(s, kv=kv) for s in layouts]
    for u in head_parallel_options(cp_size, check_heads(heads).q):
        if u == cp_size and "heads" in paths:
            found.append(StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=u))
        elif u < cp_size and "hybrid" in paths:
            found += [dataclasses.replace(s, kv="heads", head_parallel=u) for s in layouts]
    return tuple(found)


class Decision(NamedTuple):
    """What :func:`decide` chose, and every option's predicted layer (``times``, in :func:`options`' order;
    ``None`` for an option :func:`decide` ruled out by its floor, under ``prune``)."""

    spec: StrategySpec
    time: StepTime
    options: tuple[StrategySpec, ...]
    times: list[StepTime | None]


def floor_ranks(cp: int) -> tuple[int, ...]:
    """The ranks whose traffic :func:`floor` bounds a layer by: 0, ``cp // 2`` and ``cp - 1``, each once (any
    rank's traffic bounds the slowest rank's from below; a few keep the bound cheap)."""
    return tuple(sorted({0, cp // 2, cp - 1}))


def floor(terms_of, option: StrategySpec, pairs: int, topology: Topology, speed: KernelSpeed | None) -> float:
    """A lower bound on ``option``'s ``as_run`` (microseconds): the most communication of ranks 0, ``cp // 2``
    and ``cp - 1`` (``terms_of`` gives the path's phases, whose bytes need no layout but the exchange's; of
    the exchange, the K/V those ranks receive, :func:`~cpcompile.cost.comm.exchange_floor`), and the ranks'
    mean kernel time, a kernel
    tile holding at most ``128 x 128`` of the pack's ``pairs`` (query-key pairs). Both bound the layer as run,
    the ring's too (it waits for each step's slowest rank, compute or transfer); shaved by a part in 10**9
    against rounding."""
    speed = KernelSpeed() if speed is None else speed
    _, phases, heads, backward, cp = terms_of(option)
    ranks = floor_ranks(cp)  # a few ranks' traffic, each summed as evaluate() sums it
    times = [phase_times(p, topology, ranks) for p in phases]
    comm = max((sum(t[i] for t in times) for i in range(len(ranks))), default=0.0)
    dims = (heads.dim + heads.value_dim) / 2
    per_tile = speed.forward_ps + (speed.backward_ps if backward else 0.0)
    kernel = pairs / (128 * 128) * per_tile * heads.q * dims / 128 / 1e6 / cp
    return max(comm, kernel) * (1 - 1e-9)


def decide(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    heads: Heads,
    topology: Topology = H200,
    speed: KernelSpeed | None = None,
    causal: bool = True,
    paths: tuple[str, ...] = PATHS,
    choices: tuple[StrategySpec, ...] | None = None,
    prune: bool = False,
) -> Decision:
    """The layout, K/V path and head parallelism ``u`` with the lowest predicted layer as it runs
    (:func:`predict_time`'s ``as_run``, forward and backward) for this pack over ``topology``; ties go to
    the earlier option (:func:`options`).

    A pure function of its arguments, computed on the host in a fixed order: every rank that calls it
    with the same ``cu_seqlens`` gets the same :class:`Decision`, without communicating. Run it in the data
    loader and pass the choice on: ``shard_batch(..., strategy=decision.spec)`` and
    ``with cpcompile.strategy(batch)`` (the spec holds the layout and ``kv``; the options' ``kernel`` and
    ``kv_chunks`` are the defaults).

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        heads: the attention's :class:`~cpcompile.cost.comm.Heads` (what head parallelism moves,
            which ``u`` divide).
        paths: the paths to weigh (default all of :data:`PATHS`).
        choices: the options to weigh instead (default :func:`options` of ``paths``).
        prune: weigh the options by their :func:`floor` first, lowest first, and leave out those whose floor
            is above a time found (or equal to it, after it in order): the same choice, without laying
            out the layouts only those options use (at large ``cp`` the all-gather's traffic alone rules
            it out); their ``times`` are ``None``. The runtime's ``auto`` prunes (:func:`resolve`).
    """
    check_cp(cp_size)
    cu = host_values("cu_seqlens", cu_seqlens)
    choices = options(cp_size, heads, paths) if choices is None else tuple(choices)
    if not choices:
        raise ValueError(f"paths={paths} leave no option at cp_size={cp_size} with {heads.q} query heads")
    memo: dict = {}  # the options share layouts: each built once
    kw = {"cp_size": cp_size, "heads": heads, "causal": causal, "_memo": memo}
    if not prune:
        times = [evaluate(layer_terms(cu, strategy=o, **kw), topology, speed) for o in choices]
        steps = [t.as_run for t in times]
        best = steps.index(min(steps))
        return Decision(choices[best], times[best], choices, times)
    heads = check_heads(heads)
    lengths = (cu[1:] - cu[:-1]).long()
    pairs = int((lengths * (lengths + 1) // 2 if causal else lengths * lengths).sum())

    def terms_of(option: StrategySpec):
        kw = {"cp_size": cp_size, "heads": heads, "causal": causal, "_memo": memo}
        if option.kv == "exchange" and option.capacity is None and cp_size > 1:  # its whole matrix is the cost
            phases = exchange_floor(cu, strategy=option, ranks=floor_ranks(cp_size), **kw)
            return "exchange", phases, heads, True, cp_size
        layer = peer_bytes(cu, strategy=option, **kw)
        return layer.path, layer.phases, heads, True, cp_size

    floors = [floor(terms_of, o, pairs, topology, speed) for o in choices]
    times: list[StepTime | None] = [None] * len(choices)
    best = None
    for i in sorted(range(len(choices)), key=lambda i: (floors[i], i)):
        if best is not None and (floors[i], i) > (times[best].as_run, best):
            continue  # it can neither be faster nor, as fast, come first
        times[i] = evaluate(layer_terms(cu, strategy=choices[i], **kw), topology, speed)
        if best is None or (times[i].as_run, i) < (times[best].as_run, best):
            best = i
    return Decision(choices[best], times[best], choices, times)


#: The head shape ``auto`` weighs the sequence paths at where the caller gives none: Llama-3-8B's (32 query and 8
#: key/value heads of 128, bf16), the shape the constants were fitted on. Head parallelism is weighed only with
#: the caller's heads (which ``u`` divide, what the all-to-alls move).
ASSUMED_HEADS = Heads(32, 8)
#: The paths weighed without heads: sequence CP alone (``head_parallel`` 1).
SEQUENCE_PATHS = ("all-gather", "exchange", "ring")
#: Decisions kept, by pack and arguments (:func:`resolve`): the ranks of a process and a loader that repeats
#: packs (epochs, buckets) decide once.
DECISIONS_KEPT = 256
_decisions: collections.OrderedDict = collections.OrderedDict()


def check_topology(topology: object) -> Topology:
    """``topology`` as a :class:`Topology` (given as one, or as :func:`parse_topology`'s text), or a
    ``ValueError`` naming it and what is accepted."""
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str):
        return parse_topology(topology)
    raise ValueError(
        f"topology must be a cpcompile.cost.timing.Topology or its text (e.g. 'h200,gpus_per_node=4'), got {topology!r}"
    )


def resolve(
    spec: StrategyLike,
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    heads: Heads | None = None,
    topology: Topology | str = H200,
    speed: KernelSpeed | None = None,
) -> StrategySpec:
    """``auto`` resolved with communication, as the runtime's ``auto`` runs it (``shard_batch(...,
    topology=...)``): :func:`decide`'s layout, ``kv`` and ``u`` for this pack, with the spec's ``kernel``
    and ``kv_chunks``; any other spec itself.

    What is weighed: with ``heads``, every option of :func:`options`; without, the sequence paths
    (:data:`SEQUENCE_PATHS`, ``u`` 1) at :data:`ASSUMED_HEADS`. A requested ``kv`` other than ``"auto"``
    keeps the path (and ``"heads"`` its ``head_parallel``): ``auto`` then picks the layout for it. Where the
    model does not reach, ``auto`` keeps the cost model's rule (:func:`cpcompile.cost.model.resolve_auto`,
    the requested ``kv`` and ``head_parallel``): under a ``capacity`` (sequence layouts that fit it) and at
    ``cp_size`` 1. Under sliding ``windows`` (which attention refuses with head parallelism, and which the
    step-time model does not count) the layout is the cost model's, and the topology picks among the
    sequence paths for it (all-gather, exchange, ring; a requested ``kv`` is kept): no head parallelism.

    A pure function of its arguments (no communication: every rank gets the same spec), kept per pack and
    arguments (:data:`DECISIONS_KEPT` of the latest).

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        heads: the attention's :class:`~cpcompile.cost.comm.Heads`, or ``None``.
        topology: where the ranks sit (a :class:`Topology` or :func:`parse_topology`'s text).
    """
    spec = resolve_strategy(spec)
    check_cp(cp_size)
    topology = check_topology(topology)
    given = heads is not None
    heads = check_heads(heads) if given else ASSUMED_HEADS
    if spec.strategy is not Strategy.AUTO:
        return spec
    if cp_size == 1 or spec.capacity is not None:  # one rank moves nothing; a capacity: the layouts that fit it
        return resolve_auto(spec, cu_seqlens, cp_size=cp_size)
    cu = host_values("cu_seqlens", cu_seqlens)
    key = (cu.to(torch.int64).numpy().tobytes(), cp_size, heads, given, topology, speed, spec.kv, spec.head_parallel)
    key += (spec.windows,)
    if key in _decisions:
        _decisions.move_to_end(key)
        picked = _decisions[key]
    elif spec.windows:
        # Attention refuses head parallelism under sliding windows, and the step-time model counts causal
        # layers: the layout is the kernel's work under the windows (resolve_auto, which tells `balanced` them),
        # and the topology weighs the sequence paths for it (a requested kv is kept).
        layout = resolve_auto(spec, cu, cp_size=cp_size)
        kvs = ("all_gather", "exchange", "ring") if spec.kv == "auto" else (spec.kv,)
        choices = tuple(dataclasses.replace(layout, kv=kv) for kv in kvs)
        picked = decide(
            cu, cp_size=cp_size, heads=heads, topology=topology, speed=speed, choices=choices, prune=True
        ).spec
        _decisions[key] = picked
    else:
        choices = options(cp_size, heads, PATHS if given else SEQUENCE_PATHS)
        if spec.kv != "auto":
            choices = tuple(o for o in choices if (o.kv, o.head_parallel) == (spec.kv, spec.head_parallel))
            if not choices:
                raise ValueError(
                    f"strategy 'auto' with kv={spec.kv!r}, head_parallel={spec.head_parallel} at cp_size={cp_size}: "
                    f"{'no such option' if given else 'head parallelism is weighed only given the heads'} "
                    f"(heads={tuple(heads) if given else None}); give the model's heads, or kv='auto'"
                )
        picked = decide(
            cu, cp_size=cp_size, heads=heads, topology=topology, speed=speed, choices=choices, prune=True
        ).spec
        _decisions[key] = picked
    while len(_decisions) > DECISIONS_KEPT:
        _decisions.popitem(last=False)
    return dataclasses.replace(picked, kernel=spec.kernel, kv_chunks=spec.kv_chunks)

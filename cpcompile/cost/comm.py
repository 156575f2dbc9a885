"""What CP attention moves between ranks per layer, and when the sparse exchange replaces the all-gather.

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
- sparse exchange (where ``cp_attention`` takes it: :func:`use_exchange`): the
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

Not counted: the small cross-rank agreement (``checks``), the ring (``kv="ring"``: its bytes per
peer and step are :func:`peer_bytes`').

The runtime's own rule between the all-gather and the exchange (:func:`use_exchange`, which
``cpcompile.plan.exchange`` applies per plan) lives here, below the plans, so that this model and
``auto``'s decision (:mod:`cpcompile.cost.timing`) count what the runtime will do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from cpcompile.checks import check_cp, check_int
from cpcompile.comm.heads import kv_replication
from cpcompile.cost.model import host_values, resolve_auto
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import layout_runs, padded_offsets, run_pieces, spec_runs
from cpcompile.layouts.reads import piece_reads, read_matrix, with_idle
from cpcompile.spec import StrategyLike, StrategySpec, check_head_parallel, resolve_strategy

#: Exchange when the busiest rank's rows sent or received are at most this fraction of an
#: all-gather's ``(cp - 1) x T_local``; ``StrategySpec.kv`` ``"exchange"`` and ``"all_gather"`` override it.
EXCHANGE_AT = 0.75
#: ``StrategySpec.exchange`` (of ``kv``): exchange where it pays, always, or never (all-gather).
SETTINGS = ("auto", "always", "never")


def use_exchange(counts: list[list[int]], t_local: int, kv_exchange: str = "auto") -> bool:
    """Whether to exchange, from ``counts[r][s]`` (rows rank r reads from rank s): the
    same answer on every rank, since every rank holds the whole matrix."""
    if kv_exchange != "auto":
        return kv_exchange == "always"
    cp = len(counts)
    received = [sum(row) - row[r] for r, row in enumerate(counts)]
    sent = [sum(counts[r][s] for r in range(cp)) - counts[s][s] for s in range(cp)]
    return max(received + sent) <= EXCHANGE_AT * (cp - 1) * t_local


class Heads(NamedTuple):
    """The attention's head shape: ``q`` query heads, ``kv`` key/value heads of ``dim`` elements
    of ``itemsize`` bytes (2: bf16; 4: float32; 8: float64); ``v_dim``: a value head's elements where
    they differ from the query/key heads' (MLA's ``v_head_dim``), ``None``: ``dim``."""

    q: int
    kv: int
    dim: int = 128
    itemsize: int = 2
    v_dim: int | None = None

    @property
    def value_dim(self) -> int:
        """Elements of a value head (and of an output head)."""
        return self.dim if self.v_dim is None else self.v_dim

    @property
    def acc_itemsize(self) -> int:
        """Bytes of the accumulation dtype (float32; float64 for float64)."""
        return 8 if self.itemsize == 8 else 4


def check_heads(heads: object) -> Heads:
    """``heads`` as :class:`Heads`, or a ``ValueError`` naming it and what is accepted."""
    if not isinstance(heads, tuple) or not 2 <= len(heads) <= 5:
        raise ValueError(f"heads must be Heads(q, kv, dim=128, itemsize=2, v_dim=None), got {heads!r}")
    heads = Heads(*heads)
    for name, value in heads._asdict().items():
        if value is not None or name != "v_dim":
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


def layer_arguments(cu_seqlens, cp_size: int, strategy: StrategyLike, heads):
    """``(cu, spec, heads)``: the checked arguments of a layer's model (:func:`layer_bytes`,
    :func:`peer_bytes`): ``cu_seqlens`` on the host, the strategy with ``auto`` resolved."""
    check_cp(cp_size)
    heads = check_heads(heads)
    cu = host_values("cu_seqlens", cu_seqlens)
    return cu, resolve_auto(resolve_strategy(strategy), cu, cp_size=cp_size), heads


def layer_bytes(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike = None,
    heads: Heads,
    cu_seqlens_padded: torch.Tensor | None = None,
    causal: bool = True,
) -> LayerBytes:
    """Bytes each rank receives in one layer's attention, forward and backward (module docstring).

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        strategy: any strategy (``auto`` is resolved first, keeping its ``kv`` and ``head_parallel``);
            default the active one. Its ``kv`` says how K/V move: ``"auto"`` exchanges K/V rows where
            it pays, ``"exchange"`` always, ``"all_gather"`` never (the hybrid never does); ``"ring"`` is
            not modelled (a ``ValueError``).
        heads: the attention's :class:`Heads`; ``heads.q`` must divide by ``head_parallel``.
        cu_seqlens_padded: ``[B + 1]`` int32 physical offsets; default :func:`cpcompile.layouts.pad_for_cp`.
    """
    cu, spec, heads = layer_arguments(cu_seqlens, cp_size, strategy, heads)
    if spec.kv == "ring":
        raise ValueError("layer_bytes models every kv but 'ring' (the all-gather, the exchange, heads), got kv='ring'")
    kw = {"cu_seqlens_padded": cu_seqlens_padded, "causal": causal}
    layer = peer_bytes(cu, cp_size=cp_size, strategy=spec, heads=heads, **kw)

    def received(direction: str) -> torch.Tensor:
        return torch.tensor(
            [sum(sum(p.recv[r]) for p in layer.phases if p.direction == direction) for r in range(cp_size)]
        )

    return LayerBytes(received("forward"), received("backward"), _PATHS[layer.path])


#: :func:`peer_bytes`' path names as :class:`LayerBytes` names them (by the collectives).
_PATHS = {
    "all-gather": "all-gather",
    "exchange": "exchange",
    "heads": "all-to-all",
    "hybrid": "all-to-all + all-gather",
}


class Phase(NamedTuple):
    """One collective (or ring steps) of a pass: ``recv[r][s]`` bytes rank ``r`` receives from ``s`` (lists, or
    a sequence of them)."""

    direction: str  # the pass it belongs to: "forward" or "backward"
    kind: str  # "all-to-all", "gather" (a ring collective over ``peers``), or "ring" (one block per step)
    recv: Sequence[list[int]]
    count: int = 1  # collectives of this shape (their latency)


class Layer(NamedTuple):
    """What :func:`peer_bytes` found: the spec (``auto`` resolved), the path and its phases."""

    spec: StrategySpec
    path: str
    phases: list[Phase]


def layout_key(spec: StrategySpec) -> StrategySpec:
    """What a spec's layout depends on: all of it but how attention runs (``kv``, ``head_parallel``: head
    parallelism runs a head group's layouts one after the other; ``kernel``, ``kv_chunks``)."""
    return dataclasses.replace(spec, kv="auto", head_parallel=1, kernel=None, kv_chunks=1)


def memoized(memo: dict | None, key: tuple, make):
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def exchange_matrix(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, runs: tuple[torch.Tensor, ...], causal: bool
) -> list[list[int]]:
    """``matrix[r][s]``: K/V rows rank ``r``'s pieces read from rank ``s`` (the sparse exchange's count
    matrix, :func:`cpcompile.layouts.reads.read_matrix`, as every rank builds it), counted from the
    layout's runs (:func:`cpcompile.layouts.partition.layout_runs`) of the pack of these offsets."""
    cp = int(runs[0][-1]) + 1
    pieces = run_pieces(*runs, cu_seqlens, cu_seqlens_padded)
    reads = piece_reads(pieces, cp, cu_seqlens, cu_seqlens_padded, (-1, 0) if causal else (-1, -1))[:3]
    return read_matrix(runs, with_idle(cu_seqlens_padded, reads, cp), cp)


class _Uniform(Sequence):
    """``recv[r][s] = nbytes`` for every peer ``s`` of ``r`` (a :class:`Phase`'s ``recv``): ``"others"``,
    every other rank; ``"prev"``, the previous rank, ``(r - 1) % cp`` (none where ``cp`` is 1);
    ``"group"``, the other ranks of ``r``'s group of ``u`` consecutive ranks; ``"across"``, the other ranks
    ``s`` with ``s % u == r % u``. A row is made where it is read: :func:`cpcompile.cost.timing.decide`
    bounds an option by one rank's, and ``cp`` squared counts per phase are most of its time at large
    ``cp``."""

    def __init__(self, cp: int, peers: str, nbytes: int, u: int = 1) -> None:
        self.cp, self.peers, self.nbytes, self.u = cp, peers, nbytes, u

    def __len__(self) -> int:
        return self.cp

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self._row(i) for i in range(*r.indices(self.cp))]
        return self._row(range(self.cp)[r])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))

    def _row(self, r: int) -> list[int]:
        cp, n, u = self.cp, self.nbytes, self.u
        if self.peers == "others":
            row = [n] * cp
        elif self.peers == "prev":
            row = [0] * cp
            row[(r - 1) % cp] = n
        elif self.peers == "group":
            row = [0] * (r // u * u) + [n] * u + [0] * (cp - r // u * u - u)
        else:  # across
            row = ([0] * (r % u) + [n] + [0] * (u - 1 - r % u)) * (cp // u)
        row[r] = 0
        return row


def peer_bytes(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike,
    heads: Heads,
    cu_seqlens_padded: torch.Tensor | None = None,
    causal: bool = True,
    _memo: dict | None = None,
) -> Layer:
    """Every phase of one layer's attention with the bytes each rank receives from each other rank.

    Summed over peers and phases of a pass, the bytes are :func:`layer_bytes`' (which the gloo tests check
    against the collectives), and for ``kv="ring"``: forward ``cp - 1`` K/V blocks from the previous rank,
    backward ``cp - 1`` K/V blocks and ``cp`` float32 dK/dV blocks. ``cu_seqlens_padded``: the pack's
    physical offsets where given (then ``_memo``, which keys on the layout alone, is not used).
    """
    cu, spec, heads = layer_arguments(cu_seqlens, cp_size, strategy, heads)
    u, cp = spec.head_parallel, cp_size
    check_head_parallel(u, cp, heads.q)
    padded = None if cu_seqlens_padded is None else host_values("cu_seqlens_padded", cu_seqlens_padded)
    _memo = _memo if padded is None else None
    key = layout_key(spec)
    if padded is not None or spec.capacity is not None:  # laid out, which checks them against the layout
        pack = memoized(_memo, ("pack", key), lambda: Pack.build(cu, padded, spec=spec, cp_size=cp))
        padded, runs_of = pack.cu_seqlens_padded, lambda: layout_runs(pack.layout)
    else:  # the reads need the layout's runs alone, and the other paths not even those
        padded = padded_offsets(cu, key, cp)
        runs_of = lambda: spec_runs(cu, padded, key, cp)  # noqa: E731
    t_local = int(padded[-1]) // cp
    d, dv = heads.dim, heads.value_dim
    b, a, g = heads.itemsize, heads.acc_itemsize, heads.kv * (d + dv)  # g: K and V elements of a token
    if spec.kv == "ring":
        block = t_local * g
        steps = cp - 1  # and in the backward one more for dK/dV: the hand-back to the owner
        phases = [
            Phase("forward", "ring", _Uniform(cp, "prev", steps * block * b), steps),
            Phase("backward", "ring", _Uniform(cp, "prev", steps * block * b), steps),
            Phase("backward", "ring", _Uniform(cp, "prev", (steps + 1) * block * a), steps + 1 if steps else 0),
        ]
        return Layer(spec, "ring", phases)
    if u == 1:
        if cp > 1 and spec.exchange != "never":
            runs = memoized(_memo, ("runs", key), runs_of)  # layer_terms counts pieces from them too
            matrix = memoized(_memo, ("matrix", key, causal), lambda: exchange_matrix(cu, padded, runs, causal))
        else:
            matrix = None
        if matrix is not None and use_exchange(matrix, t_local, spec.exchange):
            counts = np.array(matrix, dtype=np.int64)  # [cp, cp]: a rank's own rows do not travel
            np.fill_diagonal(counts, 0)
            recv, sums = (counts * g * b).tolist(), (counts.T * g * a).tolist()
            phases = [Phase("forward", "all-to-all", recv), Phase("backward", "all-to-all", recv)]
            return Layer(spec, "exchange", [*phases, Phase("backward", "all-to-all", sums)])
        kv = t_local * g  # K and V elements of one rank
        phases = [
            Phase("forward", "gather", _Uniform(cp, "others", kv * b), 2),
            Phase("backward", "gather", _Uniform(cp, "others", kv * b), 2),
            Phase("backward", "gather", _Uniform(cp, "others", kv * a), 2),
        ]
        return Layer(spec, "all-gather", phases)
    f = kv_replication(heads.q, heads.kv, u)
    hq, hkv = heads.q // u, heads.kv * f // u
    # elements of a q/k head and of a v/output head a rank sends to each group peer ((u - 1) of them)
    slot, vslot = t_local * d, t_local * dv
    qkv = slot * (hq + hkv) + vslot * hkv
    if u == cp:
        lse = t_local * hq * a
        fwd = [qkv * b, vslot * hq * b + lse]  # q, k, v; back: out, lse
        dkv = (slot + vslot) * hkv * (b if f == 1 else a)
        bwd = [(qkv + 2 * vslot * hq) * b + lse, slot * hq * b + dkv]  # dO, q, out, k, v, lse; back dq, dk, dv
        phases = [Phase("forward", "all-to-all", _Uniform(cp, "group", n, u)) for n in fwd]
        return Layer(
            spec, "heads", phases + [Phase("backward", "all-to-all", _Uniform(cp, "group", n, u)) for n in bwd]
        )
    a2a = [qkv * b, vslot * hq * b]
    kv = u * t_local * hkv * (d + dv)  # K and V elements of a head group's rank
    phases = [
        *(Phase("forward", "all-to-all", _Uniform(cp, "group", n, u)) for n in a2a),
        Phase("forward", "gather", _Uniform(cp, "across", kv * b, u), 2),
        *(Phase("backward", "all-to-all", _Uniform(cp, "group", n, u)) for n in a2a),
        Phase("backward", "gather", _Uniform(cp, "across", kv * b, u), 2),
        Phase("backward", "gather", _Uniform(cp, "across", kv * a, u), 2),
    ]
    return Layer(spec, "hybrid", phases)


def exchange_floor(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategySpec,
    heads: Heads,
    causal: bool,
    ranks: tuple[int, ...],
    _memo: dict,
) -> list[Phase]:
    """The sparse exchange's K/V phases (forward and backward, ``kv="exchange"``) with the bytes of
    ``ranks`` alone, the other ranks' rows empty: their rows of the count matrix, from their own reads and
    every rank's runs, without the others' reads (:func:`cpcompile.cost.timing.floor`: a bound on the layer
    that :func:`peer_bytes`' whole matrix would price, at a cost per read of ``ranks`` and run).
    ``cu_seqlens`` on the host, checked; the layout's runs are ``_memo``'s."""
    cp, key = cp_size, layout_key(strategy)
    padded = padded_offsets(cu_seqlens, key, cp)
    runs = memoized(_memo, ("runs", key), lambda: spec_runs(cu_seqlens, padded, key, cp))
    recv = [[0] * cp] * cp  # rows not counted stay empty (one list, never written)
    g = heads.kv * (heads.dim + heads.value_dim)
    for rank in ranks:
        own = runs[0] == rank
        pieces = run_pieces(runs[0][own] - rank, runs[1][own], runs[2][own], cu_seqlens, padded)  # its row: 0
        reader, lo, hi = piece_reads(pieces, 1, cu_seqlens, padded, (-1, 0) if causal else (-1, -1))[:3]
        reads = with_idle(padded, (reader + rank, lo, hi), cp)
        row = read_matrix(runs, reads, cp)[rank]
        recv[rank] = [0 if s == rank else n * g * heads.itemsize for s, n in enumerate(row)]
    return [Phase("forward", "all-to-all", recv), Phase("backward", "all-to-all", recv)]


def head_parallel_options(cp_size: int, q_heads: int) -> tuple[int, ...]:
    """Every ``u > 1`` that divides both ``cp_size`` and ``q_heads``, ascending."""
    return tuple(u for u in range(2, cp_size + 1) if cp_size % u == 0 and q_heads % u == 0)

"""Per-step attention plan: a rank's local queries cut into pieces, and their keys.

A *piece* is a maximal run of local tokens whose physical positions are consecutive,
inside one document, and all real or all padding. A real piece covering positions
``[a, b)`` of a document that starts at ``s`` attends, bottom-right aligned, to keys
``[s, b)`` when causal and to the document's real tokens when not; a padding piece
sees no keys (zero output, zero gradient). One varlen kernel call over all pieces
then computes the rank's attention, for every strategy.

The plan depends only on ``(cu_seqlens, cu_seqlens_padded, cp_size, rank, strategy)``:
build it once per step and share it across layers. Sizes are static given the
shapes (unused piece slots are empty), so nothing is read on the host, except by
balanced (its cuts are chosen on the host) and auto (resolved from ``cu_seqlens``).

A plan also carries the pack it was made from, as values: its ``gather_index`` is the layout
of every rank (its inverse), and its ``cu_seqlens`` and ``cu_seqlens_padded`` are the pack's
offsets, which every rank holds alike. From them any rank derives which keys every other rank
reads (:mod:`cpcompile.layouts.reads`), without asking it: the sparse K/V exchange's plan needs
that, and so needs no communication.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from cpcompile.cache import on_host, per_plan, upload
from cpcompile.checks import check_cp, check_int, check_offsets
from cpcompile.cost.model import auto_candidates, resolve_auto
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import layout_runs, piece_marks, run_pieces
from cpcompile.spec import Strategy, StrategyLike, StrategySpec, resolve_strategy


class AttentionPlan(NamedTuple):
    """What one rank needs to run CP attention (``P`` = piece slots, ``T`` = padded tokens, ``B`` documents).

    - ``gather_index``: ``[T]`` int64, row of the all-gathered K/V holding physical position p.
    - ``cu_q``: ``[P + 1]`` int32, local query offsets of the pieces (trailing slots empty).
    - ``k_start``: ``[P]`` int32, physical position of each piece's first key (its document start).
    - ``k_len_causal``: ``[P]`` int32, keys a piece sees when causal (0 for padding pieces).
    - ``k_len_full``: ``[P]`` int32, keys a piece sees when not causal (its document's real length).
    - ``cu_seqlens``: ``[B + 1]`` int32, the pack's real offsets the plan was made from.
    - ``cu_seqlens_padded``: ``[B + 1]`` int32, its physical offsets (given, or the layout's padding).

    The last two and ``gather_index`` (whose inverse is every rank's layout, :func:`layout_of`) are the
    whole pack: the sparse exchange derives every rank's reads from them (:mod:`cpcompile.plan.exchange`).
    """

    gather_index: torch.Tensor
    cu_q: torch.Tensor
    k_start: torch.Tensor
    k_len_causal: torch.Tensor
    k_len_full: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor

    def k_len(self, causal: bool) -> torch.Tensor:
        return self.k_len_causal if causal else self.k_len_full

    @property
    def pieces(self) -> tuple[torch.Tensor, ...]:
        """``(cu_q, k_start, k_len_causal, k_len_full)``: what :func:`cpcompile.plan.window.window_keys` takes."""
        return self.cu_q, self.k_start, self.k_len_causal, self.k_len_full


def max_pieces(spec: StrategySpec, num_docs: int, t_local):
    """Static upper bound on a rank's pieces (each piece has at least one token).

    A rank's layout is a set of runs of consecutive positions; document starts and
    real/padding boundaries cut them further (each cuts at most one run).
    """
    if spec.strategy is Strategy.DUAL_CHUNK_SWAP:
        bound = 3 * num_docs  # two chunks per document, one of them cut by its padding
    elif spec.strategy is Strategy.STRIPED:
        bound = t_local // spec.stripe_size + 2 * num_docs
    elif spec.strategy is Strategy.BALANCED:
        # a head and a tail run per document (four runs for the one document that can lie
        # in both of a rank's ranges), each document's padding cutting one of them
        bound = 3 * num_docs + 2
    elif spec.strategy is Strategy.AUTO:
        # slots for whichever strategy auto picks, so the plan's sizes do not depend on values
        return functools.reduce(torch.sym_max, (max_pieces(c, num_docs, t_local) for c in auto_candidates()))
    else:
        bound = 2 * num_docs  # one run, cut by document starts and padding
    return torch.sym_min(t_local, bound)


def max_piece_len(spec: StrategySpec, cp_size: int, max_seqlen):
    """Upper bound on a real piece's query rows, given the longest document ``max_seqlen``.

    A launch bound for GPU kernels, whose grids are sized by it: the document length
    overstates dual_chunk_swap's and striped's pieces by ``cp`` and more. Works on ints,
    SymInts and ``fx.Proxy`` (arithmetic only). Padding pieces may be longer; they see
    no keys and are zeroed, so kernels may skip their rows.
    """
    if spec.strategy is Strategy.DUAL_CHUNK_SWAP:
        # chunks of ceil(L / 2cp) rows; rank cp-1 holds the two middle ones, adjacent
        return (max_seqlen + 2 * cp_size - 1) // (2 * cp_size) * 2
    if spec.strategy is Strategy.STRIPED and cp_size > 1:
        return spec.stripe_size  # a rank's stripes are never adjacent
    return max_seqlen


def pack_of(cu_seqlens, cu_seqlens_padded, cp_size: int, strategy, num_tokens) -> tuple[StrategySpec, Pack]:
    """``(requested, pack)``: ``strategy`` as requested, and the pack (of offsets a public entry checked)
    laid out by it, ``auto`` resolved alike on every rank (``pack.spec``)."""
    requested = resolve_strategy(strategy)
    spec = resolve_auto(requested, cu_seqlens, cp_size=cp_size)
    return requested, Pack.build(cu_seqlens, cu_seqlens_padded, spec=spec, cp_size=cp_size, num_tokens=num_tokens)


def _tracing() -> bool:
    """Whether torch ops are being recorded (compiled, or under a dispatch mode), which numpy would bypass."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def _gather_index(layout: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64: for each physical position, its row in the all-gather of the ranks' rows, from
    ``layout`` ``[cp, T_local]`` (row-major, the all-gather's rows are each rank's positions)."""
    flat = layout.reshape(-1)
    if type(flat) is torch.Tensor and flat.device.type == "cpu" and not _tracing():
        # on the host (where plans are made) numpy's scatter, which costs less than torch's at large T
        inverse = np.empty(flat.shape[0], dtype=np.int64)
        inverse[flat.numpy(force=True)] = np.arange(flat.shape[0], dtype=np.int64)
        return torch.from_numpy(inverse)
    return torch.empty_like(flat).scatter_(0, flat, torch.arange(flat.shape[0], device=flat.device))


@per_plan
def layout_of(gather_index: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``[cp, T_local]`` int64: every rank's physical positions, each row ascending: the inverse of
    ``gather_index`` ``[T]`` (:func:`_gather_index`: all-gathered rows are rank-major). A plan made on
    the host puts the layout it was made from here (``layout_of.remember``): the exchange's plan reads
    it, and inverting the index would make it again (T values, per plan)."""
    return _gather_index(gather_index).view(cp_size, gather_index.shape[0] // cp_size)


def check_plan_arguments(cu_seqlens, cu_seqlens_padded, cp_size, rank, num_tokens, *, per_rank: bool = True) -> None:
    """The checks of the public plan functions' arguments (the plan's internals check nothing again);
    ``per_rank``: the plan is one rank's, whose ``rank`` must be given."""
    check_cp(cp_size, rank, rank_given=per_rank)
    if num_tokens is not None and not isinstance(num_tokens, torch.SymInt):
        check_int("num_tokens", num_tokens, minimum=1)
    check_offsets(cu_seqlens, cu_seqlens_padded)


def make_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_size: int,
    rank: int,
    strategy: StrategyLike = None,
    num_tokens: int | None = None,
) -> AttentionPlan:
    """Build rank ``rank``'s :class:`AttentionPlan`.

    Args:
        cu_seqlens: ``[B + 1]`` int32 global cumulative real lengths.
        cu_seqlens_padded: ``[B + 1]`` int32 global physical offsets; ``None``: :func:`pad_for_cp`.
        num_tokens: padded total ``T`` (``T_local * cp_size``) if known, so no value is read on the host.
        strategy: ``auto`` is resolved here from ``cu_seqlens`` (:func:`cpcompile.cost.choose_strategy`, the
            same answer on every rank), which costs the cost model's host time per call: pass the
            ``ShardedBatch.spec`` the data loader resolved instead.
    """
    check_plan_arguments(cu_seqlens, cu_seqlens_padded, cp_size, rank, num_tokens)
    return plan_of(cu_seqlens, cu_seqlens_padded, cp_size=cp_size, rank=rank, strategy=strategy, num_tokens=num_tokens)


def plan_of(cu_seqlens, cu_seqlens_padded=None, *, cp_size: int, rank: int, strategy=None, num_tokens=None):
    """:func:`make_plan` (an :class:`AttentionPlan`) of offsets a public entry checked."""
    requested, pack = pack_of(cu_seqlens, cu_seqlens_padded, cp_size, strategy, num_tokens)
    return _rank_plan(pack, requested, cu_seqlens, rank)


def _rank_plan(pack: Pack, requested: StrategySpec, cu_seqlens: torch.Tensor, rank: int) -> AttentionPlan:
    """Rank ``rank``'s plan of ``pack`` (:func:`pack_of`)."""
    layout = pack.layout
    gather_index = _gather_index(layout)
    if not _tracing():
        layout_of.remember(gather_index, layout.shape[0], result=layout)
    num_pieces = max_pieces(requested, cu_seqlens.shape[0] - 1, layout.shape[1])
    return _pieces_plan(layout[rank], num_pieces, gather_index, cu_seqlens, pack.cu_seqlens_padded)


def _pieces_plan(positions, num_pieces, gather_index, cu_seqlens, cu_seqlens_padded) -> AttentionPlan:
    """The plan whose queries are the tokens at physical ``positions`` ``[N]`` (a rank's, or its head
    group's, in their order), cut into pieces in ``num_pieces`` slots, keys read through ``gather_index``."""
    n = positions.shape[0]
    doc, pos, real, new_piece = piece_marks(positions, cu_seqlens, cu_seqlens_padded)  # [N] each
    real_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    starts = torch.nonzero_static(new_piece, size=num_pieces, fill_value=n).squeeze(1)  # [P]
    cu_q = torch.cat([starts, starts.new_full((1,), n)])  # [P + 1]
    q_len = cu_q[1:] - cu_q[:-1]
    first = starts.clamp(max=n - 1)  # empty trailing slots read a valid row, then get no keys
    live = (q_len > 0) & real[first]
    return AttentionPlan(
        gather_index=gather_index,
        cu_q=cu_q.to(torch.int32),
        k_start=cu_seqlens_padded.long()[doc[first]].to(torch.int32),
        k_len_causal=torch.where(live, pos[first] + q_len, 0).to(torch.int32),
        k_len_full=torch.where(live, real_len[doc[first]], 0).to(torch.int32),
        **_offsets(cu_seqlens, cu_seqlens_padded),
    )


def _offsets(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> dict[str, torch.Tensor]:
    """A plan's ``cu_seqlens`` and ``cu_seqlens_padded`` fields: int32 copies of the pack's offsets. Copies,
    not the caller's tensors: a plan cached by them (``per_plan``) would keep them alive, and its entry
    with them."""
    return {
        "cu_seqlens": cu_seqlens.to(torch.int32, copy=True),
        "cu_seqlens_padded": cu_seqlens_padded.to(torch.int32, copy=True),
    }


def plan_extras(spec: StrategySpec) -> tuple:
    """The arguments after ``stripe_size`` that :func:`step_plan` (and the ``cp_plan`` op) take for
    ``spec``: its windows, then its capacity, each only where set, so that without them the ``cp_plan``
    call in a graph is the one of the schema's defaults."""
    if spec.capacity is not None:
        return tuple(spec.windows), tuple(spec.capacity)
    return (tuple(spec.windows),) if spec.windows else ()


def _host_spec(cu_seqlens, cu_seqlens_padded, strategy: str, stripe_size: int, windows=(), capacity=()):
    """``(cu, padded, spec)``: host copies of the pack (no sync where they are its host twins; ``padded``
    ``None`` where not given) and the spec of a plan op's arguments."""
    padded = () if cu_seqlens_padded is None else (cu_seqlens_padded,)
    cu, *padded = on_host(cu_seqlens, *padded)
    return cu, (padded[0] if padded else None), op_spec(strategy, stripe_size, windows, capacity)


def op_spec(strategy: str, stripe_size: int, windows=(), capacity=()) -> StrategySpec:
    """The :class:`StrategySpec` of a plan op's layout arguments (``()``: no windows, no capacity)."""
    return StrategySpec(Strategy(strategy), stripe_size, windows=tuple(windows), capacity=tuple(capacity) or None)


def _made_on_host(make, cu_seqlens, cu_seqlens_padded, strategy: str, stripe_size: int, windows=(), capacity=(), **kw):
    """``make(cu, padded, strategy=..., **kw)`` (an :class:`AttentionPlan`) run on host copies of the pack
    (no sync where they are its host twins) and its tensors uploaded to ``cu_seqlens``' device with
    host twins (:mod:`cpcompile.cache`), so that what derives from the plan reads sizes there."""
    cu, padded, spec = _host_spec(cu_seqlens, cu_seqlens_padded, strategy, stripe_size, windows, capacity)
    return AttentionPlan(*(upload(t, cu_seqlens.device) for t in make(cu, padded, strategy=spec, **kw)))


def every_rank_key_ranges(
    cu_seqlens, cu_seqlens_padded, num_tokens, cp_size: int, strategy: str, stripe_size: int, windows=(), capacity=()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every rank's pieces that see keys, of a pack (the arguments after ``rank``'s place as :func:`step_plan`'s),
    on the host: ``(rank, k_start, k_len_causal, k_len_full)``, each ``[P]`` int64, the fields of the ranks'
    plans for those pieces, in no particular order. From the layout's runs (no value per token, where
    :func:`step_plan` marks a rank's tokens): what a rank derives from its peers' pieces without communication
    (the layers of pieces a captured step's graph is chosen by, ``compiler.captured_step.pack_layers``)."""
    cu, padded, spec = _host_spec(cu_seqlens, cu_seqlens_padded, strategy, stripe_size, windows, capacity)
    _, pack = pack_of(cu, padded, cp_size, spec, num_tokens)
    row, _, length, doc, pos, real = run_pieces(*layout_runs(pack.layout), cu, pack.cu_seqlens_padded)
    live = real & (length > 0)  # as a plan's: a real piece (its rows, pieces of padding see no keys)
    d = doc[live]
    real_len = (cu[1:] - cu[:-1]).long()
    return row[live], pack.cu_seqlens_padded.long()[d], (pos + length)[live], real_len[d]


def step_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    num_tokens: int,
    cp_size: int,
    rank: int,
    strategy: str,
    stripe_size: int,
    windows: tuple[int, ...] = (),
    capacity: tuple[int, ...] = (),
) -> AttentionPlan:
    """:func:`make_plan` once per step, for every layer: made on the host and uploaded.

    The document lengths are read on the host once (a host sync on GPUs, none where
    the data loader uploaded ``cu_seqlens`` with its host twin: ``shard_batch(...,
    device=...)``); the plan is made there (balanced chooses its cuts on the host in
    any case) and uploaded to ``cu_seqlens``' device with host twins, so that the
    metadata derived from it later reads its sizes without a sync
    (:mod:`cpcompile.cache`). ``strategy``: a :class:`Strategy` value (``auto`` is
    resolved here, alike on every rank); ``windows``, ``capacity``: the spec's (``()``: none).

    Every argument is passed on, defaults included, so that one plan has one ``per_plan`` key however
    it is asked for (the data loader's ``shard_batch(..., device=...)`` ahead of the step, the
    ``cp_plan`` op in it).
    """
    args = (cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, strategy, stripe_size)
    return _step_plan(*args, tuple(windows), tuple(capacity))


@per_plan
def _step_plan(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, strategy, stripe_size, windows, capacity):
    """:func:`step_plan`, cached on all its arguments."""
    kw = {"cp_size": cp_size, "rank": rank, "num_tokens": num_tokens, "windows": windows, "capacity": capacity}
    return _made_on_host(plan_of, cu_seqlens, cu_seqlens_padded, strategy, stripe_size, **kw)


def make_head_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_size: int,
    strategy: StrategyLike = None,
    num_tokens: int | None = None,
) -> AttentionPlan:
    """The plan of head-parallel attention (``head_parallel == cp_size``), the same on every rank.

    After the head all-to-all a rank holds every token of its heads in the all-gather's
    order, so the plan is the layout's ``gather_index`` (physical position -> gathered row)
    and, over the physical buffer, the pieces of single-device attention: whole documents,
    and their padding, which sees no key.
    """
    check_plan_arguments(cu_seqlens, cu_seqlens_padded, cp_size, None, num_tokens, per_rank=False)
    return head_plan_of(cu_seqlens, cu_seqlens_padded, cp_size=cp_size, strategy=strategy, num_tokens=num_tokens)


def head_plan_of(cu_seqlens, cu_seqlens_padded=None, *, cp_size: int, strategy=None, num_tokens=None) -> AttentionPlan:
    """:func:`make_head_plan` of offsets a public entry checked."""
    _, pack = pack_of(cu_seqlens, cu_seqlens_padded, cp_size, strategy, num_tokens)
    gather_index = _gather_index(pack.layout)
    whole = plan_of(
        cu_seqlens,
        pack.cu_seqlens_padded,
        cp_size=1,
        rank=0,
        strategy=Strategy.NO_LOAD_BALANCE,
        num_tokens=num_tokens,
    )
    return AttentionPlan(gather_index, *whole[1:])


@per_plan
def head_step_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    num_tokens: int,
    cp_size: int,
    strategy: str,
    stripe_size: int,
) -> AttentionPlan:
    """:func:`make_head_plan` once per step, made on the host and uploaded (as :func:`step_plan`)."""
    kw = {"cp_size": cp_size, "num_tokens": num_tokens}
    return _made_on_host(head_plan_of, cu_seqlens, cu_seqlens_padded, strategy, stripe_size, **kw)


def make_hybrid_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_size: int,
    head_parallel: int,
    rank: int,
    strategy: StrategyLike = None,
    num_tokens: int | None = None,
) -> AttentionPlan:
    """The sequence-level plan of hybrid head x context parallelism (``1 < head_parallel < cp_size``).

    Ranks form ``cp / u`` head groups of ``u`` consecutive ranks. After the head all-to-all,
    every rank of group ``s`` holds, for its heads, the tokens of all the group's ranks in
    rank order: the group acts as one CP rank of ``cp / u`` whose layout is its members'
    layouts one after the other. So the all-gather between groups (ranks ``j, u + j, ...``)
    yields the rows in the same order as an all-gather over all ``cp`` ranks: the
    ``gather_index`` is the layout's; the pieces are those of the group's concatenated positions.
    """
    check_plan_arguments(cu_seqlens, cu_seqlens_padded, cp_size, rank, num_tokens)
    args = {"cp_size": cp_size, "head_parallel": head_parallel, "rank": rank, "strategy": strategy}
    return hybrid_plan_of(cu_seqlens, cu_seqlens_padded, **args, num_tokens=num_tokens)


def hybrid_plan_of(
    cu_seqlens, cu_seqlens_padded=None, *, cp_size: int, head_parallel: int, rank: int, strategy=None, num_tokens=None
) -> AttentionPlan:
    """:func:`make_hybrid_plan` of offsets a public entry checked."""
    requested, pack = pack_of(cu_seqlens, cu_seqlens_padded, cp_size, strategy, num_tokens)
    layout, u = pack.layout, head_parallel
    s = rank // u
    positions = layout[s * u : (s + 1) * u].reshape(-1)  # [u * T_local]: the group's tokens, member by member
    # slots for whatever auto picks, as make_plan's, so that the sizes do not depend on values
    num_pieces = torch.sym_min(positions.shape[0], u * max_pieces(requested, cu_seqlens.shape[0] - 1, layout.shape[1]))
    return _pieces_plan(positions, num_pieces, _gather_index(layout), cu_seqlens, pack.cu_seqlens_padded)


@per_plan
def hybrid_step_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    num_tokens: int,
    cp_size: int,
    head_parallel: int,
    rank: int,
    strategy: str,
    stripe_size: int,
) -> AttentionPlan:
    """:func:`make_hybrid_plan` once per step, made on the host and uploaded (as :func:`step_plan`)."""
    kw = {"cp_size": cp_size, "head_parallel": head_parallel, "rank": rank, "num_tokens": num_tokens}
    return _made_on_host(hybrid_plan_of, cu_seqlens, cu_seqlens_padded, strategy, stripe_size, **kw)


def spec_step_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    num_tokens: int,
    cp_size: int,
    rank: int,
    spec: StrategySpec,
) -> AttentionPlan:
    """The step plan attention of ``spec`` runs from on rank ``rank`` (the plan op a compiled call
    makes, ``compiler.shard_attention``): :func:`head_step_plan` where ``spec.head_parallel`` is
    ``cp_size``, :func:`hybrid_step_plan` where it is between 1 and ``cp_size``, else :func:`step_plan`
    (``auto`` resolved in the plan, alike on every rank)."""
    layout = (spec.strategy.value, spec.stripe_size)
    if spec.head_parallel == 1:
        return step_plan(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, *layout, *plan_extras(spec))
    if spec.head_parallel == cp_size:
        return head_step_plan(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, *layout)
    args = (num_tokens, cp_size, spec.head_parallel, rank, *layout)  # the rank's head group's pieces
    return hybrid_step_plan(cu_seqlens, cu_seqlens_padded, *args)

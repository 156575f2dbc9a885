"""The sparse K/V exchange's plan: which rows each rank reads, and where they land.

A rank's pieces read document prefixes, which under balanced and no_load_balance
lie mostly on the rank itself (docs/communication.md: a small fraction of what an
all-gather brings; under dual_chunk_swap all of it). So, per plan, each rank works out
which rows every rank reads, from the pack the plan carries (its layout, ``gather_index``, and
its offsets), which all ranks hold alike (:func:`exchange_plan`: no communication, and no host
sync where the plan was made on the host, as :func:`cpcompile.plan.pieces.step_plan` makes it).
The all-gather path stays for layouts where ranks read most keys: :func:`cpcompile.cost.comm.use_exchange` picks per
plan, the same way on every rank, from the count matrix they all hold
(:func:`cpcompile.layouts.reads.read_matrix`); ``cost.comm.EXCHANGE_AT`` keeps a margin for cp > 2, where the
all-to-all spans more GPUs. The rule lives with the communication model, which counts what it decides.

:mod:`cpcompile.comm.exchange` moves the rows this plan names; :mod:`cpcompile.attention.exchange`
runs the kernel between the moves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cpcompile.cache import on_host, per_plan, twinned, upload
from cpcompile.comm.groups import resolve_group
from cpcompile.config import check_choice
from cpcompile.cost.comm import SETTINGS, use_exchange
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import layout_runs
from cpcompile.layouts.reads import keys_read, read_matrix, read_ranges, with_idle
from cpcompile.plan.pieces import layout_of


class Exchange(NamedTuple):
    """One rank's exchange for one plan (``R`` keys read, ``cp`` ranks, ``L`` layers of sums).

    - ``k_start``: ``[P]`` int32, each piece's first key among the compact keys.
    - ``gather``: ``[R]`` int64, the compact keys' rows in the rank's own rows followed by
      the received ones.
    - ``send_rows``: ``[n_send]`` int64, the local rows others read, in receiver order.
    - ``recv_dst``: ``[n_recv]`` int64, the compact rows of the received keys, in sender order.
    - ``sums``: ``[L, T_local]`` int64, per layer the row of ``[compact rows; returned
      rows; spare]`` that holds a part of each local row's gradient: layer 0 its own
      compact row, then one layer per sender, in rank order (``spare``: no part).
    - ``recv_counts``, ``send_counts``: ``[cp]`` rows from and to each rank (0 for itself).

    A rank whose pieces read no key still reads one (``R`` is 1: kernels need keys); no piece
    reads it, so the kernel gives it no gradient parts and its owner gets 0 back.
    """

    k_start: torch.Tensor
    gather: torch.Tensor
    send_rows: torch.Tensor
    recv_dst: torch.Tensor
    sums: torch.Tensor
    recv_counts: list[int]
    send_counts: list[int]


class Reads(NamedTuple):
    """The keys one rank's pieces read, ``R`` of the layout's ``T`` (over ``cp`` ranks).

    - ``rows``: ``[R]`` int64, their physical rows, in order: the compact keys.
    - ``k_start``: ``[P]`` int32, each piece's first key among them (0 for pieces without keys).
    - ``owner``, ``local_row``: ``[R]`` int64, the rank holding each and its row there.
    - ``counts``: ``[cp]`` int64, how many each rank holds.
    - ``idle``: no piece reads a key; ``rows`` is then physical row 0 alone (kernels need keys).
    """

    rows: torch.Tensor
    k_start: torch.Tensor
    owner: torch.Tensor
    local_row: torch.Tensor
    counts: torch.Tensor
    idle: bool


@twinned  # on the host where the plan has twins: R and the counts are read there
def reads(gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, cp: int) -> Reads:
    """:class:`Reads` of pieces ``k_start``, ``k_len`` ``[P]`` (physical keys) over the layout
    ``gather_index [T]`` of ``cp`` ranks; finding ``R`` is a host sync where the plan has no
    host twins."""
    t = gather_index.shape[0]
    read = keys_read(k_start, k_len, t)
    count = int(read.sum())  # the host sync
    rows = torch.nonzero_static(read, size=max(count, 1), fill_value=0).squeeze(1)  # none read: row 0
    compact = read.cumsum(0) - 1  # [T] each read key's compact row
    gathered_row = gather_index[rows]  # all-gathered rows are rank-major: owner, then its row
    owner, local_row = gathered_row // (t // cp), gathered_row % (t // cp)
    return Reads(
        rows=rows,
        k_start=torch.where(k_len > 0, compact[k_start.long()], 0).to(torch.int32),
        owner=owner,
        local_row=local_row,
        counts=torch.bincount(owner, minlength=cp),
        idle=count == 0,
    )


@per_plan
def exchange_plan(
    gather_index: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    window: tuple[int, int],
    group_name: str,
    kv_exchange: str,
):
    """The :class:`Exchange` of this rank's pieces (``k_start``, ``k_len`` ``[P]``, physical keys
    under ``window``, ``(left, right)``) of the pack of ``cu_seqlens`` and ``cu_seqlens_padded``
    (``[B + 1]`` int32, an :class:`~cpcompile.plan.pieces.AttentionPlan`'s) laid out as ``gather_index``
    ``[T]`` says, or ``None`` where the all-gather is used; ``kv_exchange``: one of ``cost.comm.SETTINGS``
    (``StrategySpec.exchange``).

    No communication: the plan carries the whole pack, which every rank holds alike, so each rank
    derives every rank's reads itself (:func:`make_exchange`), and all reach the same answer to
    :func:`~cpcompile.cost.comm.use_exchange`. Made once per plan and window (``per_plan``) on the host, from the plan's
    host twins where it has them (:func:`cpcompile.plan.pieces.step_plan`), else from a copy (one
    host sync), and uploaded with twins. Ranks must agree on ``kv_exchange``: the spec's ``kv`` is one of what
    ranks compare where they check agreement (``checks.agreement_enabled``: always on gloo).

    Without the pack's offsets (``None``: an op called without them, as the hybrid's is) the
    all-gather is used for ``"auto"``, and ``"always"`` is an error.
    """
    if check_choice("kv_exchange", kv_exchange, SETTINGS) == "never":
        return None
    if cu_seqlens is None or cu_seqlens_padded is None:
        if kv_exchange == "always":
            raise ValueError(
                "kv='exchange' needs the pack's offsets (the plan's cu_seqlens and cu_seqlens_padded): "
                "every rank's reads follow from the pack"
            )
        return None
    group = resolve_group(group_name)
    cp, rank = group.size(), group.rank()
    device = k_len.device  # the plan's: the host copies below are on the CPU
    cu, padded, k_start, k_len = on_host(cu_seqlens, cu_seqlens_padded, k_start, k_len)
    layout, runs = _layout(gather_index, cp)
    pack = Pack(layout, cu, padded)
    ex = make_exchange(k_start, k_len, pack, read_ranges(pack, window, runs), rank, kv_exchange, runs)
    if ex is None:
        return None
    return ex._replace(
        **{f: upload(getattr(ex, f), device) for f in ("k_start", "gather", "send_rows", "recv_dst", "sums")}
    )


@per_plan
def _layout(gather_index: torch.Tensor, cp: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`cpcompile.plan.pieces.layout_of` on the host (from the host twin where there is one), and its
    runs (:func:`cpcompile.layouts.partition.layout_runs`), once per plan: the causal, full and windowed
    exchanges of a step share them."""
    (index,) = on_host(gather_index)
    layout = layout_of(index, cp)
    return layout, layout_runs(layout)


def make_exchange(
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    pack: Pack,
    reads: tuple[torch.Tensor, ...],
    rank: int,
    kv_exchange: str,
    runs: tuple[torch.Tensor, ...] | None = None,
) -> Exchange | None:
    """Rank ``rank``'s :class:`Exchange` (or ``None``: the all-gather) for its pieces ``k_start``,
    ``k_len`` ``[P]`` of ``pack``, from every rank's reads ``(reader, lo, hi)`` ``[M]``
    (:func:`cpcompile.layouts.reads.read_ranges`): the same count matrix on every rank
    (:func:`~cpcompile.layouts.reads.read_matrix`, from the layout's runs, ``runs`` where the caller has
    them), and the rows other ranks read from this one, as each would have requested them.

    Note [reads as runs]: rank ``reader[m]`` reads the physical keys ``[lo[m], hi[m])``
    (document prefixes, or under a window the union of its pieces' windows). Every layout
    stores a rank's positions in ascending order, so rank ``s`` holds of such a range a run of
    its rows, found by bisection; every list here (the compact keys by owner, the rows to send
    by reader) is such runs in order, made without anything of size ``T``.
    """
    layout = pack.layout  # [cp, T_local], each row ascending
    cp, t_local = layout.shape
    reader, lo, hi = with_idle(pack.cu_seqlens_padded, reads, cp)
    matrix = read_matrix(layout_runs(layout) if runs is None else runs, (reader, lo, hi), cp)
    if not use_exchange(matrix, t_local, kv_exchange):
        return None
    recv_counts = [0 if s == rank else matrix[rank][s] for s in range(cp)]
    send_counts = [0 if r == rank else matrix[r][rank] for r in range(cp)]
    # the compact keys, by owner in rank order, each owner's in physical order (its storage order)
    mine = reader == rank  # [M]
    lo_mine, hi_mine = lo[mine], hi[mine]
    offset = (hi_mine - lo_mine).cumsum(0) - (hi_mine - lo_mine)  # [M_mine] compact row of each run's first key
    first = torch.searchsorted(layout, lo_mine.expand(cp, -1).contiguous())  # [cp, M_mine] each owner's first row
    counts = (torch.searchsorted(layout, hi_mine.expand(cp, -1).contiguous()) - first).reshape(-1)  # owner-major
    held = _runs((first + torch.arange(cp)[:, None] * t_local).reshape(-1), counts)  # all-gathered rows
    compact = layout.reshape(-1)[held] + torch.repeat_interleave((offset - lo_mine).repeat(cp), counts)  # [R]
    before = sum(matrix[rank][:rank])
    own = slice(before, before + matrix[rank][rank])
    own_compact, own_rows = compact[own], held[own] - rank * t_local
    by_owner = torch.cat([compact[: own.start], compact[own.stop :]])  # others', by owner
    gather = torch.empty_like(compact)
    gather[own_compact] = own_rows
    gather[by_owner] = t_local + torch.arange(by_owner.shape[0])  # past the own rows
    # what each other rank requests, in rank order: its runs of this rank's rows
    own_first = torch.searchsorted(layout[rank], lo[~mine])  # [M - M_mine] its first row of each other read
    send_rows = _runs(own_first, torch.searchsorted(layout[rank], hi[~mine]) - own_first)
    run = (torch.searchsorted(lo_mine, k_start.long(), right=True) - 1).clamp(min=0)  # [P] the run holding each
    _check_runs(k_start, k_len, lo_mine[run], hi_mine[run], rank)
    return Exchange(
        k_start=torch.where(k_len > 0, offset[run] + k_start.long() - lo_mine[run], 0).to(torch.int32),
        gather=gather,
        send_rows=send_rows,
        recv_dst=by_owner,
        sums=_sum_layers(own_rows, own_compact, send_rows, send_counts, gather.shape[0], t_local),
        recv_counts=recv_counts,
        send_counts=send_counts,
    )


def _check_runs(k_start: torch.Tensor, k_len: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rank: int) -> None:
    """Raise ``ValueError`` unless each piece that reads keys (``k_start``, ``k_len`` ``[P]``) reads them
    inside the run ``[lo, hi)`` ``[P]`` of the rank's reads that the pack says holds it: pieces of
    another rank's, pack's or layout's plan than the offsets and ``gather_index`` beside them would
    exchange rows other ranks do not send."""
    start, live = k_start.long(), k_len > 0
    outside = live & ((start < lo) | (start + k_len.long() > hi))
    if bool(outside.any()):
        p = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"the plan's piece {p} reads keys [{int(start[p])}, {int(start[p] + k_len[p])}), which rank {rank} of the "
            "pack its gather_index, cu_seqlens and cu_seqlens_padded describe does not read: the pieces are of "
            "another rank's, pack's or layout's plan (make them with cpcompile.plan.make_plan)"
        )


def _runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[sum(lengths)]`` int64: ``starts[i], starts[i] + 1, ...``, ``lengths[i]`` of them, run after run."""
    total = int(lengths.sum())
    first = lengths.cumsum(0) - lengths  # each run's first index in the result
    return torch.repeat_interleave(starts - first, lengths, output_size=total) + torch.arange(total)


def _sum_layers(own_rows, own_compact, send_rows, send_counts: list[int], r: int, t_local: int) -> torch.Tensor:
    """:attr:`Exchange.sums` ``[L, T_local]`` int64. ``own_rows``, ``own_compact``: ``[n_own]``
    int64, the local rows the rank reads itself and their compact rows (layer 0);
    ``send_rows``: ``[n_send]`` int64, the local rows each sender's returned sums belong to,
    ``send_counts[s]`` of them per rank in rank order (a layer per sender). The returned
    rows follow the ``r`` compact ones; the spare row (no part) comes last."""
    senders = [n for n in send_counts if n]
    spare = r + sum(senders)
    index = torch.full((1 + len(senders), t_local), spare, dtype=torch.int64, device=send_rows.device)
    index[0, own_rows] = own_compact
    start = 0
    for layer, n in enumerate(senders, 1):  # each sender's rows are distinct: one per layer
        index[layer, send_rows[start : start + n]] = r + start + torch.arange(n, device=index.device)
        start += n
    return index

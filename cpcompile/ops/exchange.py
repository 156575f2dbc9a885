"""Sparse K/V exchange: each rank receives only the K/V rows its pieces read.

A rank's pieces read document prefixes, which under balanced and no_load_balance
lie mostly on the rank itself: on two ProLong packs of 128K tokens the busiest rank
reads from other ranks 0.17-0.21 of what an all-gather brings it at cp 2-8
(balanced; no_load_balance 0.02-0.16), and dual_chunk_swap all of it. So,
per plan, every rank tells every other which of its rows it reads (one all-gather
of counts, one all-to-all of row indices, a few host syncs), and each layer then:

- forward: one all-to-all each of K and V carries the rows that are read into a buffer
  behind a copy of the rank's own rows (made while they travel), and one gather takes
  the *compact* keys ``[R, Hkv, D]`` from it (the read rows in physical order, so that
  each piece's keys stay one range, at a new start ``k_start``); the kernel runs over them;
- backward: the same exchange; the kernel writes the compact dK/dV sums (float32;
  float64 for float64 inputs) into one buffer per tensor, other ranks' rows go back to
  their owners in one all-to-all each, received into the same buffer, and one
  ``sum_rows`` pass adds each local row's own sum and the returned ones, in sender
  order (deterministic), rounding once to the input dtype.

Nothing of size ``T`` is made: no gathered K/V, no reordering of them, no float32
``[T, Hkv, D]`` reduce-scatter buffer. The all-gather path (``gathered``) stays
for layouts where ranks read most keys: :func:`use_exchange` picks per plan, the
same way on every rank, from the count matrix they all hold. The exchange is one
collective each of K and V: ``CPCOMPILE_KV_CHUNKS`` pipelines the all-gather only.

Measured on 2 H200s at cp=2 (docs/communication.md, ProLong 128K tokens), all-gather ->
exchange, slowest rank ms: balanced heads 16/16 forward 6.17 -> 4.59 and forward+backward
27.62 -> 21.89, heads 32/8 9.00 -> 8.34 and 41.98 -> 39.27; no_load_balance 16/16
forward+backward 28.70 -> 22.21. At the same volume (dual_chunk_swap) the exchange is 1-4 %
faster; striped's 0.98 of it, 1-2 % slower. :data:`EXCHANGE_AT` keeps a margin for cp > 2,
where the all-to-all spans more GPUs (not measured).

A first version scattered (``index_copy_`` into the compact keys, ``index_add_`` into
zeroed float32 sums, then a cast): per tensor on the H200 at these sizes (16 KV heads),
0.58 ms in the forward and 1.17 in the backward's tail, against 0.31 and 0.26 for the
gather and ``sum_rows``; the step's forward+backward went 24.42 -> 21.89 ms.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .. import distributed as cpdist
from ..kernels.metadata.scratch import keys_read, sum_layers
from ..per_plan import per_plan

#: Exchange when the busiest rank's rows sent or received are at most this fraction of an
#: all-gather's ``(cp - 1) x T_local``; ``CPCOMPILE_KV_EXCHANGE`` overrides.
EXCHANGE_AT = 0.75
SETTINGS = ("auto", "always", "never")


class Exchange(NamedTuple):
    """One rank's exchange for one plan (``R`` keys read, ``cp`` ranks, ``L`` layers of sums).

    - ``k_start``: ``[P]`` int32, each piece's first key among the compact keys.
    - ``gather``: ``[R]`` int64, the compact keys' rows in the rank's own rows followed by
      the received ones.
    - ``send_rows``: ``[n_send]`` int64, the local rows others read, in receiver order.
    - ``recv_dst``: ``[n_recv]`` int64, the compact rows of the received keys, in sender order.
    - ``sums``: ``[L, T_local]`` int64, per layer the row of ``[compact sums; returned
      sums; spare]`` that holds a part of each local row's gradient: layer 0 its own
      compact row, then one layer per sender, in rank order (``spare``: no part).
    - ``recv_counts``, ``send_counts``: ``[cp]`` rows from and to each rank (0 for itself).
    - ``idle``: no piece reads a key (``R`` is then 1: kernels need keys).
    """

    k_start: torch.Tensor
    gather: torch.Tensor
    send_rows: torch.Tensor
    recv_dst: torch.Tensor
    sums: torch.Tensor
    recv_counts: list[int]
    send_counts: list[int]
    idle: bool


def exchange_setting() -> str:
    """``CPCOMPILE_KV_EXCHANGE`` as set (default ``auto``); :func:`exchange_plan` checks it,
    alike on every rank, so that a rank with a bad or different value leaves none waiting."""
    return os.environ.get("CPCOMPILE_KV_EXCHANGE", "auto")


def use_exchange(counts: list[list[int]], t_local: int, choice: str = "auto") -> bool:
    """Whether to exchange, from ``counts[r][s]`` (rows rank r reads from rank s): the
    same answer on every rank, since every rank holds the whole matrix."""
    if choice != "auto":
        return choice == "always"
    cp = len(counts)
    received = [sum(row) - row[r] for r, row in enumerate(counts)]
    sent = [sum(counts[r][s] for r in range(cp)) - counts[s][s] for s in range(cp)]
    return max(received + sent) <= EXCHANGE_AT * (cp - 1) * t_local


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


def reads(gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, cp: int) -> Reads:
    """:class:`Reads` of pieces ``k_start``, ``k_len`` ``[P]`` (physical keys) over the layout
    ``gather_index [T]`` of ``cp`` ranks; finding ``R`` is a host sync."""
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


@per_plan(collective=True)
def exchange_plan(gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, group_name: str, choice: str):
    """The :class:`Exchange` of this rank's pieces (``k_start``, ``k_len`` ``[P]``, physical
    keys) over the layout ``gather_index [T]``, or ``None`` where the all-gather is used;
    ``choice``: one of :data:`SETTINGS` (:func:`exchange_setting`).

    Collective: every rank of the group calls it with its own plan, once per plan
    (``per_plan``), and all get the same answer to :func:`use_exchange`, or the same
    error where their ``choice`` is not valid or not the same. Host syncs: finding
    ``R``, the counts, and the row indices of the requests.
    """
    group = cpdist.resolve_group(group_name)
    cp, rank = group.size(), group.rank()
    t_local = gather_index.shape[0] // cp
    mine = reads(gather_index, k_start, k_len, cp)
    code = SETTINGS.index(choice) if choice in SETTINGS else -1
    shared = cpdist.all_gather_rows(torch.cat([mine.counts, mine.counts.new_full((1,), code)]), group)
    table = shared.view(cp, cp + 1).tolist()  # row r: rank r's counts, then its choice
    matrix, codes = [row[:cp] for row in table], [row[cp] for row in table]  # matrix[r][s]: r reads from s
    if min(codes) < 0 or max(codes) != min(codes):
        seen = sorted({SETTINGS[c] if c >= 0 else "(not one of them)" for c in codes})
        raise ValueError(f"CPCOMPILE_KV_EXCHANGE must be one of {SETTINGS} and the same on every rank, got {seen}")
    if not use_exchange(matrix, t_local, choice):
        return None
    own = mine.owner == rank
    own_compact = torch.nonzero_static(own, size=matrix[rank][rank]).squeeze(1)  # its size known: no sync
    by_owner = torch.argsort(torch.where(own, -1, mine.owner), stable=True)[matrix[rank][rank] :]  # others', by owner
    recv_counts = [0 if s == rank else matrix[rank][s] for s in range(cp)]
    send_counts = [0 if r == rank else matrix[r][rank] for r in range(cp)]
    # the requests: this rank's row indices go out as it will receive the rows (recv_counts), and
    # come in as it will send them (send_counts)
    send_rows = cpdist.all_to_all_rows(mine.local_row[by_owner], send_counts, recv_counts, group)
    gather = mine.local_row.clone()
    gather[by_owner] = t_local + torch.arange(by_owner.shape[0], device=gather.device)  # past the own rows
    return Exchange(
        k_start=mine.k_start,
        gather=gather,
        send_rows=send_rows,
        recv_dst=by_owner,
        sums=_sum_layers(mine.local_row[own_compact], own_compact, send_rows, send_counts, gather.shape[0], t_local),
        recv_counts=recv_counts,
        send_counts=send_counts,
        idle=mine.idle,
    )


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


def _compact_kv(k, v, ex: Exchange, group):
    """k, v ``[T_local, Hkv, D]`` -> the compact keys and values ``[R, Hkv, D]`` this rank reads."""
    pending = []
    for x in (k, v):  # both in flight before either is waited for
        both = x.new_empty((x.shape[0] + sum(ex.recv_counts), *x.shape[1:]))  # own rows, then the received
        _, work = cpdist.all_to_all_rows(
            x.index_select(0, ex.send_rows),
            ex.recv_counts,
            ex.send_counts,
            group,
            async_op=True,
            out=both[x.shape[0] :],
        )
        both[: x.shape[0]].copy_(x)  # while the rows travel
        pending.append((both, work))
    compact = []
    for both, work in pending:
        work.wait()
        compact.append(both.index_select(0, ex.gather))
    return compact


def forward(kernel, q, k, v, ex: Exchange, cu_q, k_len, group, **kw):
    """q ``[T_local, Hq, D]``, local k, v ``[T_local, Hkv, D]`` -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``."""
    k_read, v_read = _compact_kv(k, v, ex, group)
    return kernel.forward(q, k_read, v_read, cu_q, ex.k_start, k_len, **kw)


def backward(kernel, dout, q, k, v, out, lse, ex: Exchange, cu_q, k_len, group, **kw):
    """Gradients of :func:`forward`: dq in the input dtype; dk, dv ``[T_local, Hkv, D]``, summed over ranks."""
    k_read, v_read = _compact_kv(k, v, ex, group)  # re-fetched, not saved by the forward
    # per tensor one buffer: the compact keys' sums (the kernel's), the sums other ranks return
    # (received in place), and the spare row; at least float32, rounded once at the end
    r, returned = ex.gather.shape[0], sum(ex.send_counts)  # R compact keys, rows returned to this rank
    acc = torch.promote_types(k.dtype, torch.float32)
    sums = [k.new_empty((r + returned + 1, *k.shape[1:]), dtype=acc) for _ in range(2)]
    if ex.idle:  # the kernel writes the rows of keys that are read: here none
        for s in sums:
            s[:r].zero_()
    pack_keys = k.shape[0] * group.size()  # what the kernel's scratch is budgeted against
    dq, _, _ = kernel.backward(
        *(dout, q, k_read, v_read, out, lse, cu_q, ex.k_start, k_len),
        dkv_out=(sums[0][:r], sums[1][:r]),
        pack_keys=pack_keys,
        **kw,
    )
    returns = [  # other ranks' rows go back to their owners, both in flight at once
        cpdist.all_to_all_rows(
            s[:r].index_select(0, ex.recv_dst), ex.send_counts, ex.recv_counts, group, async_op=True, out=s[r:-1]
        )
        for s in sums
    ]
    grads = []
    for s, x, (_, work) in zip(sums, (k, v), returns):
        work.wait()
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides
        grads.append(sum_layers(s, ex.sums, r + returned, total))  # own, then senders in rank order
    return dq, *grads

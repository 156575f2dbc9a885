"""Sparse K/V exchange, the transport: each rank receives only the K/V rows its pieces read.

- forward (:func:`fetch_keys`): one all-to-all each of K and V carries the rows that are read
  into a buffer behind a copy of the rank's own rows (made while they travel), and one gather
  takes the *compact* keys ``[R, Hkv, D]`` from it (the read rows in physical order, so that
  each piece's keys stay one range, at a new start ``k_start``);
- backward (:func:`return_grads`): other ranks' rows of dK/dV, summed by the kernel's caller,
  go back to their owners in one all-to-all each.

Nothing of size ``T`` is made, except where a compiled graph's nodes ask for buffers of that
capacity (``attention.split_exchange``: sizes there must not follow the pack). Which rows travel
is the plan's (:class:`cpcompile.plan.exchange.Exchange`, ``ex`` below);
:mod:`cpcompile.attention.exchange` runs the kernel between the moves.
"""

from __future__ import annotations

import torch

from cpcompile.comm.collectives import all_to_all_rows


def fetch_keys(k: torch.Tensor, v: torch.Tensor, ex, group) -> list[torch.Tensor]:
    """k, v ``[T_local, Hkv, D]`` -> the compact keys and values ``[R, Hkv, D]`` this rank reads."""
    pending = [start_fetch(x, ex, group) for x in (k, v)]  # both in flight before either is waited for
    compact = []
    for both, work in pending:
        work.wait()
        compact.append(compact_keys(both, ex))
    return compact


def start_fetch(x: torch.Tensor, ex, group, rows: int | None = None):
    """Start bringing the rows of other ranks' ``x`` that this rank reads: ``(both, work)``, ``both``
    ``[rows, Hkv, D]`` holding the rank's own ``T_local`` rows, then (after ``work.wait()``) the
    received ones; ``rows`` (default: just those) may be larger, a capacity whose rows past them
    are left unwritten (a compiled graph's buffer: ``attention.split_exchange``)."""
    received = sum(ex.recv_counts)
    both = x.new_empty((x.shape[0] + received if rows is None else rows, *x.shape[1:]))
    _, work = all_to_all_rows(
        x.index_select(0, ex.send_rows),  # a copy of its own, held by the work while it travels
        ex.recv_counts,
        ex.send_counts,
        group,
        async_op=True,
        out=both[x.shape[0] : x.shape[0] + received],
    )
    both[: x.shape[0]].copy_(x)  # while the rows travel
    return both, work


def compact_keys(both: torch.Tensor, ex) -> torch.Tensor:
    """The compact keys ``[R, Hkv, D]`` from :func:`start_fetch`'s ``both``, once its rows have arrived."""
    return both.index_select(0, ex.gather)


def return_grads(sent: list[torch.Tensor], ex, group) -> list:
    """Start sending other ranks' rows of dK/dV back to their owners.

    ``sent``: per tensor ``[n_recv, Hkv, D]``, the gradients of the keys this rank received, in
    :attr:`Exchange.recv_dst`'s order. Returns one ``(returned, work)`` per tensor: after
    ``work.wait()``, ``returned [n_send, Hkv, D]`` holds the rows other ranks return to this
    rank, by sender in rank order (:attr:`Exchange.sums` numbers them after the ``R`` compact rows).
    """
    return [start_return(s, ex, group) for s in sent]  # all in flight


def start_return(sent: torch.Tensor, ex, group, out: torch.Tensor | None = None):
    """One tensor of :func:`return_grads`: ``sent`` ``[n_recv, Hkv, D]`` -> ``(returned, work)``, into
    ``out`` ``[n_send, Hkv, D]`` (contiguous) if given."""
    return all_to_all_rows(sent, ex.send_counts, ex.recv_counts, group, async_op=True, out=out)

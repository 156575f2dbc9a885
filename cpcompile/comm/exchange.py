"""Sparse K/V exchange, the transport: each rank receives only the K/V rows its pieces read.

- forward (:func:`fetch_keys`): one all-to-all each of K and V carries the rows that are read
  into a buffer behind a copy of the rank's own rows (made while they travel), and one gather
  takes the *compact* keys ``[R, Hkv, D]`` from it (the read rows in physical order, so that
  each piece's keys stay one range, at a new start ``k_start``);
- backward (:func:`return_grads`): other ranks' rows of dK/dV, summed by the kernel's caller,
  go back to their owners in one all-to-all each.

Nothing of size ``T`` is made. Which rows travel is the plan's (:class:`cpcompile.plan.exchange.Exchange`,
``ex`` below); :mod:`cpcompile.attention.exchange` runs the kernel between the moves.
"""

from __future__ import annotations

import torch

from cpcompile.comm.collectives import all_to_all_rows


def fetch_keys(k: torch.Tensor, v: torch.Tensor, ex, group) -> list[torch.Tensor]:
    """k, v ``[T_local, Hkv, D]`` -> the compact keys and values ``[R, Hkv, D]`` this rank reads."""
    pending = []
    for x in (k, v):  # both in flight before either is waited for
        both = x.new_empty((x.shape[0] + sum(ex.recv_counts), *x.shape[1:]))  # own rows, then the received
        _, work = all_to_all_rows(
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


def return_grads(sent: list[torch.Tensor], ex, group) -> list:
    """Start sending other ranks' rows of dK/dV back to their owners.

    ``sent``: per tensor ``[n_recv, Hkv, D]``, the gradients of the keys this rank received, in
    :attr:`Exchange.recv_dst`'s order. Returns one ``(returned, work)`` per tensor: after
    ``work.wait()``, ``returned [n_send, Hkv, D]`` holds the rows other ranks return to this
    rank, by sender in rank order (:attr:`Exchange.sums` numbers them after the ``R`` compact rows).
    """
    return [all_to_all_rows(s, ex.send_counts, ex.recv_counts, group, async_op=True) for s in sent]  # all in flight

"""Sparse-exchange CP attention: the kernel over the compact keys ``comm.exchange`` brings.

Forward: fetch the K/V rows the rank's pieces read (``comm.exchange.fetch_keys``), run the
kernel over them. Backward: fetch them again (autograd saves nothing of size ``T``), the
kernel writes the compact dK/dV sums (float32; float64 for float64 inputs) into one buffer
per tensor, other ranks' rows go back to their owners (``comm.exchange.return_grads``),
and one ``sum_rows`` pass adds each local row's own sum and the returned ones, in sender
order (deterministic), rounding once to the input dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm.exchange import Exchange, fetch_keys, return_grads
from ..kernels import KeyGrads, Pieces
from ..kernels.metadata.scratch import sum_layers


def _compact(pieces: Pieces, ex: Exchange) -> Pieces:
    """``pieces`` over the compact keys that :func:`~cpcompile.comm.exchange.fetch_keys` brings: a
    piece's keys stay one range, moved, and a window's alignment (``q_pos``) moves with it."""
    q_pos = None if pieces.q_pos is None else pieces.q_pos - pieces.k_start + ex.k_start
    return dataclasses.replace(pieces, k_start=ex.k_start, q_pos=q_pos)


def forward(kernel, q, k, v, ex: Exchange, pieces: Pieces, group, **kw):
    """q ``[T_local, Hq, D]``, local k, v ``[T_local, Hkv, D]`` -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``;
    ``pieces`` over all the pack's keys, ``kw`` the kernel's keywords (``causal``, ``scale``)."""
    k_read, v_read = fetch_keys(k, v, ex, group)
    return kernel.forward(q, k_read, v_read, _compact(pieces, ex), **kw)


def backward(kernel, dout, q, k, v, out, lse, ex: Exchange, pieces: Pieces, group, **kw):
    """Gradients of :func:`forward`: dq in the input dtype; dk, dv ``[T_local, Hkv, D]``, summed over ranks."""
    k_read, v_read = fetch_keys(k, v, ex, group)  # re-fetched, not saved by the forward
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
        *(dout, q, k_read, v_read, out, lse, _compact(pieces, ex)),
        grads=KeyGrads(dk=sums[0][:r], dv=sums[1][:r]),
        pack_keys=pack_keys,
        **kw,
    )
    grads = []
    for s, x, (_, work) in zip(sums, (k, v), return_grads(sums, ex, group)):
        work.wait()
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides
        grads.append(sum_layers(s, ex.sums, r + returned, total))  # own, then senders in rank order
    return dq, *grads

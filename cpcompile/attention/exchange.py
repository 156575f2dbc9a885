"""Sparse-exchange CP attention: the kernel over the compact keys ``comm.exchange`` brings.

Forward: fetch the K/V rows the rank's pieces read (``comm.exchange.fetch_keys``), run the
kernel over them. Backward: fetch them again (autograd saves nothing of size ``T``); the
kernel gives the compact keys' dK/dV as parts not yet added (``KeyGrads(partial=True)``:
FA4's layers of pieces, the copies' rows); one ``sum_rows`` pass sums other ranks' rows
(float32; float64 for float64 inputs) into what goes back to their owners
(``comm.exchange.return_grads``), and one more adds each local row's own parts and the
returned sums, in sender order (deterministic), rounding once to the input dtype. Most of the
keys a rank reads under balanced are its own: their parts are read once, rather than written
as float32 sums of every compact key, read back and copied to a send buffer
(docs/attention-kernels.md, "The backward's dK/dV buffers", has the measured shares).
"""

from __future__ import annotations

import dataclasses

import torch

from cpcompile.cache import per_plan
from cpcompile.comm.exchange import fetch_keys, return_grads
from cpcompile.kernels import KeyGrads, Pieces
from cpcompile.kernels.contract import KeyPartials
from cpcompile.kernels.metadata.scratch import columns, sum_partials
from cpcompile.plan.exchange import Exchange


def _compact(pieces: Pieces, ex: Exchange) -> Pieces:
    """``pieces`` over the compact keys that :func:`~cpcompile.comm.exchange.fetch_keys` brings: a
    piece's keys stay one range, moved, and a window's alignment (``q_pos``) moves with it."""
    q_pos = None if pieces.q_pos is None else pieces.q_pos - pieces.k_start + ex.k_start
    return dataclasses.replace(pieces, k_start=ex.k_start, q_pos=q_pos)


def forward(kernel, q, k, v, ex: Exchange, pieces: Pieces, group, **kw):
    """q ``[T_local, Hq, D]``, local k, v ``[T_local, Hkv, D]`` -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``;
    ``pieces`` over all the pack's keys, ``kw`` the kernel's keywords (``causal``, ``scale``)."""
    return forward_on_fetched(kernel, q, *fetch_keys(k, v, ex, group), ex, pieces, **kw)


def forward_on_fetched(kernel, q, k_read, v_read, ex: Exchange, pieces: Pieces, **kw):
    """:func:`forward` once the compact keys and values ``[R, Hkv, D]`` have arrived."""
    return kernel.forward(q, k_read, v_read, _compact(pieces, ex), **kw)


def backward(kernel, dout, q, k, v, out, lse, ex: Exchange, pieces: Pieces, group, **kw):
    """Gradients of :func:`forward`: dq in the input dtype; dk, dv ``[T_local, Hkv, D]``, summed over ranks."""
    k_read, v_read = fetch_keys(k, v, ex, group)  # re-fetched, not saved by the forward
    pack_keys = k.shape[0] * group.size()  # what the kernel's scratch is budgeted against
    dq, parts = backward_on_fetched(kernel, dout, q, k_read, v_read, out, lse, ex, pieces, pack_keys, **kw)
    sent = sums_to_send(parts, ex.recv_dst, (k, v))
    grads = []
    for p, x, (returned, work) in zip(parts, (k, v), return_grads(sent, ex, group)):
        own, _ = _local(p, ex)
        work.wait()
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides
        # each local row: its own parts (the kernel's layers, in order), then the senders' sums in rank order
        grads.append(sum_partials(own, total, more=returned_parts(returned, ex)))
    return dq, *grads


def backward_on_fetched(kernel, dout, q, k_read, v_read, out, lse, ex: Exchange, pieces: Pieces, pack_keys, **kw):
    """The kernel's part of :func:`backward`: dq, and the compact keys' dK and dV as parts not yet added
    (:class:`~cpcompile.kernels.contract.KeyPartials`, ``[R]`` keys each); ``pack_keys``: the pack's key count."""
    dq, *parts = kernel.backward(
        *(dout, q, k_read, v_read, out, lse, _compact(pieces, ex)),
        grads=KeyGrads(partial=True),
        pack_keys=pack_keys,
        **kw,
    )
    return dq, parts


def own_sums(parts: KeyPartials, ex: Exchange, out: torch.Tensor) -> torch.Tensor:
    """Into ``out`` ``[T_local, Hkv, D]`` (at least float32): each local row's own parts summed (0 where
    the rank reads no own key), for :func:`add_returned` once the senders' sums are back: a compiled
    graph's exchange (``attention.split_exchange``), whose own parts cannot wait for them as values of
    a node (their row count follows the pack)."""
    own, _ = _local(parts, ex)
    return sum_partials(own, out)


def add_returned(own: torch.Tensor, returned: torch.Tensor, ex: Exchange, out: torch.Tensor) -> torch.Tensor:
    """Into ``out`` ``[T_local, Hkv, D]``: :func:`own_sums`' ``own`` then the senders' ``returned``
    ``[n_send, Hkv, D]`` sums, in sender order, rounded once to ``out``'s dtype (as :func:`backward`
    adds them, its own parts summed first)."""
    layer = KeyPartials(own, _identity(ex.sums), own.shape[0])
    return sum_partials(layer, out, more=returned_parts(returned, ex))


def returned_parts(returned: torch.Tensor, ex: Exchange) -> KeyPartials:
    """The senders' sums ``returned`` ``[n_send, Hkv, D]`` as parts of the local rows, a layer per sender."""
    _, senders = _local_rows(ex.sums, ex.gather.shape[0])
    return KeyPartials(returned, senders, returned.shape[0])


@per_plan
def _identity(sums: torch.Tensor) -> torch.Tensor:
    """``[1, T_local]`` int64: each local row's own row (:attr:`Exchange.sums` gives ``T_local``)."""
    return torch.arange(sums.shape[1], device=sums.device)[None]


def sums_to_send(
    parts: list[KeyPartials], keys: torch.Tensor, like: tuple[torch.Tensor, ...], rows: int | None = None
) -> list[torch.Tensor]:
    """Per tensor's parts, ``[n, Hkv, D]`` in at least float32 (the shape and dtype promoted of its tensor
    in ``like``, ``(k, v)``): the
    sums of the compact keys ``keys`` ``[n]`` (other ranks' keys, in the order they go back), straight
    into what is sent. The parts of keys no piece read (an idle rank's one key) are none: those rows are 0.
    ``rows``: the sums go into the first ``n`` of that many rows (a compiled graph's capacity), the
    others left unwritten."""
    acc = torch.promote_types(like[0].dtype, torch.float32)
    n = keys.shape[0]
    bufs = [_like(x, n if rows is None else rows, acc) for x in like]
    for p, buf in zip(parts, bufs, strict=True):
        sum_partials(_columns(p, keys), buf[:n])
    return bufs


def _columns(parts: KeyPartials, keys: torch.Tensor) -> KeyPartials:
    """``parts`` of the compact keys ``keys`` ``[n]`` alone, in that order."""
    return KeyPartials(parts.rows, columns(parts.index, keys), parts.spare)


def _like(x: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((rows, *x.shape[1:]), dtype=dtype, device=x.device)


def _local(parts: KeyPartials, ex: Exchange) -> tuple[KeyPartials, torch.Tensor]:
    """The rank's own rows' parts among ``parts`` (``[L, T_local]``, the compact row's layers; none
    for rows no piece of the rank reads), and ``[senders, T_local]``, each sender's returned row."""
    own = _own_rows(parts.index, parts.spare, ex.sums, ex.gather.shape[0])
    _, senders = _local_rows(ex.sums, ex.gather.shape[0])
    return KeyPartials(parts.rows, own, parts.spare), senders


@per_plan
def _own_rows(index: torch.Tensor, spare: int, sums: torch.Tensor, r: int) -> torch.Tensor:
    """:func:`_local`'s own indices from :attr:`Exchange.sums` (``[1 + senders, T_local]``: the compact
    row first, then the returned rows after the ``r`` compact ones); once per plan."""
    compact, _ = _local_rows(sums, r)  # a compact row, or past them (r + returned) where the rank reads no own key
    return torch.where(compact < r, index[:, compact.clamp(max=r - 1)], spare)  # clamped: a valid column to gather


@per_plan
def _local_rows(sums: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:attr:`Exchange.sums` (``[1 + senders, T_local]``) split: ``[T_local]`` each local row's compact row
    (``r`` or past where none), and ``[senders, T_local]`` its row among the returned ones; once per plan."""
    return sums[0], sums[1:] - r

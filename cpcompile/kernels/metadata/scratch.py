"""Per-piece key rows for GPU backwards whose kernels cannot add overlapping pieces' dK/dV.

Pieces of one rank may read overlapping key ranges (a document's head and tail
chunks both read its first keys). Kernels that write dK/dV rather than add to
them get one scratch row per (piece, key) instead, and the sums go back to the keys.

Every plan's key ranges, sorted by start (then end), have non-decreasing ends too:
document prefixes (``[doc start, ...)``) share their start, and under a ``(left, 0)``
window a later piece of a document starts and ends later. The ranges that overlap
a range from before it in that order are then the run just before it, so numbering
the pieces in that order modulo the longest run gives *layers* whose ranges are
disjoint (:func:`layers`), and each key's sum takes at most one row per layer, in
float32, in layer order. On CUDA,
``triton.sum_rows`` adds them in one kernel that reads only the rows there are,
several times faster than gathering every key once per layer or ``index_add_``
layer by layer (docs/attention-kernels.md). Off CUDA or without Triton, torch gathers.

A kernel whose backward takes each entry's used rows (``seqused_q``, ``seqused_k``: FA4's)
needs no copies at all: one call per layer, each over the keys in place with that layer's
live pieces as its entries (:func:`layer_calls`), writes each layer's dK/dV to a buffer
of its own, and those are added back the same way (one row per layer and key).

The scratch holds ``sum(k_len)`` rows; that size and the layer count are read on
the plan's host twins (``per_plan.twinned``; a host sync where it has none), once
per plan (``per_plan``: every layer reuses the scratch, and ``auto`` its size for
its choice). The same sync reads which pieces see keys and
the longest one's rows: exact launch bounds for the backward kernels, whose grids
are sized by them (a bound of the longest document, where balanced's longest piece
is shorter, made cuDNN's backward markedly slower: docs/attention-kernels.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from cpcompile.cache import per_plan, twinned
from cpcompile.kernels.contract import KeyPartials
from cpcompile.kernels.triton import sum_rows
from cpcompile.layouts.reads import keys_read

if TYPE_CHECKING:
    from cpcompile.kernels.contract import KeyGrads


class Scratch(NamedTuple):
    """Scratch rows of ``P`` pieces over ``Tk`` keys, in ``L`` layers, and the live pieces.

    - ``cu``: ``[P + 1]`` int32, first scratch row of each piece (last: ``rows``); a piece
      without query rows has none (it adds no gradient), so each row is a live piece's.
    - ``src``: ``[rows + 1]`` int64, the key row behind each scratch row, then 0 for
      the spare row (``rows``).
    - ``index``: ``[L, Tk]`` int64, per layer, the scratch row holding each key's
      partial gradient (``rows``, the spare row, where no piece of the layer reads the key).
    - ``live``: ``[n]`` int64, in order, the pieces with query rows and keys.
    - ``read``: ``[Tk]`` bool, the keys some piece reads; ``num_read`` of them.
    - ``max_q``, ``max_k``: the live pieces' longest query rows and key range.
    - ``piece_rows``: the query rows of the live piece a query row lies in, averaged over the
      rows (``sum(q_len^2) / sum(q_len)``): how long the pieces holding the work are.
    - ``ordered``: the live pieces' key starts never fall in piece order (every plan's), so each
      layer's ranges increase with the pieces, as a kernel reading them in place needs.
    - ``live_read``: the keys that live pieces read (``num_read`` less those read only by
      pieces without query rows).
    - ``layer_live``: ``L`` ints, the live pieces in each layer: the entries of its in-place call
      (:func:`layer_calls`).
    """

    cu: torch.Tensor
    src: torch.Tensor
    index: torch.Tensor
    live: torch.Tensor
    read: torch.Tensor
    num_read: int
    max_q: int
    max_k: int
    piece_rows: int
    ordered: bool
    live_read: int
    layer_live: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.src.shape[0] - 1

    @property
    def num_layers(self) -> int:
        return self.index.shape[0]


def layers(k_start: torch.Tensor, k_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([P] int64, 0-dim bool)``: each piece's layer (0 for pieces that read no key), such that
    pieces of one layer read disjoint key ranges, and whether that holds: the ranges, sorted by
    start and end, have non-decreasing ends (every plan's do; checked in the caller's host sync).

    In that order, the ranges before range ``i`` that overlap it are those ending after its
    start, the run ``[f(i), i)``; numbered ``i mod L``, ``L`` the longest run plus one, two
    overlapping ranges are fewer than ``L`` apart and get different layers. ``L`` is the most
    ranges over one key: as many layers as any numbering needs.
    """
    reads = k_len > 0
    never = torch.iinfo(torch.int64).max  # pieces that read nothing sort last and overlap nothing
    start, end = k_start.long(), k_start.long() + k_len.long()
    order = torch.sort(torch.where(reads, start * 2**32 + end, never), stable=True).indices  # keys < 2**31
    start, end = (torch.where(reads, t, never)[order] for t in (start, end))
    position = torch.arange(order.shape[0], device=order.device)
    first = torch.searchsorted(end, start, right=True)  # the first range ending after each start
    run = torch.cat([(position - first + 1).masked_fill(~reads[order], 1), position.new_ones(1)])
    number = torch.where(reads[order], position % run.max(), 0)
    proper = (end[1:] >= end[:-1]).all()
    return torch.empty_like(number).scatter_(0, order, number), proper


@per_plan
@twinned
def scratch_rows(cu_q: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, num_keys: int) -> Scratch:
    """:class:`Scratch` of pieces ``cu_q [P + 1]`` reading keys ``[k_start, k_start + k_len)`` of ``num_keys``.

    Made on the plan's host twins and uploaded (``twinned``), or where it has none,
    with one host sync; once per plan (``per_plan`` keeps it while the pieces live).
    Key ranges sorted by start must have non-decreasing ends, as every plan's do (:func:`layers`).
    """
    device = k_start.device
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    read = keys_read(k_start, k_len, num_keys)  # every piece's: their sums are written, 0 where no row adds
    # a piece without query rows adds no gradient: it gets no rows, so every row is a live piece's
    k_len = torch.where(q_len > 0, k_len.long(), 0)
    cu = torch.cat([k_len.new_zeros(1), k_len.cumsum(0)]).to(torch.int32)  # [P + 1]
    layer, proper = layers(k_start, k_len)
    is_live = k_len > 0
    live_q = q_len * is_live
    none = k_len.new_zeros(1)  # the maxima of no pieces
    sizes = [is_live.sum(), torch.cat([none, live_q]).max(), torch.cat([none, k_len]).max(), k_len.sum()]
    sizes += [torch.cat([none, layer]).max() + 1, read.sum()]
    sizes += [(live_q * live_q).sum() // live_q.sum().clamp(min=1), proper.long()]
    live_start = torch.where(is_live, k_start.long(), -1)
    risen = torch.cat([live_start.new_full((1,), -1), live_start.cummax(0).values[:-1]])  # the starts before
    sizes += [(~is_live | (live_start >= risen)).all().long(), keys_read(k_start, k_len, num_keys).sum()]
    pieces = k_len.shape[0]  # at most as many layers; the live ones per layer, after the sizes
    slot = torch.where(is_live, layer, pieces)  # bincount would sync on CUDA to size its output
    per_layer = torch.zeros(pieces + 1, dtype=torch.int64, device=device).scatter_add_(0, slot, torch.ones_like(slot))
    sizes = torch.cat([torch.stack(sizes), per_layer]).tolist()  # the sync
    num_live, max_q, max_k, rows, num_layers, num_read, piece_rows, proper, ordered, live_read = sizes[:10]
    layer_live = tuple(sizes[10 : 10 + num_layers])
    if not proper:
        raise ValueError(
            "pieces' key ranges, sorted by start, must have non-decreasing ends (document prefixes, or "
            "(left, 0) windows of them, as every plan's): the GPU backward's scratch cannot sum others"
        )
    live = torch.sort((~is_live).to(torch.uint8), stable=True).indices[:num_live]
    piece = torch.repeat_interleave(torch.arange(k_len.shape[0], device=device), k_len, output_size=rows)
    row = torch.arange(rows, device=device)
    src = k_start.long()[piece] + row - cu[:-1].long()[piece]
    index = torch.full((num_layers, num_keys), rows, dtype=torch.int64, device=device)
    index[layer[piece], src] = row  # one writer per (layer, key)
    return Scratch(
        cu, torch.cat([src, src.new_zeros(1)]), index, live, read, num_read, max_q, max_k, piece_rows, bool(ordered),
        live_read, layer_live,
    )  # fmt: skip


class LayerCalls(NamedTuple):
    """One backward call per layer (:func:`layers`) of ``P`` pieces over ``Tk`` keys in place, ``L``
    layers, ``E_l`` entries in layer ``l``'s call (:meth:`call` gives them).

    - ``cu_q``, ``cu_k``: ``[sum(E_l + 1)]`` int32, per layer each entry's first query row and
      first key, then the query rows' and keys' ends; within a layer, both non-decreasing, and
      each entry's ``[cu_k, cu_k + used_k)`` ends before the next begins.
    - ``used_q``, ``used_k``: ``[sum(E_l)]`` int32, per layer each entry's query rows and keys.
    - ``index``: ``[L, Tk]`` int64, per layer, the row of the layers' stacked gradients
      (``[L Tk + 1]``, layer ``l``'s rows ``[l Tk, (l + 1) Tk)``) holding each key's
      partial gradient, ``L Tk`` (the spare row) where no piece of the layer reads the key.
    - ``entries``: the ``E_l``.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_q: torch.Tensor
    used_k: torch.Tensor
    index: torch.Tensor
    entries: tuple[int, ...]

    def call(self, layer: int) -> dict:
        """Layer ``layer``'s call: ``cu_q``, ``cu_k`` ``[E + 1]``, ``seqused_q``, ``seqused_k`` ``[E]``."""
        first = sum(self.entries[:layer])
        n = self.entries[layer]
        cu = slice(first + layer, first + layer + n + 1)
        used = slice(first, first + n)
        entries = {"cu_q": self.cu_q[cu], "cu_k": self.cu_k[cu]}
        return entries | {"seqused_q": self.used_q[used], "seqused_k": self.used_k[used]}


@per_plan
@twinned
def layer_calls(
    cu_q: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, num_keys: int, num_layers: int, live=None
) -> LayerCalls:
    """:class:`LayerCalls` of pieces ``cu_q [P + 1]`` reading keys ``[k_start, k_start + k_len)`` of
    ``num_keys`` in ``num_layers`` layers (``Scratch.num_layers``), whose live pieces' starts never
    fall (``Scratch.ordered``); once per plan, on the host twins where the plan has them. No sync.

    ``live``: the live pieces per layer (``Scratch.layer_live``): each layer's call takes its own
    live pieces alone, its grid no larger than their work. Without them (a captured backward:
    nothing is read on the host) every piece is an entry of every call, the other layers' with
    no rows and keys set where the layer's ranges before them end.
    """
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    k_len = torch.where(q_len > 0, k_len.long(), 0)
    layer, _ = layers(k_start, k_len)
    start, end = k_start.long(), k_start.long() + k_len
    mine = (layer == torch.arange(num_layers, device=layer.device)[:, None]) & (k_len > 0)  # [L, P]
    # each layer's ranges increase with the pieces: where they have ended so far, for the others
    ended = torch.where(mine, end, 0).cummax(1).values
    before = torch.cat([ended.new_zeros(num_layers, 1), ended[:, :-1]], 1)
    first_k, used_q, used_k = torch.where(mine, start, before), torch.where(mine, q_len, 0), torch.where(mine, k_len, 0)
    pieces = q_len.shape[0]
    entries = (pieces,) * num_layers if live is None else tuple(live)
    chosen = (
        torch.arange(num_layers * pieces, device=layer.device)
        if live is None
        else torch.nonzero_static(mine.flatten(), size=sum(entries)).flatten()  # layer by layer, in piece order
    )
    cu_q_of, cu_k_of = [], []
    for part in torch.split(chosen, entries):
        cu_q_of += [cu_q[part % pieces].long(), cu_q[-1:].long()]
        cu_k_of += [first_k.flatten()[part], first_k.new_full((1,), num_keys)]
    reads = torch.stack([keys_read(k_start, n, num_keys) for n in used_k])  # [L, Tk]
    key = torch.arange(num_keys, device=layer.device)
    rows = torch.arange(num_layers, device=layer.device)[:, None] * num_keys + key
    index = torch.where(reads, rows, num_layers * num_keys)
    used = [t.flatten()[chosen].int() for t in (used_q, used_k)]
    return LayerCalls(torch.cat(cu_q_of).int(), torch.cat(cu_k_of).int(), *used, index, entries)


def add_back(
    partial: torch.Tensor,
    scratch: Scratch,
    key_order: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``partial [rows + 1, H, D]`` per-scratch-row gradients -> ``[Tk, H, D]`` float32 sums.

    ``index``: the rows of ``partial`` per layer and key to sum instead of the scratch's
    (``LayerCalls.index``); either way the last row of ``partial`` is the spare one.

    Row ``i`` sums key ``key_order[i]`` (``[Tk]`` int64, default: key ``i``), written
    there directly: the index is reordered once per plan, not the sums. With ``out``
    (``[Tk, H, D]`` float32, 0 at the rows of keys no piece reads) only the rows of
    the keys that pieces read are written, into ``out``: a rank's pieces may read a
    small part of the pack's keys (balanced: docs/attention-kernels.md, "The backward's
    dK/dV buffers"), and the other rows need not be written again in every layer.
    Left in float32: callers add the sums over ranks before the one rounding.
    Deterministic: each key's rows are added in layer order.
    """
    index = scratch.index if index is None else index
    index = index if key_order is None else columns(index, key_order)
    rows = None if out is None else _rows(scratch.read, key_order, scratch.num_read)
    return sum_layers(partial, index, partial.shape[0] - 1, out, rows)


def add_back_grads(
    dk: torch.Tensor, dv: torch.Tensor, scratch: Scratch, grads: KeyGrads | None = None, index=None
) -> tuple:
    """:func:`add_back` of per-scratch-row (or with ``index``, per-layer) dK and dV, in the order and
    buffers ``grads`` asks for; where it asks for the parts (``partial``), the rows as they are
    (:class:`~cpcompile.kernels.contract.KeyPartials`, their last row the spare one)."""
    if grads is not None and grads.partial:
        index = scratch.index if index is None else index
        return tuple(KeyPartials(t, index, t.shape[0] - 1) for t in (dk, dv))
    order, dk_out, dv_out = _destination(grads)
    return add_back(dk, scratch, order, dk_out, index), add_back(dv, scratch, order, dv_out, index)


def sum_layers(partial: torch.Tensor, index: torch.Tensor, spare: int, out=None, rows=None, more=None) -> torch.Tensor:
    """``out[k] = sum over l of partial[index[l, k]]``: ``partial [n, H, D]``, ``index [L, Tk]``
    int64 (``spare``: none; a row of ``partial`` or past its last), summed in at least float32.

    ``out``: ``[Tk, H, D]`` to write, in its dtype (default: a new float32 one); ``rows``:
    ``[m]`` int64, the only rows of ``out`` computed (its others are kept); ``more``: a second
    source (:class:`~cpcompile.kernels.contract.KeyPartials`, its own dtype, ``[L', Tk]``), its
    layers added after the first's. On CUDA one ``sum_rows`` kernel (float32 sums); elsewhere,
    and for float64, torch gathers, leaving out the spare rows, and sums over the layers with
    ``torch.sum`` (deterministic).
    """
    sources = [(partial, index, spare)] + ([] if more is None else [(more.rows, more.index, more.spare)])
    if sum_rows.available(partial) and all(source[0].dtype != torch.float64 for source in sources):
        return sum_rows.sum_rows(partial, index, spare, out, rows, *sources[1:])
    acc = functools.reduce(torch.promote_types, (source[0].dtype for source in sources), torch.float32)
    parts = [_gathered(p, i if rows is None else i[:, rows], n, acc) for p, i, n in sources]
    total = torch.sum(torch.cat(parts), dim=0, dtype=acc)
    if out is None:
        return total
    if rows is None:
        out.copy_(total)
    else:
        out[rows] = total.to(out.dtype)
    return out


def _gathered(partial: torch.Tensor, index: torch.Tensor, spare: int, dtype: torch.dtype) -> torch.Tensor:
    """``[L, Tk, H, D]`` in ``dtype``: ``partial[index]``, 0 where ``index`` is ``spare`` (whatever that row holds)."""
    none = index == spare
    gathered = partial[index.masked_fill(none, 0)].to(dtype)
    return gathered.masked_fill_(none.view(*none.shape, *(1,) * (partial.dim() - 1)), 0)


def sum_partials(parts: KeyPartials, out=None, rows=None, more: KeyPartials | None = None) -> torch.Tensor:
    """:func:`sum_layers` of :class:`~cpcompile.kernels.contract.KeyPartials` (and ``more``'s after them)."""
    return sum_layers(parts.rows, parts.index, parts.spare, out, rows, more)


def place(grad: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, key_order=None, out=None) -> torch.Tensor:
    """A whole ``[Tk, H, D]`` dK or dV of pieces that read disjoint keys, as :func:`add_back`
    gives its sums: rows in ``key_order``, and with ``out``, written there at the rows of the
    keys that the pieces (``k_start``, ``k_len`` ``[P]``) read, the others kept. Without
    ``out`` it stays in ``grad``'s dtype: each key's gradient is one piece's, with nothing to
    add (a float32 copy would be two more passes over dK/dV: docs/attention-kernels.md,
    "FlashAttention-4")."""
    if out is None:
        return grad if key_order is None else grad[key_order]
    rows, src = _placement(k_start, k_len, grad.shape[0], key_order)
    out[rows] = grad[src].to(out.dtype)
    return out


def place_grads(
    dk: torch.Tensor, dv: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, grads: KeyGrads | None = None
) -> tuple:
    """:func:`place` of whole dK and dV, in the order and buffers ``grads`` asks for; where it
    asks for the parts (``partial``), the gradients as they are, one layer whose rows are the
    keys', the spare (past the last row) where no piece reads a key."""
    if grads is not None and grads.partial:
        index = _read_index(k_start, k_len, dk.shape[0])
        return tuple(KeyPartials(t, index, t.shape[0]) for t in (dk, dv))
    order, dk_out, dv_out = _destination(grads)
    return place(dk, k_start, k_len, order, dk_out), place(dv, k_start, k_len, order, dv_out)


@per_plan
def _read_index(k_start: torch.Tensor, k_len: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[1, Tk]`` int64: each key's own row where a piece reads it, else ``Tk``; once per plan."""
    key = torch.arange(num_keys, device=k_start.device)
    return torch.where(keys_read(k_start, k_len, num_keys), key, num_keys)[None]


def _destination(grads: KeyGrads | None) -> tuple:
    """``(key_order, dk, dv)`` of ``grads``, each ``None`` where not given."""
    return (None, None, None) if grads is None else (grads.key_order, grads.dk, grads.dv)


@per_plan
def _placement(k_start: torch.Tensor, k_len: torch.Tensor, num_keys: int, key_order=None):
    """:func:`place`'s rows of ``out`` (``[n]`` int64, :func:`_rows`) and the rows of the
    gradient they take; once per plan (finding them is a host sync)."""
    rows = _rows(keys_read(k_start, k_len, num_keys), key_order)
    return rows, rows if key_order is None else key_order[rows]


@per_plan
def columns(index: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``index [L, Tk]``'s columns ``keys`` (``[n]`` int64), in that order; once per plan."""
    return index[:, keys]


@per_plan
def _rows(read: torch.Tensor, key_order=None, count: int | None = None) -> torch.Tensor:
    """``[n]`` int64, in order, the rows of dK/dV (in ``key_order``) whose keys are ``read``;
    once per plan. Without their ``count``, finding them is a host sync."""
    read = read if key_order is None else read[key_order]
    return read.nonzero().flatten() if count is None else torch.nonzero_static(read, size=count).flatten()

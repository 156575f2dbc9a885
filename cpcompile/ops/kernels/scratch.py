"""Per-piece key rows for GPU backwards whose kernels cannot add overlapping pieces' dK/dV.

Pieces of one rank may read overlapping key ranges (a document's head and tail
chunks both read its first keys). Kernels that write dK/dV rather than add to
them get one scratch row per (piece, key) instead, and the sums go back to the keys.

Every plan's key ranges are prefixes of documents (``[doc start, ...)``), so two
ranges either start at the same key or are disjoint. Numbering the pieces that
share a start 0, 1, 2, ... gives *layers* whose ranges are disjoint, and each
key's sum takes at most one row per layer, in float32. Two ways to add, measured
per rank on the H200 (128K tokens, 8 KV heads, cp=8):

- gathers: one gather of every key per layer, then one sum; ``0.3 + 0.2 L`` ms
  for ``L`` layers (dual_chunk_swap, 2 layers: 0.73 ms; ``index_add_`` over all
  rows took 3.0).
- scatters: only the scratch rows, layer by layer into zeroed sums; ``0.1 + 1.35 r``
  ms for ``r`` scratch rows per key (balanced, r = 0.48 in 6 layers: 0.70 against
  the gathers' 0.97; dual_chunk_swap, r = 1.06: 1.45).

So the scatters serve where ``7 r < L + 1`` (``SCATTER_BELOW``): few scratch rows
over many keys, as a rank's pieces over all the gathered keys, the more so in
many layers (row chunks, ``chunks``).

The scratch holds ``sum(k_len)`` rows; reading that size and the layer count is
a host sync, made once per plan (``per_plan``: every layer reuses the scratch, and
``auto`` its size for its choice). The same sync reads which pieces see keys and
the longest one's rows: exact launch bounds for the backward kernels, whose grids
are sized by them (balanced's bound, the longest document, made cuDNN's backward
1.5x slower on the H200 than its longest piece did).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .per_plan import per_plan


class Scratch(NamedTuple):
    """Scratch rows of ``P`` pieces over ``Tk`` keys, in ``L`` layers, and the live pieces.

    - ``cu``: ``[P + 1]`` int32, first scratch row of each piece (last: ``rows``).
    - ``src``: ``[rows + 1]`` int64, the key row behind each scratch row, then 0 for
      the spare row (``rows``) that :func:`add_back` zeroes: the gathers' empty source.
    - ``index``: for the gathers, ``[L, Tk]`` int64, per layer, the scratch row holding
      each key's partial gradient (``rows`` where no piece of the layer reads the key);
      ``None`` where the scatters serve.
    - ``layer_rows``: for the scatters, per layer, its scratch rows ``[n_l]`` and their
      keys ``[n_l]`` (int64); empty where the gathers serve.
    - ``live``: ``[n]`` int64, in order, the pieces with query rows and keys.
    - ``max_q``, ``max_k``: the live pieces' longest query rows and key range.
    - ``num_keys``: ``Tk``.
    """

    cu: torch.Tensor
    src: torch.Tensor
    index: torch.Tensor | None
    layer_rows: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    live: torch.Tensor
    max_q: int
    max_k: int
    num_keys: int

    @property
    def rows(self) -> int:
        return self.src.shape[0] - 1


#: The scatters add back while ``SCATTER_BELOW * rows < (layers + 1) * keys`` (module docstring).
SCATTER_BELOW = 7


def layers(k_start: torch.Tensor, k_len: torch.Tensor) -> torch.Tensor:
    """``[P]`` int64: each piece's number among the pieces whose keys start where its do
    (0 for pieces that read none). Pieces of one layer read disjoint key ranges."""
    reads = k_len > 0
    key = torch.where(reads, k_start.long(), -1)
    sorted_key, order = torch.sort(key, stable=True)
    position = torch.arange(key.shape[0], device=key.device)
    number = position - torch.searchsorted(sorted_key, sorted_key)  # offset from the group's first
    return torch.empty_like(number).scatter_(0, order, number).masked_fill_(~reads, 0)


@per_plan
def scratch_rows(cu_q: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, num_keys: int) -> Scratch:
    """:class:`Scratch` of pieces ``cu_q [P + 1]`` reading keys ``[k_start, k_start + k_len)`` of ``num_keys``.

    One host sync, per plan (``per_plan`` keeps the result while the pieces live).
    Key ranges must be disjoint or start at the same key, as every plan's are.
    """
    device = k_start.device
    cu = torch.cat([k_len.new_zeros(1), k_len.cumsum(0, dtype=torch.int32)])  # [P + 1]
    layer = layers(k_start, k_len)
    k_len = k_len.long()
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    is_live = (q_len > 0) & (k_len > 0)
    per_layer = torch.zeros_like(k_len).scatter_add_(0, layer, k_len)  # [P]: layers are numbered < P
    sizes = torch.cat([torch.stack([is_live.sum(), (q_len * is_live).max(), k_len.max()]), per_layer])
    num_live, max_q, max_k, *per_layer = sizes.tolist()  # the host sync
    rows, num_layers = sum(per_layer), max((i + 1 for i, n in enumerate(per_layer) if n), default=1)
    live = torch.sort((~is_live).to(torch.uint8), stable=True).indices[:num_live]
    piece = torch.repeat_interleave(torch.arange(k_len.shape[0], device=device), k_len, output_size=rows)
    row = torch.arange(rows, device=device)
    src = k_start.long()[piece] + row - cu[:-1].long()[piece]
    row_layer = layer[piece]
    if SCATTER_BELOW * rows < (num_layers + 1) * num_keys:
        by_layer = torch.sort(row_layer, stable=True).indices.split(per_layer[:num_layers])
        index, layer_rows = None, tuple((r, src[r]) for r in by_layer)
    else:
        index, layer_rows = torch.full((num_layers, num_keys), rows, dtype=torch.int64, device=device), ()
        index[row_layer, src] = row  # one writer per (layer, key)
    return Scratch(cu, torch.cat([src, src.new_zeros(1)]), index, layer_rows, live, max_q, max_k, num_keys)


def add_back(partial: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``partial [rows + 1, H, D]`` per-scratch-row gradients -> ``[Tk, H, D]`` float32 sums.

    Zeroes the spare row ``partial[rows]`` first. Left in float32: callers add
    the sums over ranks before the one rounding. Deterministic: a layer's keys are
    distinct, and the layers are added in order.
    """
    partial[scratch.rows].zero_()
    if scratch.index is not None:  # the gathers
        return torch.sum(partial[scratch.index], dim=0, dtype=torch.float32)
    out = partial.new_zeros((scratch.num_keys, *partial.shape[1:]), dtype=torch.float32)
    for i, (rows, keys) in enumerate(scratch.layer_rows):
        values = partial[rows].float()
        if i == 0:  # the sums start as layer 0's rows
            out.index_copy_(0, keys, values)
        else:
            out.index_add_(0, keys, values)
    return out

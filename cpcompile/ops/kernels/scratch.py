"""Per-piece key rows for GPU backwards whose kernels cannot add overlapping pieces' dK/dV.

Pieces of one rank may read overlapping key ranges (a document's head and tail
chunks both read its first keys). Kernels that write dK/dV rather than add to
them get one scratch row per (piece, key) instead, and the sums go back to the keys.

Every plan's key ranges are prefixes of documents (``[doc start, ...)``), so two
ranges either start at the same key or are disjoint. Numbering the pieces that
share a start 0, 1, 2, ... gives *layers* whose ranges are disjoint, and each
key's sum takes at most one row per layer, in float32, in layer order. On CUDA,
``sum_rows`` adds them in one kernel that reads only the rows there are; per rank
at cp=8 on the H200 (128K ProLong tokens, 8 KV heads) 0.18-0.22 ms per tensor,
where gathering every key once per layer and summing took 0.72-0.91 ms, and
``index_add_`` layer by layer 0.50-1.45 (16 KV heads: 0.38-0.45 against
0.97-1.44 for the better torch way). Off CUDA or without Triton, torch gathers.

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

from . import sum_rows
from .per_plan import per_plan


class Scratch(NamedTuple):
    """Scratch rows of ``P`` pieces over ``Tk`` keys, in ``L`` layers, and the live pieces.

    - ``cu``: ``[P + 1]`` int32, first scratch row of each piece (last: ``rows``).
    - ``src``: ``[rows + 1]`` int64, the key row behind each scratch row, then 0 for
      the spare row (``rows``).
    - ``index``: ``[L, Tk]`` int64, per layer, the scratch row holding each key's
      partial gradient (``rows``, the spare row, where no piece of the layer reads the key).
    - ``live``: ``[n]`` int64, in order, the pieces with query rows and keys.
    - ``max_q``, ``max_k``: the live pieces' longest query rows and key range.
    """

    cu: torch.Tensor
    src: torch.Tensor
    index: torch.Tensor
    live: torch.Tensor
    max_q: int
    max_k: int

    @property
    def rows(self) -> int:
        return self.src.shape[0] - 1


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
    sizes = torch.stack([is_live.sum(), (q_len * is_live).max(), k_len.max(), k_len.sum(), layer.max() + 1])
    num_live, max_q, max_k, rows, num_layers = sizes.tolist()  # the host sync
    live = torch.sort((~is_live).to(torch.uint8), stable=True).indices[:num_live]
    piece = torch.repeat_interleave(torch.arange(k_len.shape[0], device=device), k_len, output_size=rows)
    row = torch.arange(rows, device=device)
    src = k_start.long()[piece] + row - cu[:-1].long()[piece]
    index = torch.full((num_layers, num_keys), rows, dtype=torch.int64, device=device)
    index[layer[piece], src] = row  # one writer per (layer, key)
    return Scratch(cu, torch.cat([src, src.new_zeros(1)]), index, live, max_q, max_k)


def add_back(partial: torch.Tensor, scratch: Scratch, key_order: torch.Tensor | None = None) -> torch.Tensor:
    """``partial [rows + 1, H, D]`` per-scratch-row gradients -> ``[Tk, H, D]`` float32 sums.

    Row ``i`` sums key ``key_order[i]`` (``[Tk]`` int64, default: key ``i``), written
    there directly: the index is reordered once per plan, not the sums.
    Left in float32: callers add the sums over ranks before the one rounding.
    Deterministic: each key's rows are added in layer order. The torch way zeroes
    the spare row ``partial[rows]`` and reads it where a layer has no row.
    """
    index = scratch.index if key_order is None else _columns(scratch.index, key_order)
    if sum_rows.available(partial):
        return sum_rows.sum_rows(partial, index, scratch.rows)
    partial[scratch.rows].zero_()  # the gathers' source where a layer has no row
    return torch.sum(partial[index], dim=0, dtype=torch.float32)


@per_plan
def _columns(index: torch.Tensor, key_order: torch.Tensor) -> torch.Tensor:
    """``index [L, Tk]`` with its columns in ``key_order``; once per plan."""
    return index[:, key_order]

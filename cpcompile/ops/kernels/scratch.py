"""Per-piece key rows for GPU backwards whose kernels cannot add overlapping pieces' dK/dV.

Pieces of one rank may read overlapping key ranges (a document's head and tail
chunks both read its first keys). Kernels that write dK/dV rather than add to
them get one scratch row per (piece, key) instead, and the float32 sums go back
to the keys with ``index_add_``. The scratch holds ``sum(k_len)`` rows; reading
that size is a host sync, made once per backward (``auto`` reuses it for its choice).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Scratch(NamedTuple):
    """``cu [P + 1]`` int32: first scratch row of each piece (last: the total);
    ``src [rows]`` int64: the key row behind each scratch row."""

    cu: torch.Tensor
    src: torch.Tensor

    @property
    def rows(self) -> int:
        return self.src.shape[0]


def scratch_rows(k_start: torch.Tensor, k_len: torch.Tensor) -> Scratch:
    """:class:`Scratch` of pieces reading keys ``[k_start, k_start + k_len)`` (one host sync)."""
    cu = torch.cat([k_len.new_zeros(1), k_len.cumsum(0, dtype=torch.int32)])  # [P + 1]
    rows = int(cu[-1])  # host sync: the scratch size
    first = torch.repeat_interleave(k_start.long() - cu[:-1].long(), k_len.long(), output_size=rows)
    return Scratch(cu, first + torch.arange(rows, device=k_start.device))


def add_back(partial: torch.Tensor, scratch: Scratch, num_keys: int) -> torch.Tensor:
    """``partial [>= rows, H, D]`` per-scratch-row gradients -> ``[num_keys, H, D]`` float32 sums.

    Left in float32: callers add them over ranks before the one rounding.
    """
    out = torch.zeros(num_keys, *partial.shape[1:], dtype=torch.float32, device=partial.device)
    return out.index_add_(0, scratch.src, partial[: scratch.rows].float())

"""A rank's forward entries for a kernel that schedules them in order: longest first.

FA4's varlen forward launches one thread block per (entry, head, query tile) and
runs the entries in their order (within an entry, the last tiles, which read the
most keys, first). A rank's pieces come in its layout's row order, so the tail
piece of a long document, whose last tiles read the most keys, may start last and
finish long after the rest: under CP a rank's call is short, and its tiles are its tail. On
one device the same tiles are a small part of a call cp times as long.

So the entries here are the live pieces cut into chunks of :data:`ROWS` query rows,
each reading the keys up to its last row (bottom-right causal alignment holds per
chunk, so each row sees what it saw), ordered by the keys their last tile reads,
most first: the longest thread blocks start first (longest-processing-time order).
Chunks start at multiples of :data:`ROWS` from their piece's first row, so the
query tiles and the result are the piece's own, bit for bit. The entries' query
starts then fall as well as rise: the kernel reads each entry's rows from
``seqused_q``. FA4's forward takes that; its backward takes ``seqused_q`` too, but not
query starts that fall: it pads its accumulators by entry order (``varlen``).

FA4 launches a thread block per entry's possible query tile, ``(rows + entries x (tile - 1)) /
tile`` per head, whether an entry has rows or not; the empty ones start, find no work and end,
after the real ones. A rank has several times more piece slots than chunks, so most of its
blocks would be empty, a cost a short forward feels (docs/attention-kernels.md). So where
the plan has host twins (``per_plan``: a plan made by ``step_plan``, as a training step's is) the
entries are the chunks there are, counted on the twins; without them, and in a CUDA graph capture,
the bound stays: counting on the device would be a host sync in the forward.

Whole documents on one device (``disjoint_keys``) keep their plain call: there the
chunks ran slower and the order alone moved nothing beyond the timings' spread
(docs/attention-kernels.md, "Forward entries longest first").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cpcompile.cache import per_plan, twin

#: Query rows per chunk, a multiple of the kernel's 128-row tiles: the fastest of 256, 512, 1024
#: and whole pieces per rank (docs/attention-kernels.md, "Forward entries longest first").
ROWS = 1024


class Entries(NamedTuple):
    """``E`` forward entries, longest first: with the plan's host twins the live pieces' chunks (at
    least one entry, so that the kernel has a grid), else the bound ``P + Tq // ROWS`` fixed by the
    shapes, those past the chunks without rows and keys.

    - ``cu_q``, ``cu_k``: ``[E + 1]`` int32, each entry's first query row and first key
      (not monotone), then ``Tq`` and ``Tk``.
    - ``used_q``, ``used_k``: ``[E]`` int32, each entry's query rows and keys.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_q: torch.Tensor
    used_k: torch.Tensor


def _chunks(cu_q: torch.Tensor, k_len: torch.Tensor) -> torch.Tensor:
    """``[P]`` int64: each piece's chunks, none for a piece without rows or keys."""
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    return torch.where((q_len > 0) & (k_len > 0), (q_len + ROWS - 1) // ROWS, 0)


@per_plan
def longest_first(
    cu_q: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, num_rows: int, num_keys: int, causal: bool,
    window_left: int = -1,
) -> Entries:  # fmt: skip
    """:class:`Entries` of pieces ``cu_q [P + 1]`` over ``num_rows`` query rows reading keys
    ``[k_start, k_start + k_len)`` (``[P]``) of ``num_keys``: the pieces that have rows and
    keys, in chunks of :data:`ROWS` rows, ordered by the keys a chunk's last tile reads
    (``causal``; ``window_left`` >= 0 caps that at the window), most first, ties in row order.
    On the device, no host sync (a captured forward builds it too); the number of chunks is
    counted on the twins of ``cu_q`` and ``k_len`` where they have them; once per plan."""
    p = k_len.shape[0]
    e = p + num_rows // ROWS  # sum(ceil(n / ROWS)) <= P + sum(n) // ROWS
    host_cu, host_len = twin(cu_q), twin(k_len)  # None in a capture
    if host_cu is not None and host_len is not None:  # the chunks there are: FA4 launches blocks for every entry
        e = max(1, int(_chunks(host_cu, host_len).sum()))
    device = k_len.device
    if p == 0:  # no pieces: entries without rows or keys
        none = torch.zeros(e, dtype=torch.int32, device=device)
        last_q, last_k = (torch.full((1,), n, dtype=torch.int32, device=device) for n in (num_rows, num_keys))
        return Entries(torch.cat([none, last_q]), torch.cat([none, last_k]), none, none)
    q_start, q_len, k_len = cu_q[:-1].long(), (cu_q[1:] - cu_q[:-1]).long(), k_len.long()
    count = _chunks(cu_q, k_len)
    ends = count.cumsum(0)
    entry = torch.arange(e, device=device)
    piece = torch.searchsorted(ends, entry, right=True).clamp(max=p - 1)  # the piece whose chunks hold it
    real = entry < count.sum()
    i = entry - (ends - count)[piece]  # the chunk's place in its piece
    lo = i * ROWS
    hi = torch.minimum(lo + ROWS, q_len[piece])
    # bottom-right causal: a piece's row r sees k_len - q_len + r + 1 keys, so a chunk reads up to its last row's
    keys = (k_len[piece] - q_len[piece] + hi).clamp(min=0) if causal else k_len[piece]
    used_q, used_k = torch.where(real, hi - lo, 0), torch.where(real, keys, 0)
    cost = used_k if window_left < 0 else used_k.clamp(max=window_left + 1)
    order = torch.sort(cost, descending=True, stable=True).indices
    first_q, first_k = torch.where(real, q_start[piece] + lo, 0), torch.where(real, k_start.long()[piece], 0)

    def ended(t: torch.Tensor, last: int) -> torch.Tensor:
        return torch.cat([t[order], t.new_full((1,), last)]).int()

    return Entries(ended(first_q, num_rows), ended(first_k, num_keys), used_q[order].int(), used_k[order].int())

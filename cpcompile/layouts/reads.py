"""Which keys every rank reads, from the pack alone: no rank's plan, no communication.

Design constraint: every layout stores a rank's positions in ascending physical order, so
what a rank reads of a range of keys, and what it holds of it, is found by bisection of its
positions; the sparse K/V exchange (``comm.exchange``) and the cost model (``cost``) use it
alike. A piece reads its document's keys up to its last token when causal, all its real
ones when not, and under a window (``cpcompile.plan.window``) those within its tokens' windows.
"""

from __future__ import annotations

import torch

from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import layout_runs, run_pieces


def read_lengths(pack: Pack, causal: bool) -> torch.Tensor:
    """``[cp, B]`` int64: how many keys of document ``d`` rank ``r``'s pieces read, a prefix of it
    (from ``cu_seqlens_padded[d]``): every rank's :func:`keys_read` at once, from the pack alone
    (:func:`read_ranges`' document prefixes, as a table)."""
    reader, lo, hi = read_ranges(pack, (-1, 0) if causal else (-1, -1))
    doc = torch.searchsorted(pack.cu_seqlens_padded[:-1].long(), lo, right=True) - 1  # right: empty ones skipped
    table = torch.zeros(pack.layout.shape[0], pack.cu_seqlens.shape[0] - 1, dtype=torch.long)
    return table.index_put_((reader, doc), hi - lo)


def read_ranges(
    pack: Pack, window: tuple[int, int], runs: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(reader, lo, hi)``, each ``[M]`` int64: the runs of physical keys ``[lo, hi)`` that rank
    ``reader`` reads under ``window`` (``(left, right)``, :mod:`cpcompile.plan.window`), ascending and
    disjoint per rank, rank after rank; from the pack alone.

    Causal and full attention read document prefixes: to the end of the last real piece a rank holds
    of a document (:func:`piece_reads`, from the layout's runs, ``runs`` where the caller has them:
    :func:`cpcompile.layouts.partition.layout_runs`). A
    window reads, of each document, the union of its held positions' windows: ``[p - left,
    p + right]`` cut to the document's real tokens, whose both ends grow with ``p`` over a
    rank's ascending positions, so a new run starts where a window begins past the previous
    one's end (``[cp, T_local]`` host work).
    """
    start = pack.cu_seqlens_padded[:-1].long()  # [B]
    real_len = (pack.cu_seqlens[1:] - pack.cu_seqlens[:-1]).long()  # [B]
    if window in ((-1, 0), (-1, -1)):
        runs = layout_runs(pack.layout) if runs is None else runs
        pieces = run_pieces(*runs, pack.cu_seqlens, pack.cu_seqlens_padded)
        return piece_reads(pieces, pack.layout.shape[0], pack.cu_seqlens, pack.cu_seqlens_padded, window)[:3]
    layout = pack.layout  # [cp, T_local]
    doc = torch.searchsorted(pack.cu_seqlens_padded.long(), layout, right=True) - 1  # right: skips empty documents
    s, n = start[doc], real_len[doc]
    pos = layout - s
    real = pos < n
    left, right = window
    lo = s + (pos - left).clamp(min=0) if left >= 0 else s
    hi = s + (torch.minimum(n, pos + right + 1) if right >= 0 else n)
    reader = torch.arange(layout.shape[0])[:, None].expand_as(layout)[real]
    lo, hi = lo[real], hi[real]  # [N] each, ascending per reader
    new = torch.ones_like(reader, dtype=torch.bool)
    new[1:] = (reader[1:] != reader[:-1]) | (lo[1:] > hi[:-1])
    last = torch.ones_like(new)
    last[:-1] = new[1:]  # a run's last window reaches furthest
    return reader[new], lo[new], hi[last]


def keys_read(k_start: torch.Tensor, k_len: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[Tk]`` bool: the keys that some piece (``k_start``, ``k_len`` ``[P]``) reads."""
    ends = torch.cat([k_start, k_start + k_len]).long()
    steps = torch.cat([torch.ones_like(k_len), -torch.ones_like(k_len)]).long()  # +1 at a start, -1 past an end
    reads = torch.zeros(num_keys + 1, dtype=torch.int64, device=k_len.device).index_add_(0, ends, steps)
    return reads.cumsum(0)[:num_keys] > 0


def with_idle(cu_seqlens_padded: torch.Tensor, reads: tuple[torch.Tensor, ...], cp: int) -> tuple[torch.Tensor, ...]:
    """Every rank's reads ``(reader, lo, hi)`` ``[M]`` with a rank that reads no key given the pack's first
    row, physical row 0 (kernels need keys), still rank after rank."""
    reader, lo, hi = reads
    idle = torch.bincount(reader, minlength=cp) == 0  # [cp]
    if bool(idle.any()):
        start = cu_seqlens_padded[:-1].long()  # [B]
        first_doc = int(torch.searchsorted(start, 0, right=True)) - 1  # the first document that is not empty
        idlers = idle.nonzero().squeeze(1)
        row = start[first_doc].expand(idlers.shape[0])
        order = torch.cat([reader, idlers]).argsort(stable=True)
        reader, lo, hi = (torch.cat(x)[order] for x in ((reader, idlers), (lo, row), (hi, row + 1)))
    return reader, lo, hi


def read_matrix(runs: tuple[torch.Tensor, ...], reads: tuple[torch.Tensor, ...], cp: int) -> list[list[int]]:
    """The count matrix, ``matrix[r][s]`` the rows rank ``r`` reads from rank ``s`` (what
    :func:`cpcompile.cost.comm.use_exchange` decides by, the same on every rank), from
    the layout's runs (:func:`cpcompile.layouts.partition.layout_runs`, ``(rank, start, length)``) and the
    reads (:func:`with_idle`'s): the runs of all ranks tile the pack, so a read overlaps a run of them
    after another, found by bisection; nothing per token, nor per rank and read."""
    owner, start, length = runs
    order = torch.argsort(start)
    owner, start, length = owner[order], start[order], length[order]
    reader, lo, hi = reads
    first = torch.searchsorted(start, lo, right=True) - 1  # [M] the run holding each read's first key
    count = torch.where(hi > lo, torch.searchsorted(start, hi) - first, 0)  # [M] runs it overlaps
    read = torch.repeat_interleave(torch.arange(reader.shape[0]), count)  # [N] each (read, run) pair
    run = first[read] + torch.arange(read.shape[0]) - (torch.cumsum(count, 0) - count)[read]
    rows = torch.minimum(hi[read], start[run] + length[run]) - torch.maximum(lo[read], start[run])
    matrix = torch.zeros(cp * cp, dtype=torch.long).index_add_(0, reader[read] * cp + owner[run], rows)
    return matrix.view(cp, cp).numpy().tolist()


def piece_reads(
    pieces: tuple[torch.Tensor, ...], rows: int, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, window
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(reader, lo, hi, held)``, each ``[M]`` int64: :func:`read_ranges` of rows that hold the pieces
    ``pieces`` (:func:`cpcompile.layouts.partition.run_pieces`' ``(row, start, length, doc, pos, real)``,
    ``rows`` rows), and of each run the keys its reader holds; from the pieces alone, nothing per token.

    A row's pieces sorted by start are what it holds in order: a document's prefix reaches the end of
    its last real piece there, and how many positions a row holds below a bound is found by bisection.
    Under a window (``(left, 0)``, ``left >= 0``) a real piece ``[a, a + n)`` reads ``[a - left, a + n)``
    within its document (its tokens' windows overlap), and a row's runs are the union of its pieces' reads.
    """
    row, first, length, doc, pos, real = pieces
    cu_p = cu_seqlens_padded.long()
    start = cu_p[:-1]  # [B]
    real_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    span = int(cu_p[-1]) + 1
    order = torch.argsort(row * span + first)  # each row's pieces ascending
    row, first, length, doc, pos, real = (x[order] for x in (row, first, length, doc, pos, real))
    key = row * span + first  # [P] ascending
    before = torch.cumsum(length, 0) - length  # [P] positions held by the pieces before each

    def last_below(reader: torch.Tensor, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The piece holding the reader's last position below ``bound``, and whether it has one."""
        i = torch.searchsorted(key, reader * span + bound) - 1
        i0 = i.clamp(min=0)
        return i0, (i >= 0) & (row[i0] == reader)

    if window in ((-1, 0), (-1, -1)):
        # document prefixes: to the end of the last real piece a row holds of each document (its pieces
        # ascend, and so do their documents), or the whole real document
        live = real & (length > 0)
        r, d, reach = row[live], doc[live], (pos + length)[live]
        last = torch.ones_like(r, dtype=torch.bool)
        last[:-1] = (r[1:] != r[:-1]) | (d[1:] != d[:-1])
        reader, d, reach = r[last], d[last], reach[last]
        lo = start[d]
        hi = lo + (reach if window == (-1, 0) else real_len[d])
    else:
        left, right = window
        if left < 0 or right != 0:
            raise ValueError(f"piece_reads takes (-1, 0), (-1, -1) or a causal window (left >= 0, 0), got {window}")
        live = real & (length > 0)
        r, s = row[live], start[doc[live]]
        lo_p = s + (pos[live] - left).clamp(min=0)
        hi_p = s + torch.minimum(real_len[doc[live]], pos[live] + length[live])
        new = torch.ones_like(r, dtype=torch.bool)
        new[1:] = (r[1:] != r[:-1]) | (lo_p[1:] > hi_p[:-1])
        last = torch.ones_like(new)
        last[:-1] = new[1:]  # a run's last piece reaches furthest
        reader, lo, hi = r[new], lo_p[new], hi_p[last]

    # positions each row holds before its own pieces: every row's pieces precede it in `before`
    held_before = torch.zeros(rows + 1, dtype=torch.long).index_add_(0, row + 1, length).cumsum(0)[:-1]  # [rows]

    def held_below(bound: torch.Tensor) -> torch.Tensor:  # [M]: the reader's positions below each bound
        i, has = last_below(reader, bound)
        count = before[i] - held_before[reader] + torch.minimum(bound - first[i], length[i])
        return torch.where(has, count, 0)

    held = held_below(hi) - held_below(lo)
    return reader, lo, hi, held

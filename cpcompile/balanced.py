"""The BALANCED layout: equal tokens and equal causal attention work on every rank.

Design constraint: a deterministic pure function of ``(cu_seqlens_padded, cp_size)``
that every rank computes alone, fast enough for a data loader (about 1.5 ms for
100K tokens in 1,000 documents). It chooses cut points from document lengths, so
it reads ``cu_seqlens_padded`` on the host: on CUDA that is one host sync
(:func:`balanced_layout` copies the offsets to the CPU and moves the layout back).
The custom op ``cpcompile::balanced_layout`` wraps it so that tracing sees a
``[cp, T / cp]`` tensor and never the values.

The layout uses padded lengths as document lengths: BALANCED pads only the total,
so the padding (fewer than ``cp`` tokens) counts as part of the last document.

Algorithm (``t = T / cp`` tokens per rank, ``W`` = total causal work / cp):

1. Short documents (fewer than ``4 * TILE`` tokens) are never cut. Sorted by
   length they are dealt in rounds of ``cp``, one per rank, in snake order
   (0..cp-1, then cp-1..0), as long as every rank keeps room for them; so every
   rank holds the same number and mix of them, and with it the same kernel-tile
   waste that short documents cause.
2. The other documents form one sequence, longest first, each read in *pair
   order* ``0, L-1, 1, L-2, ...``: every two tokens carry ``L + 1`` causal work
   (dual_chunk_swap's idea), so any run of it is a head piece plus a mirrored
   tail piece, and work per token never rises along the sequence (a whole
   document in a run is one piece again: its head and tail meet).
3. Rank ``r`` takes a front range ``[F_r, F_{r+1})`` (dense, long documents) and
   a back range ``[G_{r+1}, G_r)`` (light ones) of the sequence, with as many
   tokens as its dealt documents leave free. Each cut ``F_r`` is found
   independently: the smallest position where ranks ``0..r-1`` hold ``r / cp`` of
   the total work, counting a partly taken document's work as proportional to its
   tokens (exact for whole pairs; so each cut is within 1.5 x the longest document
   of the exact share). That count never falls as ``F_r`` grows, so a vectorized
   64-way search finds the cut exactly.
4. Each front cut then moves to a *tile-aligned split* of its document, where its
   head ends and its tail starts on the document's ``TILE``-token tiles (a piece
   starting off a tile has every query tile read one more, partly masked, key
   tile): of the splits whose head and tail are within about ``_SNAP_TILES``
   tiles of the pair order's, the one whose work, with the back cut moved by the
   same number of tokens, is nearest the share; and only where that is within
   ``W / SNAP_SLACK`` of it, and ranks hold at least ``SNAP_MIN_TOKENS``. Back
   cuts, in light documents, move by tokens only: they are not put on tiles.
5. Each rank stores its runs in physical order.

A document thus lands on a rank whole (one piece) or, where a cut falls in it, as
a head and a tail piece (four pieces for the one document that can lie in both
of a rank's ranges); there are ``2 * (cp - 1)`` cuts in all.
"""

from __future__ import annotations

import torch

#: Rows and keys of an attention kernel tile: a piece shorter than this costs a whole tile.
TILE = 128
#: Documents shorter than this are dealt whole (step 1).
DEAL_BELOW = 4 * TILE
#: A front cut moves to a tile-aligned split where ranks' work stays within W / SNAP_SLACK (step 4).
SNAP_SLACK = 256
#: Step 4 tries heads and tails from this many tiles below to one more above the pair order's (on tiles).
_SNAP_TILES = 10
#: Step 4 runs where a rank holds at least this many tokens: a move shifts the back cut by up to
#: about 2,900 tokens, and where that is more than a quarter of a rank it reshapes much of it (the
#: cost model, on packs of one dominant document with 2-8K tokens per rank: slowest ranks up to
#: 4.5 % slower; with 16K and more, 0-0.5 % faster).
SNAP_MIN_TOKENS = 8 * (_SNAP_TILES + 1) * TILE
_SNAP_STEPS = (torch.arange(2 * _SNAP_TILES + 2) - _SNAP_TILES) * TILE  # [K] head or tail moves
_SNAP_SUMS = torch.arange(4 * _SNAP_TILES + 3) * TILE  # [2K - 1] their sums, from the smallest
_SEARCH_WAYS = 64


class _Sequence:
    """The cut-able documents in sequence order (step 2) and their cumulative work."""

    def __init__(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths  # [D] int64, longest first
        zero = lengths.new_zeros(1)
        self.starts = torch.cat([zero, lengths.cumsum(0)])  # [D + 1] sequence offsets
        self.work_before = torch.cat([zero, (lengths * (lengths + 1) // 2).cumsum(0)])  # [D + 1]
        self.tokens = int(self.starts[-1])

    def doc_at(self, p: torch.Tensor) -> torch.Tensor:
        # right=True: empty documents share their start with the next one and are skipped
        return (torch.searchsorted(self.starts, p, right=True) - 1).clamp(0, self.lengths.shape[0] - 1)

    def prefix_work2(self, p: torch.Tensor) -> torch.Tensor:
        """Twice the work of the first ``p`` tokens (any shape, int64), a partly taken
        document's counted at ``(L + 1) / 2`` per token: non-decreasing in ``p``."""
        d = self.doc_at(p)
        return 2 * self.work_before[d] + (p - self.starts[d]) * (self.lengths[d] + 1)

    def runs(self, starts: torch.Tensor, ends: torch.Tensor, splits=None) -> tuple[torch.Tensor, ...]:
        """Ranges ``[starts, ends)`` of the sequence as runs of document positions.

        ``splits``: ``(position, head, tail)`` ``[C]`` each, positions ascending: a
        range that starts or ends at one inside a document splits that document into
        ``head`` and ``tail`` tokens instead of the pair order's (at a document's
        start a split, which ended the document before, does not apply).
        Returns ``(range, doc, first, length)``, two runs (head, tail, either may be
        empty) per document a range overlaps, heads first.
        """
        d_lo = self.doc_at(starts)
        d_hi = self.doc_at(ends - 1)
        count = torch.where(ends > starts, d_hi - d_lo + 1, 0)
        seg = torch.repeat_interleave(count)  # [S] range of each (range, document) segment
        first_seg = count.cumsum(0) - count
        doc = d_lo[seg] + torch.arange(seg.shape[0]) - first_seg[seg]
        n = self.lengths[doc]
        a = torch.maximum(starts[seg], self.starts[doc])  # the segment [a, b) of the sequence
        b = torch.minimum(ends[seg], self.starts[doc + 1])
        (head_lo, tail_a), (head_hi, tail_b) = self._split(doc, a, splits), self._split(doc, b, splits)
        # to its document's end a segment is one run from its head to its tail: after a moved
        # split (step 4) the pair order's halves need not meet there
        to_end = b == self.starts[doc + 1]
        head_hi, tail_b = torch.where(to_end, n - tail_a, head_hi), torch.where(to_end, tail_a, tail_b)
        first = torch.cat([head_lo, n - tail_b])
        return seg.repeat(2), doc.repeat(2), first, torch.cat([head_hi - head_lo, tail_b - tail_a])

    def _split(self, doc: torch.Tensor, p: torch.Tensor, splits) -> tuple[torch.Tensor, torch.Tensor]:
        """``(head, tail)`` tokens of ``doc`` before sequence position ``p``, in pair order
        (even k -> position k / 2, odd k -> L - 1 - (k - 1) / 2) unless ``splits`` moved it."""
        x = p - self.starts[doc]
        head, tail = (x + 1) // 2, x // 2
        if splits is None or not splits[0].numel():
            return head, tail
        at, split_head, split_tail = splits
        i = torch.searchsorted(at, p).clamp(max=at.shape[0] - 1)
        moved = (at[i] == p) & (x > 0)  # a split that ends its document is the next one's start
        return torch.where(moved, split_head[i], head), torch.where(moved, split_tail[i], tail)


def _deal_short(lengths_sorted: torch.Tensor, cp: int, t_local: int) -> tuple[int, torch.Tensor]:
    """Step 1: ``(first, rank)``: sorted document ``first + i`` goes to rank ``rank[i]`` (``[rounds * cp]``)."""
    first = int((lengths_sorted >= DEAL_BELOW).sum())
    short = int((lengths_sorted > 0).sum()) - first  # empty documents need no rank
    rank = torch.arange(cp).repeat(short // cp, 1)  # [rounds, cp]
    rank[1::2] = rank[1::2].flip(1)  # snake order
    dealt = torch.zeros_like(rank).scatter_(1, rank, lengths_sorted[first : first + rank.numel()].view(rank.shape))
    # rounds after which no rank holds more than t_local dealt tokens
    rounds = int(torch.searchsorted(dealt.cumsum(0).amax(1), torch.tensor(t_local), right=True))
    return first, rank[:rounds].reshape(-1)


def _front_cuts(seq: _Sequence, cp: int, take: torch.Tensor, work_target: torch.Tensor) -> list[int]:
    """Step 3: ``F_0..F_cp`` for ranks that take ``take`` ``[cp]`` tokens and ``work_target / cp`` work.

    ``work_target`` ``[cp]`` is scaled by ``cp`` so everything stays exact in int64.
    """
    taken = take.cumsum(0)[:-1, None]  # [cp - 1, 1] tokens held by ranks 0..r-1
    wanted = 2 * work_target.cumsum(0)[:-1, None]
    work2 = 2 * int(seq.work_before[-1])
    skip = seq.tokens - taken  # the middle of the sequence that ranks 0..r-1 leave
    lo, hi = torch.full_like(taken, -1), taken.clone()  # invariant: lo is short of the work, hi is not
    steps = torch.arange(1, _SEARCH_WAYS)
    while cp > 1 and seq.tokens and int((hi - lo).max()) > 1:
        span = hi - lo
        grid = lo + (span * steps + _SEARCH_WAYS - 1) // _SEARCH_WAYS  # [cp - 1, ways - 1]
        w = seq.prefix_work2(torch.stack([grid, grid + skip]))
        enough = cp * (w[0] + work2 - w[1]) >= wanted
        enough = torch.cat([enough, torch.ones_like(enough[:, :1])], 1)
        i = enough.int().argmax(1, keepdim=True)  # first grid point with enough work
        grid = torch.cat([lo, grid, hi], 1)
        lo, hi = grid.gather(1, i), grid.gather(1, i + 1)
    # Integer rounding aside the cuts are ordered; make sure every range is non-negative.
    cuts = [0]
    for f, n in zip(hi.flatten().tolist(), take[:-1].tolist(), strict=True):
        cuts.append(min(max(f, cuts[-1]), cuts[-1] + n))
    cuts.append(cuts[-1])
    return cuts


def _align(seq: _Sequence, cp: int, take: torch.Tensor, work_target: torch.Tensor, cuts: list[int], slack: int):
    """Step 4: step 3's cuts ``F_0..F_cp``, each front cut moved to a tile-aligned split where
    ranks ``0..r-1`` keep within ``slack`` of their work (``work_target`` as in :func:`_front_cuts`).

    Returns the cuts ``[cp + 1]`` and the moved ones as ``(position, head, tail)`` for
    :meth:`_Sequence.runs` (``None`` if there are none). Needs ``cp > 1`` and a sequence.
    """
    exact = torch.tensor(cuts[1:-1])  # [cp - 1]
    d = seq.doc_at(exact)
    n, x = seq.lengths[d], exact - seq.starts[d]
    head, tail = (x + 1) // 2, x // 2  # the pair order's split
    # Candidates: K heads of whole tiles (i) times K tails that start on one (j), both
    # ascending, so the tokens they take, and with them the back cut, depend on i + j alone.
    size = _SNAP_STEPS.shape[0]  # K
    h = (head // TILE * TILE)[:, None] + _SNAP_STEPS  # [cp - 1, K]
    t = (n - (n - tail) // TILE * TILE)[:, None] + _SNAP_STEPS
    took = h[:, :1] + t[:, :1] + _SNAP_SUMS  # [cp - 1, 2K - 1] by i + j
    pos = exact[:, None] + took - x[:, None]
    back = pos + seq.tokens - take.cumsum(0)[:-1, None]  # the back cut keeps ranks 0..r-1's tokens
    # 2 cp x (work of ranks 0..r-1 - their share) = by_h[i] - by_t[j] + by_took[i + j]
    by_h = cp * (2 * seq.work_before[d][:, None] + h * (h + 1) + (n * (n + 1))[:, None])
    by_h -= 2 * work_target.cumsum(0)[:-1, None]
    by_t = cp * (n[:, None] - t) * (n[:, None] - t + 1)
    by_took = cp * (2 * int(seq.work_before[-1]) - seq.prefix_work2(back.clamp(0, seq.tokens)))
    fits = (took <= n[:, None]) & (back >= pos) & (back <= seq.tokens)
    fits = fits.unfold(1, size, 1) & (h >= 0)[:, :, None] & (t >= 0)[:, None, :]  # [cp - 1, K, K]
    off = (by_h[:, :, None] - by_t[:, None, :] + by_took.unfold(1, size, 1)).abs()
    off = off.masked_fill_(~fits, torch.iinfo(off.dtype).max).flatten(1)
    best = off.argmin(1)
    i, j = (best // size).tolist(), (best % size).tolist()
    moved = ((off.gather(1, best[:, None]).flatten() <= 2 * cp * slack) & (x > 0) & (x < n)).tolist()
    pos = pos[torch.arange(cp - 1), best // size + best % size]  # took's index is i + j

    # the documents each side of each back cut, the front cut as is and moved: [cp - 1, 2, 2]
    g = torch.stack([exact, pos], 1) + (seq.tokens - take.cumsum(0)[:-1])[:, None]
    back_docs = seq.doc_at(torch.stack([g - 1, g], 2).clamp(0, seq.tokens - 1)).tolist()
    exact, d, take, pos = exact.tolist(), d.tolist(), take.tolist(), pos.tolist()
    split = list(zip(head.tolist(), tail.tolist(), strict=True))
    h, t = h.tolist(), t.tolist()
    moved_split = [(h[r][i[r]], t[r][j[r]]) for r in range(cp - 1)]
    # The moves are checked together: a rank's ranges stay within its tokens, cuts in one
    # document keep their order, and no back cut falls in a moved cut's document. Undoing
    # the offending moves repeats until none offends (none does without moves).
    while True:
        at = [pos[r] if moved[r] else exact[r] for r in range(cp - 1)]
        sp = [moved_split[r] if moved[r] else split[r] for r in range(cp - 1)]
        front = [at[0]] + [b - a for a, b in zip(at, at[1:])] + [0]
        bad_rank = [f < 0 or f > n_r for f, n_r in zip(front, take, strict=True)]
        near_back = {doc for r in range(cp - 1) for doc in back_docs[r][moved[r]]}
        bad = [moved[r] and (bad_rank[r] or bad_rank[r + 1] or d[r] in near_back) for r in range(cp - 1)]
        for r in range(cp - 2):
            if d[r] == d[r + 1] and (sp[r + 1][0] < sp[r][0] or sp[r + 1][1] < sp[r][1]):
                bad[r], bad[r + 1] = bad[r] or moved[r], bad[r + 1] or moved[r + 1]
        if not any(bad):
            break
        moved = [m and not b for m, b in zip(moved, bad, strict=True)]
    splits = [(at[r], *sp[r]) for r in range(cp - 1) if moved[r]]
    return torch.tensor([0, *at, at[-1]]), tuple(torch.tensor(c) for c in zip(*splits)) or None


def balanced_layout(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Every rank's physical positions under BALANCED, computed on the host.

    Args:
        cu_seqlens_padded: ``[B + 1]`` int32 physical offsets, total a multiple of ``cp_size``.
    Returns:
        ``[cp_size, T / cp_size]`` int64 on the device of ``cu_seqlens_padded``.
    """
    cu = cu_seqlens_padded.detach().cpu().long()
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    cp, t_local = cp_size, total // cp_size
    order = torch.sort(-lengths, stable=True).indices  # longest first, ties by position
    by_len = lengths[order]

    first, dealt_rank = _deal_short(by_len, cp, t_local)
    dealt = order[first : first + dealt_rank.shape[0]]
    rest = torch.cat([order[:first], order[first + dealt.shape[0] :]])
    seq = _Sequence(lengths[rest])
    dealt_len = lengths[dealt]
    take = t_local - torch.zeros(cp, dtype=torch.long).index_add_(0, dealt_rank, dealt_len)
    dealt_work = torch.zeros(cp, dtype=torch.long).index_add_(0, dealt_rank, dealt_len * (dealt_len + 1) // 2)
    total_work = int(seq.work_before[-1] + dealt_work.sum())
    work_target = total_work - cp * dealt_work
    front, splits = torch.tensor(_front_cuts(seq, cp, take, work_target)), None
    if cp > 1 and seq.tokens and t_local >= SNAP_MIN_TOKENS:
        front, splits = _align(seq, cp, take, work_target, front.tolist(), total_work // (cp * SNAP_SLACK))
    back = front + seq.tokens - torch.cat([take.new_zeros(1), take.cumsum(0)])  # G_r: every rank gets `take`

    # ranges in the order (rank 0 front, rank 0 back, rank 1 front, ...)
    starts = torch.stack([front[:-1], back[1:]], 1).reshape(-1)
    ends = torch.stack([front[1:], back[:-1]], 1).reshape(-1)
    seg, doc, run_first, run_len = seq.runs(starts, ends, splits)
    run_rank = torch.cat([seg // 2, dealt_rank])
    run_start = torch.cat([cu[rest[doc]] + run_first, cu[dealt]])
    run_len = torch.cat([run_len, dealt_len])
    keep = run_len > 0
    run_rank, run_start, run_len = run_rank[keep], run_start[keep], run_len[keep]
    sort = torch.argsort(run_rank * (total + 1) + run_start)  # rank-major, then physical order
    return _expand_runs(run_start[sort], run_len[sort], total).view(cp, t_local).to(cu_seqlens_padded.device)


def _expand_runs(start: torch.Tensor, length: torch.Tensor, total: int) -> torch.Tensor:
    """Runs ``[start, start + length)`` (all non-empty) back to back: ``[total]`` int64."""
    # A cumulative sum of steps: 1 inside a run, a jump to the next run's start at its first token.
    offset = length.cumsum(0) - length
    last_before = torch.cat([start.new_zeros(1), (start + length - 1)[:-1]])
    step = torch.ones(total, dtype=torch.long)
    step[offset] = start - last_before
    return step.cumsum(0)


@torch.library.custom_op("cpcompile::balanced_layout", mutates_args=())
def balanced_layout_op(cu_seqlens_padded: torch.Tensor, cp_size: int, num_tokens: int) -> torch.Tensor:
    """:func:`balanced_layout` as an op: ``[cp_size, num_tokens / cp_size]`` int64."""
    return balanced_layout(cu_seqlens_padded, cp_size)


@balanced_layout_op.register_fake
def _(cu_seqlens_padded, cp_size, num_tokens):
    return cu_seqlens_padded.new_empty((cp_size, num_tokens // cp_size), dtype=torch.int64)

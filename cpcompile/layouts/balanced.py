"""The BALANCED layout: equal tokens and equal causal attention work on every rank.

Design constraint: a deterministic pure function of ``(cu_seqlens_padded, cp_size)``
(and, under a capacity, ``cu_seqlens``) that every rank computes alone, fast enough for a data loader (its host time:
BENCHMARKS.md, "Balance"). It chooses cut points from document lengths, so
it reads ``cu_seqlens_padded`` on the host: on CUDA that is one host sync
(:func:`balanced_layout` copies the offsets to the CPU and moves the layout back).
The custom op ``cpcompile::balanced_layout`` wraps it so that tracing sees a
``[cp, T / cp]`` tensor and never the values.

The layout uses padded lengths as document lengths: BALANCED pads only the total,
so the padding (fewer than ``cp`` tokens) counts as part of the last document. Under a
capacity (``StrategySpec.capacity``) the padding runs on to the capacity and can be most
of a rank; there the layout is also given ``cu_seqlens`` and lays the padding out as a
document of its own (:func:`free_padding`), dealt first (step 0) so that every rank keeps
as many real tokens as without a capacity; the steps below lay out the real documents alone.

Algorithm (``t = T / cp`` tokens per rank, ``W`` = total work / cp):

*Work* is what a causal kernel with ``s x s`` tiles does: the area of the tiles a
document's query tiles visit, ``s**2 x tiles(L)``. With ``s = 1`` that is the
attention pairs ``L (L + 1) / 2``. Where ranks hold at least ``SNAP_MIN_TOKENS`` real tokens
the layout counts kernel tiles (``s = TILE``): a rank's kernel time follows its
tiles more than its pairs, since a long document's last, partial query tile reads
every key tile for a few rows (measured: docs/balanced-layout.md). Below that, pieces are too short to keep on
tiles and it counts pairs (``s = 1``).

0. Under a capacity, the padding (read in order) is dealt first: rank ``r`` takes
   as much of it as leaves it ``R / cp`` real tokens (``R`` real tokens in all; the
   first ``R mod cp`` ranks one more), as every rank holds without the capacity. The
   steps below lay out the real documents alone, each rank's tokens those it has left.
1. Short documents (fewer than ``4 * TILE`` tokens), sorted by length, are dealt
   whole in rounds of ``cp``, one per rank, in snake order (0..cp-1, then
   cp-1..0), as long as every rank keeps room for them within its share of the
   real tokens; so every rank holds the same number and mix of them, and with it
   the same kernel-tile waste that short documents cause. The few left over
   (fewer than ``cp``, or those that no longer fit) join the sequence.
2. The other documents form one sequence, densest first (twice the work per
   token, rounded up: ``rate = ceil(2 work / L)``, with pairs ``L + 1``, so longest
   first; with tiles a leftover document of a few tokens, which costs a whole
   tile, counts as dense), each read in *pair order* ``0, L-1, 1, L-2, ...``, a
   token counted at ``rate / 2``. Two tokens carry ``L + 1`` pairs (dual_chunk_swap's idea), so any
   run of the sequence is a head piece plus a mirrored tail piece with about its
   share of the work, and work per token never rises along the sequence (a whole
   document in a run is one piece again: its head and tail meet).
3. Rank ``r`` takes a front range ``[F_r, F_{r+1})`` (dense, long documents) and
   a back range ``[G_{r+1}, G_r)`` (light ones) of the sequence, with as many
   tokens as its dealt documents leave free. Each cut ``F_r`` is found
   independently: the smallest position where ranks ``0..r-1`` hold ``r / cp`` of
   the total work, as step 2 counts it (a whole document's within half a token's
   rate of its work, exact with pairs; with pairs each cut is within 1.5 x the
   longest document of the exact share). That count never falls as ``F_r`` grows,
   so a vectorized 64-way search finds the cut exactly.
4. Where ranks hold at least ``SNAP_MIN_TOKENS``, each front cut then moves to a
   *tile-aligned split* of its document: its head ends on one of the document's
   ``TILE``-token tiles and its tail, if any, starts on one (a piece starting off
   a tile has every query tile read one more, partly masked, key tile). A split's
   head counts its tiles' work, and its tail the rest of the document's count,
   the last, partial tile included. Candidates: heads and tails within about
   ``_SNAP_TILES`` tiles of the pair order's, the back cut moved by as many
   tokens. Cuts in order take the first of their ``_SNAP_TRIES`` candidates
   nearest the share that is within ``W / SNAP_SLACK`` of it and consistent with
   the cut before as placed and the cuts after as they are: ranks keep their
   tokens, a document's splits nest, and no back cut falls in a moved cut's
   document.
   Back cuts, in light documents, move by tokens only: they are not put on tiles.
5. Where step 4 runs: the backward. A rank's kernel runs a forward and a backward, and the backward
   costs more than ``BACKWARD_PER_PAIR_HALVES / 2`` times the forward's tiles where a rank's pieces read
   more key blocks than their tiles suggest: a piece reads its document's keys from the start, so a tail (or
   middle) piece of a long document pays for every key block before it (and the backward's
   ``BWD_ROWS``-row tiles waste less on a partial block than the forward's). Each rank's overhead
   (:func:`backward_overhead`, summed over its pieces) is priced on the layout of steps 0-4, and steps
   3-4 run again with each rank's share of the sequence's work moved by its distance from the mean, as
   forward and backward work: ranks whose pieces read more keys take fewer forward tiles, so that
   forward + backward is even, not the forward alone.
6. Each rank stores its runs in physical order.

A document thus lands on a rank whole (one piece) or, where a cut falls in it, as
a head and a tail piece (four pieces for the one document that can lie in both
of a rank's ranges); there are ``2 * (cp - 1)`` cuts in all.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import torch

#: Rows and keys of an attention kernel tile: a piece shorter than this costs a whole tile.
TILE = 128
#: Documents shorter than this are dealt whole (step 1).
DEAL_BELOW = 4 * TILE
#: A front cut moves to a tile-aligned split where ranks' work stays within W / SNAP_SLACK (step 4).
SNAP_SLACK = 128
#: Step 4 tries heads and tails from this many tiles below to one more above the pair order's (on tiles).
_SNAP_TILES = 10
#: Work counts tiles, and front cuts move to them (step 4), where a rank holds at least this many
#: tokens: a front cut's move shifts the back cut by up to about 2,900 tokens, and where that is more
#: than a quarter of a rank it reshapes much of it, making the slowest rank slower; below it, counting
#: tiles alone barely evens them and leaves attention pairs less even (docs/balanced-layout.md).
SNAP_MIN_TOKENS = 8 * (_SNAP_TILES + 1) * TILE
_SNAP_STEPS = (torch.arange(2 * _SNAP_TILES + 2) - _SNAP_TILES) * TILE  # [K] head or tail moves
#: Step 4 tries this many of a front cut's candidates, nearest the share first.
_SNAP_TRIES = 32
#: Step 3's search tries this many front cuts per rank and round. Without windows the work of ranks
#: 0..r-1 never falls as their front cut moves on, so every grid finds the same cut; with windows it can
#: fall, and which crossing the search lands on depends on the grid: windowed packs keep the finer grid
#: their layouts were measured with (tests/layouts/test_balanced.py checks both).
_SEARCH_WAYS = 8
_SEARCH_WAYS_WINDOWED = 64
#: Step 5: query rows of a backward tile (FlashAttention-4's backward runs ``BWD_ROWS x TILE`` tiles).
BWD_ROWS = 64
#: Step 5: what the backward pays per key block a piece reads (loading its keys, writing its dK/dV), in
#: backward tiles (docs/attention-kernels.md, "Where the per-rank gap is": between the two head layouts'
#: fits).
KEY_BLOCK = 3
#: Step 5: a pair's backward costs this many halves of its forward, 5 / 2 (the cost model's FLOP split,
#: ``cpcompile.advisor.comm_model.comm_pairs``; ``cpcompile.cost.timing.KernelSpeed`` fits about as much);
#: counted in halves so that the work stays integer.
BACKWARD_PER_PAIR_HALVES = 5
#: Step 5 re-cuts at most this many times, keeping the layout whose busiest rank's forward + backward work
#: is least among those whose busiest rank's forward is within 1 / FORWARD_SLACK of steps 0-4's.
BACKWARD_PASSES = 3
FORWARD_SLACK = 100


def causal_tiles(rows, offset, block_q: int = TILE, block_k: int = TILE):
    """Key tiles a causal kernel of ``block_q x block_k`` tiles (``block_q`` a multiple of ``block_k``)
    visits for a piece of ``rows`` query rows whose first is ``offset`` tokens into its document (int64
    tensors of any shapes, or ints): its query tiles start at its first row, its key tiles at the
    document's start."""
    m, n = block_q, block_k
    full, rest = rows // m, rows % m
    # full block b ends at row (b + 1) m: ceil((o + (b + 1) m) / n) = ceil(o / n) + (b + 1) m / n
    tiles = full * ((offset + n - 1) // n) + (m // n) * full * (full + 1) // 2
    return tiles + (rest > 0) * ((offset + rows + n - 1) // n)


def window_pairs(p: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention pairs of a document's first ``p`` rows (int64, any shape) when each row sees at
    most ``window + 1`` keys (its sliding window: varlen_attn's ``(window, 0)``; -1: unbounded)."""
    if window < 0:
        return p * (p + 1) // 2
    under = p.clamp(max=window + 1)
    return under * (under + 1) // 2 + (p - under) * (window + 1)


def band_tiles(rows: torch.Tensor, offset: torch.Tensor, window: int, block_q: int = TILE, block_k: int = TILE):
    """:func:`causal_tiles` under a sliding window: a row at position ``p`` of its document reads only
    keys ``[p - window, p]``, so each query tile's key tiles start at its first row's window (int64
    ``[P]`` tensors; ``window`` -1: unbounded, as :func:`causal_tiles`). One entry per query tile."""
    m, n = block_q, block_k
    blocks = (rows + m - 1) // m  # [P]
    piece = torch.repeat_interleave(torch.arange(rows.shape[0]), blocks)  # [blocks]
    b = torch.arange(piece.shape[0]) - torch.repeat_interleave(blocks.cumsum(0) - blocks, blocks)
    first = offset[piece] + b * m
    last = offset[piece] + torch.minimum((b + 1) * m, rows[piece]) - 1
    lo = (first - window).clamp(min=0) if window >= 0 else torch.zeros_like(first)
    return torch.zeros_like(rows).index_add_(0, piece, last // n + 1 - lo // n)


class _Sequence:
    """The cut-able documents in sequence order (step 2) and their cumulative work, doubled."""

    def __init__(self, lengths: torch.Tensor, rate: torch.Tensor, tile: int, windows=None) -> None:
        self.lengths = lengths  # [D] int64
        self.rate = rate  # [D] int64, twice the work per token, non-increasing
        self.tile = tile
        # Windowed layers: a document's tokens are read in order, not in pair order (a window makes
        # late tokens no dearer than middle ones, so mirrored halves no longer carry equal work),
        # and a prefix's work is exact (window_pairs)
        self.windows = windows
        zero = lengths.new_zeros(1)
        self.starts = torch.cat([zero, lengths.cumsum(0)])  # [D + 1] sequence offsets
        work2 = lengths * rate if windows is None else 2 * self._pairs(lengths)
        self.work2_before = torch.cat([zero, work2.cumsum(0)])  # [D + 1]
        self.tokens = int(self.starts[-1])

    def _pairs(self, rows: torch.Tensor) -> torch.Tensor:
        """The windowed layers' pairs of a document's first ``rows`` tokens, together."""
        return sum(window_pairs(rows, w) for w in self.windows)

    def doc_at(self, p: torch.Tensor) -> torch.Tensor:
        # right=True: empty documents share their start with the next one and are skipped
        return (torch.searchsorted(self.starts, p, right=True) - 1).clamp(0, self.lengths.shape[0] - 1)

    def prefix_work2(self, p: torch.Tensor) -> torch.Tensor:
        """Twice the work of the first ``p`` tokens (any shape, int64), as step 2 counts it:
        non-decreasing in ``p``, by at most ``rate`` per token."""
        d = self.doc_at(p)
        if self.windows is not None:
            return self.work2_before[d] + 2 * self._pairs(p - self.starts[d])
        return self.work2_before[d] + (p - self.starts[d]) * self.rate[d]

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
        if self.windows is not None:  # in order: all head (and no split moves, as step 4 does not run)
            return x, torch.zeros_like(x)
        head, tail = (x + 1) // 2, x // 2
        if splits is None or not splits[0].numel():
            return head, tail
        at, split_head, split_tail = splits
        i = torch.searchsorted(at, p).clamp(max=at.shape[0] - 1)
        moved = (at[i] == p) & (x > 0)  # a split that ends its document is the next one's start
        return torch.where(moved, split_head[i], head), torch.where(moved, split_tail[i], tail)


def _deal_short(lengths_sorted: torch.Tensor, cp: int, room: int) -> tuple[int, torch.Tensor]:
    """Step 1: ``(first, rank)``: sorted document ``first + i`` goes to rank ``rank[i]`` (``[rounds * cp]``)."""
    first = int((lengths_sorted >= DEAL_BELOW).sum())
    short = int((lengths_sorted > 0).sum()) - first  # empty documents need no rank
    rank = torch.arange(cp).repeat(short // cp, 1)  # [rounds, cp]
    rank[1::2] = rank[1::2].flip(1)  # snake order
    dealt = torch.zeros_like(rank).scatter_(1, rank, lengths_sorted[first : first + rank.numel()].view(rank.shape))
    # rounds after which no rank holds more than `room` dealt tokens
    rounds = int(torch.searchsorted(dealt.cumsum(0).amax(1), torch.tensor(room), right=True))
    return first, rank[:rounds].reshape(-1)


def _front_cuts(seq: _Sequence, cp: int, take: torch.Tensor, skip: torch.Tensor, target2: torch.Tensor) -> torch.Tensor:
    """Step 3: ``F_0..F_cp`` ``[cp + 1]`` for ranks that take ``take`` ``[cp]`` tokens and ``target2 / (2 cp)``
    work, the back cuts at ``G_r = F_r + skip[r]`` (``skip`` ``[cp + 1]``).

    ``target2`` ``[cp]`` is twice the work, scaled by ``cp``, so everything stays exact in int64.
    """
    skip = skip[1:-1, None]  # [cp - 1, 1] the middle of the sequence that ranks 0..r-1 leave
    taken = seq.tokens - skip  # tokens held by ranks 0..r-1
    wanted = target2.cumsum(0)[:-1, None]
    work2 = int(seq.work2_before[-1])
    lo, hi = torch.full_like(taken, -1), taken.clone()  # invariant: lo is short of the work, hi is not
    ways = _SEARCH_WAYS if seq.windows is None else _SEARCH_WAYS_WINDOWED
    steps = torch.arange(1, ways)
    while cp > 1 and seq.tokens and int((hi - lo).max()) > 1:
        span = hi - lo
        grid = lo + (span * steps + ways - 1) // ways  # [cp - 1, ways - 1]
        w = seq.prefix_work2(torch.stack([grid, grid + skip]))
        short = cp * (w[0] + work2 - w[1]) < wanted
        i = short.sum(1, keepdim=True)  # the first grid point with enough work (the count never falls)
        grid = torch.cat([lo, grid, hi], 1)
        lo, hi = grid.gather(1, i), grid.gather(1, i + 1)
    # A cut can fall before the one before it (where a rank's dealt documents carry more than its
    # share of work, or by rounding): keep every range non-negative and within its rank's tokens.
    cuts = [0]
    for f, n in zip(hi.flatten().tolist(), take[:-1].tolist(), strict=True):
        cuts.append(min(max(f, cuts[-1]), cuts[-1] + n))
    cuts.append(cuts[-1])
    return torch.tensor(cuts)


def _align(
    seq: _Sequence,
    cp: int,
    take: torch.Tensor,
    skip: torch.Tensor,
    target2: torch.Tensor,
    front: torch.Tensor,
    slack2: int,
):
    """Step 4: step 3's cuts ``front`` (``F_0..F_cp``), each front cut moved to a tile-aligned split where
    ranks ``0..r-1`` keep within ``slack2 / 2`` of their work (``skip`` and ``target2`` as in
    :func:`_front_cuts`).

    Returns the cuts ``[cp + 1]`` and the moved ones as ``(position, head, tail)`` for
    :meth:`_Sequence.runs` (``None`` if there are none). Needs ``cp > 1`` and a sequence.
    """
    exact = front[1:-1]  # [cp - 1]
    d = seq.doc_at(exact)
    n, x = seq.lengths[d], exact - seq.starts[d]
    head, tail = (x + 1) // 2, x // 2  # the pair order's split
    # Candidates: K heads of whole tiles (i) times no tail or K tails that start on a tile (j)
    h = (head // TILE * TILE)[:, None] + _SNAP_STEPS  # [cp - 1, K]
    t = torch.cat([torch.zeros_like(h[:, :1]), (n - (n - tail) // TILE * TILE)[:, None] + _SNAP_STEPS], 1)
    took = h[:, :, None] + t[:, None, :]  # [cp - 1, K, K + 1]
    pos = (exact - x)[:, None, None] + took
    skip = skip[1:-1]  # [cp - 1] from a front cut to its back cut
    back = pos + skip[:, None, None]  # the back cut keeps ranks 0..r-1's tokens
    # 2 cp x (work of ranks 0..r-1 - their share) = by_h[i] - by_t[j] + by_took[i, j]: a head
    # on tiles does h (h + s) / 2, and a tail starting on one the rest of the document, whose
    # first n - t tokens do (n - t) (n - t + s) / 2
    s = seq.tile
    doc2 = (n * seq.rate[d])[:, None]  # twice the document's work (step 2)
    by_h = cp * (seq.work2_before[d][:, None] + h * (h + s)) - target2.cumsum(0)[:-1, None]
    by_t = cp * torch.where(t > 0, (n[:, None] - t) * (n[:, None] - t + s) - doc2, 0)
    # the back cuts' work: heads and tails step by a tile, so a back cut with a tail (j >= 1) is one of
    # 2K - 1 positions, i + j - 1 tiles past the first; counted there (and without one, at each head)
    k = h.shape[1]
    first = back[:, :, 1:2].select(1, 0)  # [cp - 1, 1]: i = 0, j = 1
    steps = torch.cat([back[:, :, 0], first + torch.arange(2 * k - 1) * TILE], 1)  # [cp - 1, 3K - 1]
    work2 = seq.prefix_work2(steps.clamp(0, seq.tokens))
    tiles_past = torch.arange(k)[:, None] + torch.arange(k)[None, :]  # [K, K]: i + j - 1, for j >= 1
    by_took = cp * (int(seq.work2_before[-1]) - torch.cat([work2[:, :k, None], work2[:, k + tiles_past]], 2))
    fits = (took <= n[:, None, None]) & (back <= seq.tokens) & ((x > 0) & (x < n))[:, None, None]
    fits &= (h >= 0)[:, :, None] & (t >= 0)[:, None, :]
    off = (by_h[:, :, None] - by_t[:, None, :] + by_took).abs()
    off = off.masked_fill_(~fits, torch.iinfo(off.dtype).max).flatten(1)  # [cp - 1, K (K + 1)] by i (K + 1) + j
    # each cut's _SNAP_TRIES candidates nearest the share (ties: the first), and whether within the slack
    tries = _least(off, _SNAP_TRIES)  # [cp - 1, M]
    ok = (off.gather(1, tries) <= cp * slack2).reshape(-1).tolist()  # [(cp - 1) M], cut-major
    i, j = tries // t.shape[1], tries % t.shape[1]
    pos = torch.cat([exact[:, None], pos.flatten(1).gather(1, tries)], 1)  # [cp - 1, 1 + M]: unmoved, then the tries
    g = pos + skip[:, None]  # their back cuts
    sides = seq.doc_at(torch.stack([g - 1, g], 2).clamp(0, seq.tokens - 1))  # [cp - 1, 1 + M, 2] each side's document
    heads, tails = torch.cat([head[:, None], h.gather(1, i)], 1), torch.cat([tail[:, None], t.gather(1, j)], 1)
    # Flat lists of ints, column c of cut r at r (1 + M) + c: nested lists (one per pair of sides) cost
    # more to make, and to collect, than the search itself
    w = 1 + _SNAP_TRIES
    pos, heads, tails, sides = (v.reshape(-1).tolist() for v in (pos, heads, tails, sides))
    d, take = d.tolist(), take.tolist()
    inner = [doc if 0 < a < b else None for doc, a, b in zip(d, x.tolist(), n.tolist(), strict=True)]

    # Cuts in order take the first try consistent with the cut before as placed and the one after
    # as is (it can always stay): the rank between them keeps its tokens, their splits nest where
    # both fall inside one document (`inner`), and no back cut falls in a moved cut's document.
    # sides[2 k], sides[2 k + 1]: the documents on either side of column k's back cut
    last_back = {}  # each document of the unmoved back cuts: the last cut whose back cut falls in it
    for r in range(cp - 1):
        last_back[sides[2 * r * w]] = last_back[sides[2 * r * w + 1]] = r
    choice, backs, moved = [0] * (cp - 1), set(), set()  # a column of pos, split and back_docs: 0 unmoved
    for r in range(cp - 1):
        doc = d[r]
        # a back cut before (as placed) or after (unmoved) falls in the cut's document: no try can move it
        if doc not in backs and last_back.get(doc, -1) <= r:
            if r:
                k = (r - 1) * w + choice[r - 1]
                before = (pos[k], (heads[k], tails[k]), inner[r - 1])
            else:
                before = (0, None, None)
            k = (r + 1) * w
            after = (pos[k], (heads[k], tails[k]), inner[r + 1]) if r < cp - 2 else (None, None, None)
            for m in range(1, _SNAP_TRIES + 1):
                if not ok[r * _SNAP_TRIES + m - 1]:
                    break  # and no later try is within the slack
                k = r * w + m
                p, left, right, split = pos[k], sides[2 * k], sides[2 * k + 1], (heads[k], tails[k])
                tokens = 0 <= p - before[0] <= take[r] and (after[0] is None or 0 <= after[0] - p <= take[r + 1])
                nest = (before[2] != doc or _nested(before[1], split)) and (after[2] != doc or _nested(split, after[1]))
                if tokens and nest and doc != left and doc != right and left not in moved and right not in moved:
                    choice[r] = m
                    moved.add(doc)
                    break
        k = r * w + choice[r]
        backs.add(sides[2 * k])
        backs.add(sides[2 * k + 1])
    at = [pos[r * w + choice[r]] for r in range(cp - 1)]
    splits = [(at[r], heads[r * w + c], tails[r * w + c]) for r, c in enumerate(choice) if c]
    return torch.tensor([0, *at, at[-1]]), tuple(torch.tensor(c) for c in zip(*splits)) or None


def _least(x: torch.Tensor, m: int) -> torch.Tensor:
    """``torch.argsort(x, dim=1, stable=True)[:, :m]`` (``x`` ``[R, N]`` int64): each row's ``m`` least,
    ties by index, found without sorting the rows: those below the ``m``-th least, then its ties."""
    if x.shape[1] <= m:
        return torch.argsort(x, dim=1, stable=True)
    kth = torch.topk(x, m, dim=1, largest=False).values.amax(1, keepdim=True)  # [R, 1] the m-th least
    below, tie = x < kth, x == kth
    keep = below | (tie & (tie.cumsum(1) <= m - below.sum(1, keepdim=True)))  # m in each row
    index = keep.nonzero()[:, 1].view(-1, m)  # by index
    return index.gather(1, torch.argsort(x.gather(1, index), dim=1, stable=True))


def _nested(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether split ``a`` (head, tail) lies inside split ``b`` of the same document."""
    return a[0] <= b[0] and a[1] <= b[1]


def balanced_layout(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    windows: tuple[int, ...] = (),
    cu_seqlens: torch.Tensor | None = None,
    backward: bool = True,
) -> torch.Tensor:
    """Every rank's physical positions under BALANCED, computed on the host.

    Args:
        cu_seqlens_padded: ``[B + 1]`` int32 physical offsets, total a multiple of ``cp_size``.
        windows: the layers' sliding windows (``StrategySpec.windows``; ``()``: causal layers). Where one
            is set, work is their pairs together (:func:`window_pairs`), and cuts are not moved to tiles
            (step 4 counts causal tiles).
        cu_seqlens: ``[B + 1]`` int32 real offsets, or ``None``. Given, each document's padding is a
            document of its own (:func:`free_padding`), dealt evenly before the real documents are laid
            out (step 0): a capacity's padding can be most of a rank, and counted as a document's causal
            work it left the ranks' real work uneven. ``None``: padded lengths are the documents' lengths.
        backward: step 5, forward + backward work even (the default); ``False``: steps 0-4, the forward's.
    Returns:
        ``[cp_size, T / cp_size]`` int64 on the device of ``cu_seqlens_padded``.
    """
    _, start, length = balanced_runs(cu_seqlens_padded, cp_size, windows, cu_seqlens, backward)
    # expanded outside inference mode: the layout indexes tensors that autograd may save
    total = int(length.sum())
    return _expand_runs(start, length, total).view(cp_size, total // cp_size).to(cu_seqlens_padded.device)


def balanced_runs(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    windows: tuple[int, ...] = (),
    cu_seqlens: torch.Tensor | None = None,
    backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`balanced_layout` as runs of consecutive positions, on the host: ``(rank, start, length)``,
    each ``[R]`` int64, non-empty, rank-major and in physical order within a rank; runs that touch are
    not joined. What counts per piece needs no layout token by token (:mod:`cpcompile.cost.model`).

    Kept for the latest :data:`RUNS_KEPT` packs (a pure function of the offsets' values): a step lays a
    pack out more than once on the host (``auto``'s decision, ``shard_batch``, the step's plan)."""
    with torch.inference_mode():  # integer work with nothing to record: no autograd bookkeeping
        cu_padded = cu_seqlens_padded.detach()
        if cu_seqlens is None:
            cu, free = cu_padded.cpu().long(), None
        else:  # one copy to the host for both
            both = torch.cat([cu_padded, cu_seqlens.detach().to(cu_padded)]).cpu().long()
            cu, free = free_padding(both[: cu_padded.shape[0]], both[cu_padded.shape[0] :])
        key = (cu.numpy().tobytes(), None if free is None else free.numpy().tobytes(), cp_size, tuple(windows))
        key += (backward,)
        if key in _runs:
            _runs.move_to_end(key)
            return _runs[key]
        runs = _runs[key] = _host_runs(cu, cp_size, tuple(windows), free, backward)
        while len(_runs) > RUNS_KEPT:
            _runs.popitem(last=False)
        return runs


#: Packs whose runs :func:`balanced_runs` keeps, by their offsets and arguments.
RUNS_KEPT = 8
_runs: collections.OrderedDict = collections.OrderedDict()


def free_padding(cu_padded: torch.Tensor, cu_real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents with their padding as documents of its own: ``(cu [D + 1], free [D])``, int64 physical
    offsets in physical order (a padding document right after its document) and which ones are padding.

    ``cu_padded``, ``cu_real``: ``[B + 1]`` int64 physical and real offsets; documents without padding keep
    one entry.
    """
    padded = cu_padded[1:] - cu_padded[:-1]
    real = cu_real[1:] - cu_real[:-1]
    lengths = torch.stack([real, padded - real], 1).reshape(-1)  # [2B]: each document, then its padding
    free = torch.arange(lengths.shape[0]) % 2 == 1
    keep = ~free | (lengths > 0)
    lengths, free = lengths[keep], free[keep]
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]), free


def backward_overhead(offset: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a piece of ``rows`` query rows, its first ``offset`` tokens into its document (int64 ``[P]``
    each): its forward tiles' area, and what its backward costs beyond that times ``BACKWARD_PER_PAIR_HALVES
    / 2``, in attention pairs of the forward (``[P]`` int64 each; step 5): the backward's ``BWD_ROWS x TILE``
    tiles against the forward's ``TILE x TILE`` ones, and ``KEY_BLOCK`` per key block the piece reads,
    from its document's start."""
    blocks = (rows + BWD_ROWS - 1) // BWD_ROWS  # [P] query blocks of the backward
    piece = torch.repeat_interleave(torch.arange(rows.shape[0]), blocks)
    b = torch.arange(piece.shape[0]) - torch.repeat_interleave(blocks.cumsum(0) - blocks, blocks)
    end = offset[piece] + torch.minimum((b + 1) * BWD_ROWS, rows[piece])  # each block's last row + 1
    bwd = torch.zeros_like(rows).index_add_(0, piece, (end + TILE - 1) // TILE) * (BWD_ROWS * TILE)
    fwd = causal_tiles(rows, offset) * (TILE * TILE)
    key_blocks = torch.where(rows > 0, (offset + rows + TILE - 1) // TILE, 0)  # an empty run reads nothing
    return fwd, (BACKWARD_PER_PAIR_HALVES * (bwd - fwd + key_blocks * KEY_BLOCK * BWD_ROWS * TILE) + 1) // 2


def _host_runs(
    cu: torch.Tensor,
    cp_size: int,
    windows: tuple[int, ...] = (),
    free: torch.Tensor | None = None,
    backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout's runs: ``(rank, start, length)`` ``[R]`` int64, non-empty, rank-major and in physical
    order within a rank (runs that touch are not joined), from ``cu`` ``[D + 1]`` int64.

    ``free``: ``[D]`` bool, the documents that are padding (:func:`free_padding`; ``None``: none). They
    are dealt first, so that every rank holds as many real tokens as without them (give or take one),
    and the steps lay out the real documents alone. ``backward``: step 5 (``False``: steps 0-4 alone).
    """
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    cp, t_local = cp_size, total // cp_size
    free = torch.zeros_like(lengths, dtype=torch.bool) if free is None else free
    real = int(lengths[~free].sum())
    # 0. the padding, dealt in order so that rank r keeps share[r] tokens for the documents
    share = real // cp + (torch.arange(cp) < real % cp).long()  # [cp]: t_local each without padding
    pad_rank, pad_start, pad_len = _deal_padding(cu, free, t_local - share)
    # longest first, ties by position; padding after every document (not dealt by step 1, not in the sequence)
    order = torch.sort(free.long() * (total + 1) - lengths, stable=True).indices
    by_len = lengths[order]
    documents = int((~free).sum())

    room = real // cp  # the least share of the real tokens (t_local without padding)
    first, dealt_rank = _deal_short(by_len[:documents], cp, room)
    dealt = order[first : first + dealt_rank.shape[0]]
    banded = any(w >= 0 for w in windows)
    on_tiles = cp > 1 and room >= SNAP_MIN_TOKENS and not banded  # work in kernel tiles, and step 4
    s = TILE if on_tiles else 1
    if banded:  # the layers' pairs together: a window caps each query's keys
        work2 = 2 * sum(window_pairs(lengths, w) for w in windows)
    else:
        work2 = 2 * s * s * causal_tiles(lengths, 0, s, s)  # [B] twice each document's work
    rate = -(-work2 // lengths.clamp(min=1))  # [B] twice the work per token, rounded up (pairs: L + 1)
    rest = torch.cat([order[:first], order[first + dealt.shape[0] : documents]])
    rest = rest[torch.sort(-rate[rest], stable=True).indices]  # densest first, then longest
    seq = _Sequence(lengths[rest], rate[rest], s, windows if banded else None)
    dealt_len = lengths[dealt]
    take = share - torch.zeros(cp, dtype=torch.long).index_add_(0, dealt_rank, dealt_len)
    dealt_work2 = torch.zeros(cp, dtype=torch.long).index_add_(0, dealt_rank, dealt_len * rate[dealt])
    total2 = int(seq.work2_before[-1] + dealt_work2.sum())
    target2 = total2 - cp * dealt_work2
    skip = seq.tokens - torch.cat([take.new_zeros(1), take.cumsum(0)])  # [cp + 1] G_r - F_r: every rank gets `take`

    def cut(target2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Steps 3 and 4 for ``target2``: the runs ``(segment, document, first, length)`` of the sequence."""
        front, splits = _front_cuts(seq, cp, take, skip, target2), None
        if on_tiles and seq.tokens:
            front, splits = _align(seq, cp, take, skip, target2, front, total2 // (cp * SNAP_SLACK))
        back = front + skip
        # ranges in the order (rank 0 front, rank 0 back, rank 1 front, ...)
        starts = torch.stack([front[:-1], back[1:]], 1).reshape(-1)
        ends = torch.stack([front[1:], back[:-1]], 1).reshape(-1)
        return seq.runs(starts, ends, splits)

    if backward and on_tiles and seq.tokens and cp > 1:
        seg, doc, run_first, run_len = _even_backward(cut, target2, dealt_rank, dealt_len, cp)
    else:
        seg, doc, run_first, run_len = cut(target2)
    run_rank = torch.cat([seg // 2, dealt_rank, pad_rank])
    run_start = torch.cat([cu[rest[doc]] + run_first, cu[dealt], pad_start])
    run_len = torch.cat([run_len, dealt_len, pad_len])
    keep = run_len > 0
    run_rank, run_start, run_len = run_rank[keep], run_start[keep], run_len[keep]
    sort = torch.argsort(run_rank * (total + 1) + run_start)  # rank-major, then physical order
    return run_rank[sort], run_start[sort], run_len[sort]


def _even_backward(
    cut: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    target2: torch.Tensor,
    dealt_rank: torch.Tensor,
    dealt_len: torch.Tensor,
    cp: int,
) -> tuple[torch.Tensor, ...]:
    """Step 5: the runs ``cut(target)`` gives (steps 3-4 for a target of twice the work per rank
    ``[cp + 1]``, ``target2`` the forward's) for the target whose busiest rank's forward + backward work is
    least, among ``BACKWARD_PASSES`` re-cuts whose busiest rank's forward stays within ``1 / FORWARD_SLACK``
    of the first cut's. ``dealt_rank``, ``dealt_len`` ``[S]``: the whole short documents steps 1-2 dealt."""
    zero_offsets = torch.zeros_like(dealt_len)

    def priced(runs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per rank ``[cp]``: twice its forward + backward work (its forward tiles' area, that times
        ``BACKWARD_PER_PAIR_HALVES / 2``, and the backward's overhead), and its forward tiles' area."""
        seg, _, run_first, run_len = runs
        fwd, over = backward_overhead(torch.cat([run_first, zero_offsets]), torch.cat([run_len, dealt_len]))
        ranks, per_rank = torch.cat([seg // 2, dealt_rank]), torch.zeros(cp, dtype=torch.long)
        both = (2 + BACKWARD_PER_PAIR_HALVES) * fwd + 2 * over
        return per_rank.index_add(0, ranks, both), per_rank.index_add(0, ranks, fwd)

    best = cut(target2)
    cost, fwd = priced(best)
    least, moved = int(cost.max()), target2
    fwd_cap = int(fwd.max()) * (FORWARD_SLACK + 1) // FORWARD_SLACK  # the forward may not get slower
    for _ in range(BACKWARD_PASSES):
        if bool((cost == cost[0]).all()):
            break
        # each rank's share of the forward work moves by its distance from the mean forward + backward
        # work, priced as that: 2 cp (mean - cost_r) / 2 / ((2 + BACKWARD_PER_PAIR_HALVES) / 2), exact in int64
        moved = moved + 2 * (int(cost.sum()) - cp * cost) // (2 + BACKWARD_PER_PAIR_HALVES)
        runs = cut(moved)
        cost, fwd = priced(runs)
        if int(cost.max()) < least and int(fwd.max()) <= fwd_cap:
            best, least = runs, int(cost.max())
    return best


def _deal_padding(cu: torch.Tensor, free: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Step 0: the padding documents (``free`` of ``cu``) read in order, rank ``r`` taking the next ``pad[r]``
    tokens: ``(rank, start, length)`` of the runs, physical starts."""
    lengths = (cu[1:] - cu[:-1])[free]
    starts = cu[:-1][free]
    in_docs = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # [F + 1] offsets in the padding read in order
    in_ranks = torch.cat([pad.new_zeros(1), pad.cumsum(0)])  # [cp + 1]
    cuts = torch.unique(torch.cat([in_docs, in_ranks]))  # sorted: every run between two consecutive cuts
    first, length = cuts[:-1], cuts[1:] - cuts[:-1]
    doc = torch.searchsorted(in_docs, first, right=True) - 1
    rank = torch.searchsorted(in_ranks, first, right=True) - 1
    return rank, starts[doc] + first - in_docs[doc], length


def _expand_runs(start: torch.Tensor, length: torch.Tensor, total: int) -> torch.Tensor:
    """Runs ``[start, start + length)`` (all non-empty) back to back: ``[total]`` int64, on the host.

    Each run's start less its offset, repeated over it, plus the offsets: numpy's, which write the
    ``T`` values in fewer passes than torch's ops (the layout is the one tensor of ``T`` here)."""
    start, length = start.numpy(), length.numpy()
    held = np.repeat(start - (np.cumsum(length) - length), length)
    held += np.arange(total, dtype=held.dtype)
    return torch.from_numpy(held)

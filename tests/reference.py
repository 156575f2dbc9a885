"""Independent float64 references: attention one document at a time, layouts by brute force."""

from __future__ import annotations

import torch

from cpcompile.batch import physical_positions


def window_mask(n: int, window: tuple[int, int], device=None) -> torch.Tensor:
    """``[n, n]`` bool, True where query ``i`` of a document may see key ``j``: ``i - left <= j <= i + right``
    (``varlen_attn``'s window; -1 unbounded)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    left, right = window
    return ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))


def attention_fp64(
    q, k, v, cu_seqlens, *, causal: bool, cu_seqlens_padded=None, scale=None, window=None, softcap=None, sinks=None
) -> torch.Tensor:
    """Plain softmax attention per document in float64; padding rows stay 0.

    q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]`` in physical order -> ``[T, Hq, Dv]`` float64.
    ``window``: ``(left, right)`` (:func:`window_mask`), instead of ``causal``. ``softcap``: scores
    become ``softcap * tanh(s / softcap)`` before the mask. ``sinks``: ``[Hq]`` logits, one more term
    ``exp(sinks[h])`` in each query's softmax denominator (a key of no value).
    """
    q, k, v = q.double(), k.double(), v.double()
    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_zeros((*q.shape[:2], v.shape[-1]))
    for d in range(len(cu_seqlens) - 1):
        n = int(cu_seqlens[d + 1] - cu_seqlens[d])
        a = int(padded[d])
        if n == 0:
            continue
        qd = q[a : a + n].transpose(0, 1)  # [Hq, n, D]
        kd = k[a : a + n].repeat_interleave(group, 1).transpose(0, 1)
        vd = v[a : a + n].repeat_interleave(group, 1).transpose(0, 1)
        s = qd @ kd.transpose(-1, -2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s = s.masked_fill(~window_mask(n, window, s.device), float("-inf"))
        elif causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        if sinks is not None:  # [Hq, n, n + 1]: the sink's column joins the softmax, then is dropped
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, n, 1)], -1)
        out[a : a + n] = (s.softmax(-1)[..., :n] @ vd).transpose(0, 1)
    return out


def attention_fp64_on_rank(
    cu_seqlens, sharded, tensors, *, causal: bool, window=None, sinks=None, softcap=None
) -> list[torch.Tensor]:
    """:func:`attention_fp64` on the whole padded pack, output and q/k/v gradients, at this rank's rows.

    ``tensors``: the whole pack's ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]``, ``v`` ``[T, Hkv, Dv]`` and ``dout``
    ``[T, Hq, Dv]`` (real tokens, as ``shard_batch`` takes them); ``sharded``: this rank's ``ShardedBatch``.
    Returns ``[out, dq, dk, dv]`` float64, each ``[T_local, H, D]`` (rows ``sharded.indices``); with
    ``sinks`` (``[Hq]``), their gradient ``[Hq]`` over the whole pack too, last.
    """
    padded = sharded.cu_seqlens_padded
    phys = physical_positions(cu_seqlens, padded)
    n = int(padded[-1])

    def physical(t):  # [T, H, D] -> [n, H, D]: real tokens at their padded positions, zeros between
        return t.new_zeros((n, *t.shape[1:])).index_copy_(0, phys, t).double()

    leaves = [physical(tensors[name]).requires_grad_() for name in "qkv"]
    sink = [] if sinks is None else [sinks.detach().double().requires_grad_()]
    kw = {"causal": causal, "cu_seqlens_padded": padded, "window": window, "softcap": softcap}
    out = attention_fp64(*leaves, cu_seqlens, sinks=(sink or [None])[0], **kw)
    grads = torch.autograd.grad(out, leaves + sink, physical(tensors["dout"]))
    return [t[sharded.indices] for t in (out, *grads[:3])] + list(grads[3:])


def layout_brute_force(doc_lengths_padded: list[int], cp: int, rank: int, strategy: str, stripe: int = 1) -> list[int]:
    """The physical positions rank ``rank`` holds, from the strategies' definitions."""
    total = sum(doc_lengths_padded)
    if cp == 1:
        return list(range(total))
    if strategy == "no_load_balance":
        n = total // cp
        return list(range(rank * n, (rank + 1) * n))
    if strategy == "striped":
        return [t for t in range(total) if (t // stripe) % cp == rank]
    if strategy == "balanced":
        return balanced_brute_force(doc_lengths_padded, cp)[rank]
    held, start = [], 0
    for length in doc_lengths_padded:
        c = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            held += range(start + chunk * c, start + (chunk + 1) * c)
        start += length
    return held


def _tile_area(first: int, end: int, tile: int) -> int:
    """The key tiles' area that query rows ``[first, end)`` of a document visit, query tiles from
    ``first`` and key tiles from the document's start: one tile at a time."""
    area = 0
    for row in range(first, end, tile):
        last = min(row + tile, end) - 1  # the tile's last row sees keys 0..last
        area += tile * tile * -(-(last + 1) // tile)
    return area


def balanced_brute_force(
    lengths: list[int],
    cp: int,
    tile: int = 128,
    snap_tiles: int = 10,
    slack: int = 128,
    min_tokens: int = 11264,
    tries: int = 32,
    free: list[bool] | None = None,
):
    """Every rank's positions under BALANCED, from the steps in ``cpcompile/layouts/balanced.py``, one token at a time.

    ``free``: per document, whether it is padding (``balanced.free_padding``, a capacity's): dealt first, in
    order, each rank taking what leaves it its share of the real tokens; the steps lay out the rest."""
    free = [False] * len(lengths) if free is None else free
    total = sum(lengths)
    t = total // cp
    real = sum(n for n, f in zip(lengths, free, strict=True) if not f)
    room = real // cp  # the least share of the real tokens
    s = tile if cp > 1 and room >= min_tokens else 1  # work counts kernel tiles of s x s (pairs when s = 1)
    work2 = [0 if f else 2 * _tile_area(0, n, s) for n, f in zip(lengths, free, strict=True)]
    rate = [-(-w // n) if n else 0 for w, n in zip(work2, lengths, strict=True)]  # twice the work per token
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda d: (free[d], -lengths[d], d))
    held = [[] for _ in range(cp)]
    # 0. the padding in order, each rank taking what leaves it its share of the real tokens
    padding = [p for d in range(len(lengths)) if free[d] for p in range(starts[d], starts[d] + lengths[d])]
    for r in range(cp):
        n = t - (real // cp + (r < real % cp))
        held[r], padding = padding[:n], padding[n:]
    padded = [len(h) for h in held]
    dealt_work2 = [0] * cp
    # 1. documents of 1 to 4 tiles - 1 tokens, dealt whole in snake-order rounds while every rank has room
    # within its share of the real tokens
    short = [d for d in order if 0 < lengths[d] < 4 * tile and not free[d]]
    dealt = set()
    for k in range(len(short) // cp):
        ranks = range(cp) if k % 2 == 0 else range(cp - 1, -1, -1)
        docs = short[k * cp : (k + 1) * cp]
        if any(len(held[r]) - padded[r] + lengths[d] > room for r, d in zip(ranks, docs, strict=True)):
            break
        for r, d in zip(ranks, docs, strict=True):
            held[r] += range(starts[d], starts[d] + lengths[d])
            dealt_work2[r] += lengths[d] * rate[d]
            dealt.add(d)
    # 2. the rest, densest first (then longest), each in pair order 0, L-1, 1, L-2, ...; each token
    # counted at rate / 2, so a prefix's count never falls
    seq, seq_doc, count2 = [], [], [0]
    for d in sorted((d for d in order if d not in dealt and not free[d]), key=lambda d: -rate[d]):  # stable
        n = lengths[d]
        for k in range(n):
            seq.append(starts[d] + (k // 2 if k % 2 == 0 else n - 1 - k // 2))
            seq_doc.append(d)
            count2.append(count2[-1] + rate[d])
    # 3. rank r takes a front and a back range: the cut before rank r is the smallest F at which ranks
    # 0..r-1 (F tokens from the front, the rest from the back) have r / cp of the total work
    total2 = sum(n * r for n, r in zip(lengths, rate, strict=True))
    take = [t - len(h) for h in held]
    taken = [sum(take[:r]) for r in range(cp + 1)]
    wanted = [r * total2 - cp * sum(dealt_work2[:r]) for r in range(cp + 1)]
    cuts = [0]
    for r in range(1, cp):
        f = next(
            (
                f
                for f in range(taken[r] + 1)
                if cp * (count2[f] + count2[-1] - count2[f + len(seq) - taken[r]]) >= wanted[r]
            ),
            taken[r],
        )
        cuts.append(min(max(f, cuts[-1]), cuts[-1] + take[r - 1]))
    cuts.append(cuts[-1])
    slack2 = total2 // (cp * slack)
    snap = seq and s > 1
    # 4. each front cut tries the splits of its document into whole head tiles and no tail or one starting
    # on a tile, up to snap_tiles either side of the pair order's (the head's and tail's tile areas, the
    # tail taking the rest of the document's count), with the back cut moved by as many tokens; cuts in
    # order take the first of their `tries` splits nearest the share (ties: head, then tail, ascending)
    # that is within W / slack of it and keeps the rank before within its tokens, the document's splits
    # nested and every back cut out of the moved cuts' documents
    doc_start = {}
    for p, d in enumerate(seq_doc):
        doc_start.setdefault(d, p)

    def doc_at(p):
        return seq_doc[min(max(p, 0), len(seq) - 1)]

    def pair_split(p):  # (head, tail) tokens before p of its document in pair order
        x = p - doc_start[doc_at(p)]
        return (x + 1) // 2, x // 2

    def inner(p):  # the document a cut falls strictly inside, if any
        x = p - doc_start[doc_at(p)]
        return doc_at(p) if 0 < x < lengths[doc_at(p)] else None

    def back_docs(f, r):  # the documents each side of the back cut of front cut f before rank r
        g = f + len(seq) - taken[r]
        return {doc_at(min(max(e, 0), len(seq) - 1)) for e in (g - 1, g)}

    options = {}  # r -> [(position, head, tail), ...]: the tries within the slack, nearest the share first
    for r in range(1, cp if snap else 1):
        f = cuts[r]
        d = doc_at(f)
        n, x = lengths[d], f - doc_start[d]
        if not 0 < x < n:
            continue
        found = []
        for i in range(-snap_tiles, snap_tiles + 2):
            tails = [n - (n - x // 2) // tile * tile + k * tile for k in range(-snap_tiles, snap_tiles + 2)]
            for j, tl in enumerate([0, *tails]):
                h = ((x + 1) // 2) // tile * tile + i * tile
                pos = f - x + h + tl
                back = pos + len(seq) - taken[r]
                if h < 0 or tl < 0 or h + tl > n or back > len(seq):
                    continue
                split2 = 2 * _tile_area(0, h, s) + (n * rate[d] - 2 * _tile_area(0, n - tl, s) if tl else 0)
                off = abs(cp * (count2[f - x] + split2 + count2[-1] - count2[back]) - wanted[r])
                found.append((off, i, j, pos, h, tl))
        found.sort()
        options[r] = [o[3:] for o in found[:tries] if o[0] <= cp * slack2]
    # cuts in order, each checked against the cut before as placed and the cut after unmoved
    moves = {}
    for r in range(1, cp if snap else 1):
        before = moves.get(r - 1, (cuts[r - 1], *pair_split(cuts[r - 1]))) if r > 1 else None
        after = (cuts[r + 1], *pair_split(cuts[r + 1])) if r < cp - 1 else None
        for pos, h, tl in options.get(r, []):
            fits = (before is None and pos <= take[0]) or (before and 0 <= pos - before[0] <= take[r - 1])
            fits = fits and (after is None or 0 <= after[0] - pos <= take[r])
            for other, lo, hi in ((before, r - 1, r), (after, r, r + 1)):
                if other and inner(cuts[lo]) is not None and inner(cuts[lo]) == inner(cuts[hi]):
                    first, second = ((other[1], other[2]), (h, tl)) if lo < r else ((h, tl), (other[1], other[2]))
                    fits = fits and first[0] <= second[0] and first[1] <= second[1]
            placed = [moves[q][0] if q in moves else cuts[q] for q in range(1, r)] + [pos] + cuts[r + 1 : cp]
            backs = {doc for q, f in enumerate(placed, 1) for doc in back_docs(f, q)}
            if fits and doc_at(cuts[r]) not in backs and not {doc_at(cuts[q]) for q in moves} & back_docs(pos, r):
                moves[r] = (pos, h, tl)
                break
    at = [0] + [moves[r][0] if r in moves else cuts[r] for r in range(1, cp)]
    at.append(at[-1])
    assert all(0 <= at[r + 1] - at[r] <= take[r] for r in range(cp))  # every rank within its tokens
    if snap:  # nested splits in a document, and back cuts out of the moved cuts' documents
        split = {r: moves[r][1:] if r in moves else pair_split(cuts[r]) for r in range(1, cp)}
        for r in range(1, cp - 1):
            if inner(cuts[r]) is not None and inner(cuts[r]) == inner(cuts[r + 1]):
                assert split[r][0] <= split[r + 1][0] and split[r][1] <= split[r + 1][1]
        assert not {doc_at(cuts[r]) for r in moves} & {doc for r in range(1, cp) for doc in back_docs(at[r], r)}
    splits = {moves[r][0]: moves[r][1:] for r in moves}  # sequence position -> (head, tail)

    # the tokens of document d before sequence position p: a moved cut's split, else the pair order's
    def before(d, p):
        if p in splits and doc_start[d] < p < doc_start[d] + lengths[d]:
            h, tl = splits[p]
            return {starts[d] + q for q in [*range(h), *range(lengths[d] - tl, lengths[d])]}
        y = min(max(p - doc_start[d], 0), lengths[d])
        return set(seq[doc_start[d] : doc_start[d] + y])

    def tokens(a, b):
        held = []
        for d in dict.fromkeys(seq_doc[a:b]):
            assert before(d, a) <= before(d, b), "a document's splits must nest"
            held += before(d, b) - before(d, a)
        return held

    for r in range(cp):
        back_end = at[r] + len(seq) - taken[r]
        held[r] += tokens(at[r], at[r + 1]) + tokens(back_end - (take[r] - at[r + 1] + at[r]), back_end)
    return [sorted(h) for h in held]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (0 when both are 0)."""
    scale = expected.abs().max().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / scale if scale else diff


def assert_attention_matches(got, want, tolerance: float, label: str, dtype=None) -> None:
    """``got`` and ``want``: ``[out, dq, dk, dv]``; each within ``tolerance`` (relative), and in ``dtype`` if given."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert dtype is None or a.dtype == dtype, f"{name} dtype {a.dtype}, {label}"
        assert relative_error(a, b) < tolerance, f"{name}, {label}"

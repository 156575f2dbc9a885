"""Independent float64 references: attention one document at a time, layouts by brute force."""

from __future__ import annotations

import torch

from cpcompile import Strategy, StrategySpec

# every concrete layout, with a stripe size that does not divide typical lengths
LAYOUT_SPECS = [
    StrategySpec(Strategy.DUAL_CHUNK_SWAP),
    StrategySpec(Strategy.NO_LOAD_BALANCE),
    StrategySpec(Strategy.STRIPED),
    StrategySpec(Strategy.STRIPED, stripe_size=3),
    StrategySpec(Strategy.BALANCED),
]


def attention_fp64(q, k, v, cu_seqlens, *, causal: bool, cu_seqlens_padded=None, scale=None) -> torch.Tensor:
    """Plain softmax attention per document in float64; padding rows stay 0.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` in physical order -> ``[T, Hq, D]`` float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for d in range(len(cu_seqlens) - 1):
        n = int(cu_seqlens[d + 1] - cu_seqlens[d])
        a = int(padded[d])
        if n == 0:
            continue
        qd = q[a : a + n].transpose(0, 1)  # [Hq, n, D]
        kd = k[a : a + n].repeat_interleave(group, 1).transpose(0, 1)
        vd = v[a : a + n].repeat_interleave(group, 1).transpose(0, 1)
        s = qd @ kd.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        out[a : a + n] = (s.softmax(-1) @ vd).transpose(0, 1)
    return out


def layout_brute_force(doc_lengths_padded: list[int], cp: int, rank: int, strategy: str, stripe: int = 1) -> list[int]:
    """The physical positions rank ``rank`` holds, from the strategies' definitions."""
    total = sum(doc_lengths_padded)
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


def balanced_brute_force(lengths: list[int], cp: int, tile: int = 128, snap_tiles: int = 10, slack: int = 256):
    """Every rank's positions under BALANCED, from the steps in ``cpcompile/balanced.py``, one token at a time."""
    total = sum(lengths)
    t = total // cp
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    held = [[] for _ in range(cp)]
    dealt_work = [0] * cp
    # 1. documents of 1 to 4 tiles - 1 tokens, dealt whole in snake-order rounds while every rank has room
    short = [d for d in order if 0 < lengths[d] < 4 * tile]
    dealt = set()
    for k in range(len(short) // cp):
        ranks = range(cp) if k % 2 == 0 else range(cp - 1, -1, -1)
        docs = short[k * cp : (k + 1) * cp]
        if any(len(held[r]) + lengths[d] > t for r, d in zip(ranks, docs, strict=True)):
            break
        for r, d in zip(ranks, docs, strict=True):
            held[r] += range(starts[d], starts[d] + lengths[d])
            dealt_work[r] += lengths[d] * (lengths[d] + 1) // 2
            dealt.add(d)
    # 2. the rest, longest first, each in pair order 0, L-1, 1, L-2, ...; twice each token's
    # work counted as L + 1 (its document's mean), so a prefix's count never falls
    seq, seq_doc, count2 = [], [], [0]
    for d in order:
        if d not in dealt:
            n = lengths[d]
            for k in range(n):
                seq.append(starts[d] + (k // 2 if k % 2 == 0 else n - 1 - k // 2))
                seq_doc.append(d)
                count2.append(count2[-1] + n + 1)
    # 3. rank r takes a front and a back range: the cut before rank r is the smallest F at which ranks
    # 0..r-1 (F tokens from the front, the rest from the back) have r / cp of the total work
    work = sum(n * (n + 1) // 2 for n in lengths)
    take = [t - len(h) for h in held]
    taken = [sum(take[:r]) for r in range(cp + 1)]
    wanted = [2 * (r * work - cp * sum(dealt_work[:r])) for r in range(cp + 1)]
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
    # 4. each front cut tries the splits of its document into whole head tiles and a tail starting on
    # a tile, up to snap_tiles either side of the pair order's, for the one nearest the share of work
    # with the back cut moved by as many tokens; it moves where that is within W / slack
    at, doc_start = cuts, {}
    for p, d in enumerate(seq_doc):
        doc_start.setdefault(d, p)

    def doc_at(p):
        return seq_doc[min(max(p, 0), len(seq) - 1)]

    def pair_split(p):  # (head, tail) tokens before p of its document in pair order
        x = p - doc_start[doc_at(p)]
        return (x + 1) // 2, x // 2

    twice_before = {}  # document length -> twice the work of its first q tokens, q = 0..n, token by token
    for n in set(lengths):
        twice_before[n] = [0]
        for q in range(n):
            twice_before[n].append(twice_before[n][-1] + 2 * (q + 1))
    moves = {}
    for r in range(1, cp if seq and t >= 8 * (snap_tiles + 1) * tile else 1):
        f = cuts[r]
        d = doc_at(f)
        n, x = lengths[d], f - doc_start[d]
        if not 0 < x < n:
            continue
        best = None
        for i in range(-snap_tiles, snap_tiles + 2):
            for j in range(-snap_tiles, snap_tiles + 2):
                h = ((x + 1) // 2) // tile * tile + i * tile
                tl = n - (n - x // 2) // tile * tile + j * tile
                pos = f - x + h + tl
                back = pos + len(seq) - taken[r]
                if h < 0 or tl < 0 or h + tl > n or back < pos or back > len(seq):
                    continue
                twice = count2[f - x] + twice_before[n][h] + twice_before[n][n] - twice_before[n][n - tl]
                off = abs(cp * (twice + count2[-1] - count2[back]) - wanted[r])
                if best is None or off < best[0]:
                    best = (off, pos, h, tl)
        if best is not None and best[0] <= 2 * cp * (work // (cp * slack)):
            moves[r] = best[1:]
    while seq:  # undo moves that break ranks' token counts, a document's cut order or meet a back cut
        at = [0] + [moves[r][0] if r in moves else cuts[r] for r in range(1, cp)]
        at.append(at[-1])
        split = {r: moves[r][1:] if r in moves else pair_split(cuts[r]) for r in range(1, cp)}
        near = {doc_at(g) for r in range(1, cp) for g in (at[r] + len(seq) - taken[r] + e for e in (-1, 0))}
        bad = set()
        for r in moves:
            fronts_fit = 0 <= at[r] - at[r - 1] <= take[r - 1] and 0 <= at[r + 1] - at[r] <= take[r]
            if not fronts_fit or doc_at(cuts[r]) in near:
                bad.add(r)
        for r in range(1, cp - 1):
            if doc_at(cuts[r]) == doc_at(cuts[r + 1]) and any(a > b for a, b in zip(split[r], split[r + 1])):
                bad |= {r, r + 1} & moves.keys()
        if not bad:
            break
        for r in bad:
            del moves[r]

    # the tokens of document d before sequence position p: a moved cut's split, else the pair order's
    def before(d, p):
        if p in {moves[r][0] for r in moves} and doc_start[d] < p < doc_start[d] + lengths[d]:
            _, h, tl = next(moves[r] for r in moves if moves[r][0] == p)
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

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


def balanced_brute_force(lengths: list[int], cp: int, tile: int = 128) -> list[list[int]]:
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
    seq, count2 = [], [0]
    for d in order:
        if d not in dealt:
            n = lengths[d]
            for k in range(n):
                seq.append(starts[d] + (k // 2 if k % 2 == 0 else n - 1 - k // 2))
                count2.append(count2[-1] + n + 1)
    # 3. rank r takes a front and a back range: the cut before rank r is the smallest F at which ranks
    # 0..r-1 (F tokens from the front, the rest from the back) have r / cp of the total work
    work = sum(n * (n + 1) // 2 for n in lengths)
    take = [t - len(h) for h in held]
    cuts = [0]
    for r in range(1, cp):
        taken = sum(take[:r])
        wanted = 2 * (r * work - cp * sum(dealt_work[:r]))
        f = next(
            (f for f in range(taken + 1) if cp * (count2[f] + count2[-1] - count2[f + len(seq) - taken]) >= wanted),
            taken,
        )
        cuts.append(min(max(f, cuts[-1]), cuts[-1] + take[r - 1]))
    cuts.append(cuts[-1])
    for r in range(cp):
        back_end = cuts[r] + len(seq) - sum(take[:r])
        held[r] += seq[cuts[r] : cuts[r + 1]] + seq[back_end - (take[r] - cuts[r + 1] + cuts[r]) : back_end]
    return [sorted(h) for h in held]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (0 when both are 0)."""
    scale = expected.abs().max().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / scale if scale else diff

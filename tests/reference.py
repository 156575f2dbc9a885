"""Independent float64 references: attention one document at a time, layouts by brute force."""

from __future__ import annotations

import torch


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
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
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
    held, start = [], 0
    for length in doc_lengths_padded:
        c = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            held += range(start + chunk * c, start + (chunk + 1) * c)
        start += length
    return held


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (0 when both are 0)."""
    scale = expected.abs().max().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / scale if scale else diff

"""What the attention ops share: fake-tensor checks, output allocation, the softmax
scale, the accumulation dtype, and the agreement an op runs where no wrapper ran one."""

from __future__ import annotations

import torch

from ..checks import agreement_enabled
from ..comm.groups import agree, already_agreed, digest


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def check_fake_qkv(q, k, v) -> None:
    torch._check(q.dim() == 3 and k.dim() == 3, lambda: f"q, k must be [T, H, D], got {q.shape}, {k.shape}")
    torch._check(k.shape == v.shape, lambda: f"k {k.shape} and v {v.shape} must match")
    torch._check(q.shape[2] == k.shape[2], lambda: f"head_dim of q {q.shape} and k {k.shape} differ")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What sums and ``lse`` are kept in: float32, or float64 for float64 inputs (so that float64
    runs are exact to float64, not to the float32 of a statistic)."""
    return torch.promote_types(dtype, torch.float32)


def out_and_lse(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=accumulation_dtype(q.dtype))


def op_record(op: str, q, k, causal: bool, scale, layout: torch.Tensor | None, config: dict) -> dict[str, object]:
    """What every rank must agree on when a compiled graph calls a CP attention op directly
    (no :func:`cp_attention` wrapper compared the call): the op (its collectives), the
    shapes, the mask, and the layout (``gather_index`` is the same on every rank)."""
    return {
        "op (comm)": op,
        "local tokens (q.shape[0])": q.shape[0],
        "q/k/v heads and head_dim": (q.shape[1], k.shape[1], q.shape[2]),
        "dtype": str(q.dtype),
        "causal": causal,
        "scale": scale,
        "layout (strategy and cu_seqlens)": None if layout is None else digest(layout),
        **config,
    }


def agree_in_op(op: str, group, q, k, causal: bool, scale, layout: torch.Tensor | None, config: dict) -> None:
    """An op's own agreement, where no wrapper ran one for this call."""
    if not already_agreed() and agreement_enabled(group, q):
        agree(group, None, op_record(op, q, k, causal, scale, layout, config))

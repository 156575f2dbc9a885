"""``balanced_layout`` as an op, so that compiled graphs call the host algorithm of
:mod:`cpcompile.layouts.balanced` (its cuts depend on the document lengths) with a symbolic size."""

from __future__ import annotations

import torch

from cpcompile.cache import NOT_CAPTURED
from cpcompile.layouts.balanced import balanced_layout


@torch.library.custom_op("cpcompile::balanced_layout", mutates_args=(), tags=NOT_CAPTURED)
def balanced_layout_op(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    num_tokens: int,
    windows: list[int] | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`cpcompile.layouts.balanced.balanced_layout` as an op: ``[cp_size, num_tokens / cp_size]`` int64."""
    return balanced_layout(cu_seqlens_padded, cp_size, tuple(windows or ()), cu_seqlens)


@balanced_layout_op.register_fake
def _(cu_seqlens_padded, cp_size, num_tokens, windows=None, cu_seqlens=None):
    return cu_seqlens_padded.new_empty((cp_size, num_tokens // cp_size), dtype=torch.int64)

"""Per-step metadata of ring attention: where each piece's keys lie in a visiting K/V block.

Ring attention (docs/design.md, "How K/V move") keeps queries in place and passes every rank's
K/V block around the ring, in that rank's storage order. The pieces are those of the
:class:`~cpcompile.plan.pieces.AttentionPlan`; per block, only where their keys sit changes.

Design constraint: every layout stores a rank's positions in ascending physical order
(documents in order, each document's tokens ascending). So the keys a piece sees,
the physical range ``[k_start, k_start + k_len)`` of the plan, form one contiguous
run of rows in any block: from the number of the block's positions below
``k_start`` to the number below ``k_start + k_len``. Two cases cover every step:

- the rank's own block: the run ends with the piece's own rows, in order, so the
  kernel's bottom-right causal alignment is exact (the plan's rule, local keys);
- another rank's block holds none of the piece's positions, so every row of a causal
  piece sees the same keys, those before the piece: a full (non-causal) call.

Each ring step is thus one kernel call over all pieces, causal only for the own block,
and a pure function of the plan: sizes are static (``[cp, P]``), nothing is read on
the host, so it traces like :func:`cpcompile.plan.make_plan`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cpcompile.cache import per_plan
from cpcompile.plan.pieces import check_plan_arguments, layout_of, plan_of
from cpcompile.spec import StrategyLike


class RingPlan(NamedTuple):
    """What one rank needs to run ring attention (``P`` piece slots; block ``s`` = rank ``s``'s K/V).

    - ``cu_q``: ``[P + 1]`` int32, local query offsets of the pieces (as in :class:`AttentionPlan`).
    - ``k_start``: ``[cp, P]`` int32, row of block ``s`` where piece ``p``'s keys start.
    - ``k_len_causal``: ``[cp, P]`` int32, keys of block ``s`` piece ``p`` sees when causal
      (bottom-right aligned in the own block, all rows alike in the others).
    - ``k_len_full``: ``[cp, P]`` int32, keys of block ``s`` piece ``p`` sees when not causal.
    - ``cu_seqlens``, ``cu_seqlens_padded``: ``[B + 1]`` int32, the pack's offsets the plan was made
      from (as in :class:`AttentionPlan`: what ``cp_attention`` checks a caller's plan against).
    """

    cu_q: torch.Tensor
    k_start: torch.Tensor
    k_len_causal: torch.Tensor
    k_len_full: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor

    def k_len(self, causal: bool) -> torch.Tensor:
        return self.k_len_causal if causal else self.k_len_full


def block_positions(gather_index: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``[cp, T_local]`` int64: the physical positions of every rank's block, each row ascending."""
    return layout_of(gather_index, cp_size)


def block_key_ranges(
    gather_index: torch.Tensor, k_start: torch.Tensor, k_lens: tuple[torch.Tensor, ...], *, cp_size: int
) -> tuple[torch.Tensor, ...]:
    """Physical key ranges of the pieces, as row ranges of every rank's block.

    Args:
        gather_index: ``[T]`` int64, the plan's all-gather row of each physical position.
        k_start: ``[P]`` int32, first physical key of each piece; ``k_lens``: ``[P]`` int32 each.
    Returns:
        ``(start, *lengths)``, each ``[cp, P]`` int32: piece ``p``'s keys are rows
        ``[start[s, p], start[s, p] + length[s, p])`` of rank ``s``'s block.
    """
    layout = block_positions(gather_index, cp_size)

    def rows_below(positions: torch.Tensor) -> torch.Tensor:  # [P] -> [cp, P]
        return torch.searchsorted(layout, positions.expand(cp_size, -1).contiguous())

    lo = k_start.long()
    start = rows_below(lo)
    lengths = (rows_below(lo + k_len.long()) - start for k_len in k_lens)
    return start.to(torch.int32), *(n.to(torch.int32) for n in lengths)


@per_plan
def ring_window_plan(gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, cp_size: int):
    """The ring's metadata of windowed pieces (``k_start``, ``k_len`` ``[P]``: physical keys,
    :func:`cpcompile.plan.window.window_keys`), once per plan: ``(start, length)`` ``[cp, P]`` int32 as
    :func:`block_key_ranges`, and the blocks' positions ``[cp, T_local]`` int64
    (:func:`block_positions`). A window is placed by positions, not rows: a block's rows inside a
    piece's range need not be consecutive positions (dual_chunk_swap, striped)."""
    return *block_key_ranges(gather_index, k_start, (k_len,), cp_size=cp_size), block_positions(gather_index, cp_size)


def make_ring_plan(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    cp_size: int,
    rank: int,
    strategy: StrategyLike = None,
    num_tokens: int | None = None,
) -> RingPlan:
    """Build rank ``rank``'s :class:`RingPlan`; arguments as for :func:`cpcompile.plan.make_plan`."""
    check_plan_arguments(cu_seqlens, cu_seqlens_padded, cp_size, rank, num_tokens)
    args = {"cp_size": cp_size, "rank": rank, "strategy": strategy, "num_tokens": num_tokens}
    return ring_plan_of(cu_seqlens, cu_seqlens_padded, **args)


def ring_plan_of(cu_seqlens, cu_seqlens_padded=None, *, cp_size: int, rank: int, strategy=None, num_tokens=None):
    """:func:`make_ring_plan` of offsets a public entry checked."""
    plan = plan_of(cu_seqlens, cu_seqlens_padded, cp_size=cp_size, rank=rank, strategy=strategy, num_tokens=num_tokens)
    ranges = block_key_ranges(plan.gather_index, plan.k_start, (plan.k_len_causal, plan.k_len_full), cp_size=cp_size)
    return RingPlan(plan.cu_q, *ranges, plan.cu_seqlens, plan.cu_seqlens_padded)

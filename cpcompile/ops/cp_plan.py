"""``cp_plan``: the per-step attention plan as an op, so compiled graphs build it once.

The compiler inserts one ``cp_plan`` per distinct ``cu_seqlens`` input and feeds every
``cp_attention`` from it. Its fake gives the plan's sizes symbolically (``T`` from
the local token count, piece slots from the document count), and states the
divisibility the layout relies on as ``torch._check``s, which become run-time
asserts where the shape environment cannot prove them. Values are checked in the
real implementation, at run time, before any communication.
"""

from __future__ import annotations

import torch

from ..partition import padding_multiple
from ..plan import max_pieces, step_plan
from ..strategy import Strategy, StrategySpec


def _spec(strategy: str, stripe_size: int) -> StrategySpec:
    return StrategySpec(Strategy(strategy), stripe_size)


def _plan(*args) -> tuple[torch.Tensor, ...]:
    return tuple(step_plan(*args))


#: :func:`cpcompile.plan.step_plan` as an op: ``(gather_index [T], cu_q [P + 1], k_start, k_len_causal,
#: k_len_full [P])`` for ``T = num_tokens`` padded tokens, made once per ``cu_seqlens`` (checkpointed
#: layers' recomputations, each with a ``cp_plan`` of its own, share it). The schema is given as a
#: string, so that ``step_plan`` itself is the op's function rather than a wrapper restating its parameters.
cp_plan = torch.library.custom_op(
    "cpcompile::cp_plan",
    _plan,
    mutates_args=(),
    schema="(Tensor cu_seqlens, Tensor? cu_seqlens_padded, SymInt num_tokens, SymInt cp_size, SymInt rank, "
    "str strategy, SymInt stripe_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@cp_plan.register_fake
def _(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, strategy, stripe_size):
    spec = _spec(strategy, stripe_size)
    multiple, _ = padding_multiple(spec, cp_size)
    torch._check(
        num_tokens % multiple == 0,
        lambda: f"{strategy} with cp_size={cp_size} needs a token count that is a multiple of {multiple}",
    )
    pieces = max_pieces(spec, cu_seqlens.shape[0] - 1, num_tokens // cp_size)
    index = cu_seqlens.new_empty(num_tokens, dtype=torch.int64)
    return index, cu_seqlens.new_empty(pieces + 1), *(cu_seqlens.new_empty(pieces) for _ in range(3))

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

from ..plan import max_pieces, step_plan
from ..strategy import Strategy, StrategySpec
from ..window import narrow_keys
from .common import NOT_CAPTURED, check_fake_tokens


def _spec(strategy: str, stripe_size: int, windows=(), capacity=()) -> StrategySpec:
    return StrategySpec(Strategy(strategy), stripe_size, windows=tuple(windows), capacity=tuple(capacity) or None)


def plan_op(name: str, make, parameters: str):
    """The step-plan function ``make`` (``-> AttentionPlan``) as the op ``cpcompile::<name>``,
    returning the plan's five tensors; ``parameters``: its schema's parameter list, given as a
    string so that the op is ``make`` itself rather than a function restating its parameters."""
    schema = f"({parameters}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"

    def run(*args):  # lists (int[] arguments) as tuples: ``per_plan`` keys on the values
        return tuple(make(*(tuple(a) if isinstance(a, list) else a for a in args)))

    return torch.library.custom_op(f"cpcompile::{name}", run, mutates_args=(), schema=schema, tags=NOT_CAPTURED)


def fake_plan(cu_seqlens: torch.Tensor, num_tokens, pieces) -> tuple[torch.Tensor, ...]:
    """A plan op's fake outputs: ``gather_index [T]`` int64, ``cu_q [P + 1]``, and three ``[P]``."""
    index = cu_seqlens.new_empty(num_tokens, dtype=torch.int64)
    return index, cu_seqlens.new_empty(pieces + 1), *(cu_seqlens.new_empty(pieces) for _ in range(3))


#: :func:`cpcompile.plan.step_plan` as an op: ``(gather_index [T], cu_q [P + 1], k_start, k_len_causal,
#: k_len_full [P])`` for ``T = num_tokens`` padded tokens, made once per ``cu_seqlens`` (checkpointed
#: layers' recomputations, each with a ``cp_plan`` of its own, share it).
cp_plan = plan_op(
    "cp_plan",
    step_plan,
    "Tensor cu_seqlens, Tensor? cu_seqlens_padded, SymInt num_tokens, SymInt cp_size, SymInt rank, str strategy, "
    "SymInt stripe_size, int[] windows=[], int[] capacity=[]",
)


@cp_plan.register_fake
def _(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, strategy, stripe_size, windows=(), capacity=()):
    spec = _spec(strategy, stripe_size, windows, capacity)
    check_fake_tokens(num_tokens, cp_size, spec)
    if spec.capacity is not None:
        tokens = spec.capacity.tokens
        torch._check(num_tokens == tokens, lambda: f"capacity.tokens={tokens}, but the batch holds other token counts")
    return fake_plan(cu_seqlens, num_tokens, max_pieces(spec, cu_seqlens.shape[0] - 1, num_tokens // cp_size))


@torch.library.custom_op("cpcompile::window_keys", mutates_args=(), tags=NOT_CAPTURED)
def window_keys(
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len_causal: torch.Tensor,
    k_len_full: torch.Tensor,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cpcompile.window.narrow_keys` as an op, fed by ``cp_plan``: ``(k_start, k_len, q_pos)``,
    each ``[P]`` int32, once per plan and window."""
    return narrow_keys(cu_q, k_start, k_len_causal, k_len_full, window_left, window_right)


@window_keys.register_fake
def _(cu_q, k_start, k_len_causal, k_len_full, window_left, window_right):
    torch._check(k_start.shape[0] + 1 == cu_q.shape[0], lambda: f"{k_start.shape} key starts for {cu_q.shape} cu_q")
    return tuple(k_start.new_empty(k_start.shape) for _ in range(3))

"""``cp_plan``: the per-step attention plan as an op, so compiled graphs build it once.

The compiler inserts one ``cp_plan`` per distinct ``cu_seqlens`` input and feeds every
``cp_attention`` from it. Its fake gives the plan's sizes symbolically (``T`` from
the local token count, piece slots from the document count), and states the
divisibility the layout relies on as ``torch._check``s, which become run-time
asserts where the shape environment cannot prove them. Values are checked in the
real implementation, at run time, before any communication.
"""

from __future__ import annotations

import inspect

import torch

from cpcompile.attention.common import NOT_CAPTURED, check_fake_tokens
from cpcompile.batch import check_rows
from cpcompile.cache import capturing, per_plan, readable
from cpcompile.checks import agreement_enabled, check_offsets, rows_are_real
from cpcompile.comm.groups import agree_on, digest, resolve_group
from cpcompile.kernels.metadata import scratch
from cpcompile.layouts.partition import check_capacity_documents
from cpcompile.plan.pieces import AttentionPlan, max_pieces, op_spec, step_plan
from cpcompile.plan.slots import note_plan, plan_in_capture
from cpcompile.plan.window import narrow_keys
from cpcompile.spec import current_rows


def plan_op(name: str, make, parameters: str):
    """The step-plan function ``make`` (``-> AttentionPlan``) as the op ``cpcompile::<name>``,
    returning the plan's seven tensors; ``parameters``: its schema's parameter list, given as a
    string so that the op is ``make`` itself rather than a function restating its parameters.

    The op takes the keywords ``group_name``, ``calls`` and ``dims`` too (the compiler pass gives them: the
    CP group; per attention call the plan feeds what it does: its op, mask, whether its backward runs,
    constant shapes, dtype, scale, kernel; and the calls' heads and head dims that are symbolic, which
    ``calls`` cannot write down); where a group is given, its ranks agree on the plan and the calls, once
    per step (:func:`agree_on_plan`)."""
    outputs = ", ".join(["Tensor"] * len(AttentionPlan._fields))
    schema = f"({parameters}, *, str group_name='', str[]? calls=None, SymInt[]? dims=None) -> ({outputs})"

    def run(*args, group_name="", calls=None, dims=None):
        args = tuple(tuple(a) if isinstance(a, list) else a for a in args)  # int[] as tuples: per_plan keys on values
        if capturing():  # a CUDA graph replays no host work: the plan comes from a CapturedStep's slot
            return plan_in_capture(make, args)
        plan = agree_on_plan(name, make, args, group_name, tuple(calls or ()), tuple(dims or ()))
        note_plan(make, args, plan)
        return plan

    return torch.library.custom_op(f"cpcompile::{name}", run, mutates_args=(), schema=schema, tags=NOT_CAPTURED)


def agree_on_plan(
    name: str, make, args: tuple, group_name: str, calls: tuple[str, ...], dims: tuple[int, ...] = ()
) -> tuple[torch.Tensor, ...]:
    """``make(*args)``; where the ranks of group ``group_name`` agree (``checks.agreement_enabled``),
    each shares its failure, or its arguments but ``rank`` (``cu_seqlens`` by digest) and, per
    attention call the plan feeds, its mask and whether its backward runs (``calls``) and the values of
    its symbolic heads and head dims (``dims``), before any returns.

    The plan op is a compiled graph's first CP op: a rank whose pack it rejected would otherwise
    leave the others waiting in the attention's collectives; the attention ops see only the plan,
    whose ``gather_index`` depends on the token count alone for some layouts (and the ring's and
    head-parallel ops compare no layout), so ranks with other packs would run and be wrong; and a
    rank whose calls run no backward would leave the others waiting in theirs."""
    group = resolve_group(group_name) if group_name else None
    enabled = group is not None and agreement_enabled(group, args[0])
    signature = inspect.signature(make)
    bound = signature.bind(*args).arguments

    def plan() -> tuple[torch.Tensor, ...]:
        # the batch's rows must be this rank's of the layout the plan is made for (batch.check_rows): the
        # strategy block in force when the compiled step runs says whose they are (its batch); offsets
        # that are no pack name that first. Not in a backward: a checkpointed layer's plan op runs again
        # there, after the block, for the rows its forward checked.
        spec = op_spec(bound["strategy"], bound["stripe_size"], bound.get("windows", ()), bound.get("capacity", ()))
        if group is not None and torch._C._current_graph_task_id() == -1:
            check_offsets(bound["cu_seqlens"], bound.get("cu_seqlens_padded"))
            rows, _ = current_rows()
            real = rows_are_real(group)
            check_rows(bound["cu_seqlens"], group.size(), group.rank(), spec, rows, required=real)
        return tuple(make(*args))

    def record(_plan) -> dict[str, object]:
        # arguments at their defaults (no window, no capacity) left out: ranks of another plan op
        # then differ in the op alone
        shown = {k: v for k, v in bound.items() if k != "rank" and not _is_default(v, signature.parameters[k].default)}
        values = {f"{k} (the plan's)": digest(v) if isinstance(v, torch.Tensor) else v for k, v in shown.items()}
        fed = {"the calls it feeds (op, mask, backward, shapes, scale, kernel)": calls}
        # heads a graph takes as symbols (q, k, v its inputs, dynamic shapes): other heads on one rank would
        # pair collectives of other sizes (gloo aborts) or exchange rows of another shape
        symbolic = {"the calls' symbolic heads and head dims": dims} if dims else {}
        return {"plan op": name} | values | fed | symbolic

    return agree_on(group, enabled, plan, record)


def _is_default(value, default) -> bool:
    return default is not inspect.Parameter.empty and not isinstance(value, torch.Tensor) and value == default


def fake_plan(cu_seqlens: torch.Tensor, num_tokens, pieces) -> tuple[torch.Tensor, ...]:
    """A plan op's fake outputs: ``gather_index [T]`` int64, ``cu_q [P + 1]``, three ``[P]``, and the pack's
    offsets ``[B + 1]``."""
    index = cu_seqlens.new_empty(num_tokens, dtype=torch.int64)
    pieces = (cu_seqlens.new_empty(pieces + 1), *(cu_seqlens.new_empty(pieces) for _ in range(3)))
    return index, *pieces, *(cu_seqlens.new_empty(cu_seqlens.shape) for _ in range(2))


@per_plan
def layers_needed(cu_q, k_start, k_len_causal, k_len_full) -> tuple[int, bool]:
    """The layers of pieces over one key that the plan's live pieces need, under either mask (the most), and
    whether their key ranges are what the captured backward runs (starts that never fall, ends that never fall
    in start order). On the host twins; once per plan."""
    cu_q, k_start, *lens = readable(cu_q, k_start, k_len_causal, k_len_full)
    q_len = cu_q[1:] - cu_q[:-1]
    return key_layers(k_start, *(torch.where(q_len > 0, k_len, 0) for k_len in lens))


def key_layers(k_start: torch.Tensor, *k_lens: torch.Tensor) -> tuple[int, bool]:
    """:func:`layers_needed` of key ranges ``[k_start, k_start + k_len)`` (``[P]`` each, on the host; a range
    of no key reads nothing), one ``k_len`` per mask: the most ranges over one key, and whether the ranges
    that read keys have starts that never fall, and ends that never fall in start order."""
    need, ordered = 0, True
    for k_len in k_lens:
        layer, proper = scratch.layers(k_start, k_len)
        starts = k_start[k_len > 0]
        need = max(need, int(layer.max()) + 1 if starts.numel() else 0)
        ordered = ordered and bool((starts[1:] >= starts[:-1]).all()) and bool(proper)
    return need, ordered


def check_layers(cu_q, k_start, k_len_causal, k_len_full, layers: int, rank: int) -> None:
    """Raise ``ValueError`` unless the plan's live pieces fit ``layers`` layers, with key starts that
    never fall (what the captured attention's backward runs: ``attention.captured``), under both masks."""
    need, ordered = layers_needed(cu_q, k_start, k_len_causal, k_len_full)
    if need > layers or not ordered:
        raise ValueError(
            f"rank {rank}'s pieces of this pack need {need} layers of pieces over one key (or their key starts "
            f"fall), more than the {layers} that captured attention runs for its strategy "
            "(cpcompile.attention.captured.LAYERS): a bug in that bound; leave CUDA graphs off for this pack"
        )


def step_plan_in_layers(
    cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, strategy, stripe_size, windows=(), capacity=(), layers=0
):  # fmt: skip
    """:func:`cpcompile.plan.pieces.step_plan`, and where ``layers`` > 0 (the plan feeds captured attention),
    :func:`check_layers`: a pack beyond the captured backward's layers fails here, on the host,
    before the step, not in the graph."""
    plan = step_plan(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, rank, strategy, stripe_size, windows, capacity)
    if layers:
        check_layers(plan.cu_q, plan.k_start, plan.k_len_causal, plan.k_len_full, layers, rank)
    return plan


#: :func:`cpcompile.plan.pieces.step_plan` as an op: ``(gather_index [T], cu_q [P + 1], k_start, k_len_causal,
#: k_len_full [P], cu_seqlens, cu_seqlens_padded [B + 1])`` for ``T = num_tokens`` padded tokens, made once
#: per ``cu_seqlens`` (checkpointed layers' recomputations, each with a ``cp_plan`` of its own, share it);
#: ``layers``: see :func:`step_plan_in_layers`.
cp_plan = plan_op(
    "cp_plan",
    step_plan_in_layers,
    "Tensor cu_seqlens, Tensor? cu_seqlens_padded, SymInt num_tokens, SymInt cp_size, SymInt rank, str strategy, "
    "SymInt stripe_size, int[] windows=[], int[] capacity=[], int layers=0",
)


@cp_plan.register_fake
def _(
    cu_seqlens,
    cu_seqlens_padded,
    num_tokens,
    cp_size,
    rank,
    strategy,
    stripe_size,
    windows=(),
    capacity=(),
    layers=0,
    group_name="",
    calls=None,
    dims=None,
):
    spec = op_spec(strategy, stripe_size, windows, capacity)
    check_fake_tokens(num_tokens, cp_size, spec)
    if spec.capacity is not None:
        tokens = spec.capacity.tokens
        torch._check(num_tokens == tokens, lambda: f"capacity.tokens={tokens}, but the batch holds other token counts")
        check_capacity_documents(cu_seqlens, spec.capacity)  # at the trace, where the count is static
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
    """:func:`cpcompile.plan.window.narrow_keys` as an op, fed by ``cp_plan``: ``(k_start, k_len, q_pos)``,
    each ``[P]`` int32, once per plan and window."""
    return narrow_keys(cu_q, k_start, k_len_causal, k_len_full, window_left, window_right)


@window_keys.register_fake
def _(cu_q, k_start, k_len_causal, k_len_full, window_left, window_right):
    torch._check(k_start.shape[0] + 1 == cu_q.shape[0], lambda: f"{k_start.shape} key starts for {cu_q.shape} cu_q")
    return tuple(k_start.new_empty(k_start.shape) for _ in range(3))

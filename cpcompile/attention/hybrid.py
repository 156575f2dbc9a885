"""Hybrid head x context parallelism (``1 < head_parallel < cp``): its ops and the eager path.

Ranks form ``cp / u`` head groups of ``u`` consecutive ranks (``comm.heads.head_groups``).
Inside a group, the head all-to-all (``cpcompile::head_all_to_all``) gives each rank the
group's tokens for ``Hq / u`` query heads (K/V heads replicated as ``comm.heads`` says);
between groups, the ranks at the same place (``j, u + j, ...``) run ``cp_attention`` on the
all-gather path over the group's pieces (``plan.make_hybrid_plan``); the mirror all-to-all
returns the output. Each step is an op with its own autograd, so the backward is theirs:
exact, with dK/dV of the copies summed by the autograd of ``replicate``. The compiler
inserts the same ops (``compiler.shard_attention``), fed by one ``cpcompile::cp_hybrid_plan``.
"""

from __future__ import annotations

import torch

from cpcompile.attention.common import NOT_CAPTURED, agree_once_per_backward, check_fake_tokens, communicates
from cpcompile.attention.plan_op import fake_plan, plan_op
from cpcompile.attention.sinks import head_slice
from cpcompile.checks import agreement_enabled
from cpcompile.comm.groups import resolve_group
from cpcompile.comm.heads import head_groups, heads_to_tokens, kv_replication, replicate, tokens_to_heads
from cpcompile.plan.pieces import AttentionPlan, hybrid_step_plan, max_pieces, op_spec

#: the step named in the backward's agreement
_BACKWARD = "backward of head_all_to_all (the hybrid's)"


@torch.library.custom_op("cpcompile::head_all_to_all", mutates_args=(), tags=NOT_CAPTURED)
@communicates("head_all_to_all (the hybrid's)", None)
def head_all_to_all(
    x: torch.Tensor, group_name: str, to_tokens: bool, cp_group_name: str = "", backward: bool = False
) -> torch.Tensor:
    """``to_tokens``: ``[T_local, H, D]`` -> ``[u * T_local, H / u, D]`` over the group of ``u`` ranks
    (``comm.heads.heads_to_tokens``); else the mirror.

    ``cp_group_name``: the whole CP group, which a ``backward`` call first agrees on, once per backward
    pass (:func:`cpcompile.attention.common.communicates`): the hybrid's backward begins with this
    all-to-all inside a head group, and a rank that skipped the backward (its next forward agrees on the
    whole group) would otherwise leave the others of its head group waiting in it until the timeout."""
    if backward and cp_group_name:
        cp_group = resolve_group(cp_group_name)
        if agreement_enabled(cp_group, x):
            agree_once_per_backward(cp_group, _BACKWARD)
    move = heads_to_tokens if to_tokens else tokens_to_heads
    (out,) = move([x], resolve_group(group_name))
    return out.contiguous()


@head_all_to_all.register_fake
def _(x, group_name, to_tokens, cp_group_name="", backward=False):
    u = resolve_group(group_name).size()
    if to_tokens:
        torch._check(x.shape[1] % u == 0, lambda: f"{u} ranks cannot split {x.shape[1]} heads")
        return x.new_empty((x.shape[0] * u, x.shape[1] // u, x.shape[2]))
    return x.new_empty((x.shape[0] // u, x.shape[1] * u, x.shape[2]))


def _backward(ctx, grad):
    a2a = torch.ops.cpcompile.head_all_to_all
    return a2a(grad.contiguous(), ctx.group_name, not ctx.to_tokens, ctx.cp_group_name, True), None, None, None, None


def _setup(ctx, inputs, output):
    _, ctx.group_name, ctx.to_tokens, ctx.cp_group_name, _ = inputs


head_all_to_all.register_autograd(_backward, setup_context=_setup)


def hybrid_attention(
    q, k, v, plan: AttentionPlan, group, head_parallel: int, *, causal, scale, max_seqlen, kernel, sinks=None,
    softcap=0.0,
):  # fmt: skip
    """q ``[T_local, Hq, D]``, k ``[T_local, Hkv, D]``, v ``[T_local, Hkv, Dv]`` -> ``[T_local, Hq, Dv]``; ``plan``
    from
    :func:`cpcompile.plan.pieces.make_hybrid_plan` for this rank. Differentiable (each step an op).
    ``sinks`` ``[Hq]``: ``cp_attention`` gets those of the heads the rank holds between the all-to-alls;
    ``softcap``: the ops'."""
    heads, sequence = head_groups(resolve_group(group), head_parallel)
    f = kv_replication(q.shape[1], k.shape[1], head_parallel)
    a2a = torch.ops.cpcompile.head_all_to_all
    cp_name = resolve_group(group).group_name
    qh, kh, vh = (a2a(x, heads.group_name, True, cp_name) for x in (q, replicate(k, f), replicate(v, f)))
    args = (qh, kh, vh, plan.gather_index, plan.cu_q, plan.k_start, plan.k_len(causal), sequence.group_name)
    # the all-gather path: the sparse exchange's plan is made from one rank's pieces, not a head group's
    sink = {} if sinks is None else {"sinks": head_slice(sinks, heads.rank(), heads.size())}
    cap = {"softcap": softcap} if softcap else {}
    kw = {**sink, **cap}
    out = torch.ops.cpcompile.cp_attention(*args, causal, scale, max_seqlen, max_seqlen, kernel, "never", 1, **kw)[0]
    return a2a(out, heads.group_name, False, cp_name)


#: :func:`cpcompile.plan.pieces.hybrid_step_plan` as an op: ``(gather_index [T], cu_q [P + 1], k_start,
#: k_len_causal, k_len_full [P], cu_seqlens, cu_seqlens_padded [B + 1])``, the pieces those of the rank's
#: head group.
cp_hybrid_plan = plan_op(
    "cp_hybrid_plan",
    hybrid_step_plan,
    "Tensor cu_seqlens, Tensor? cu_seqlens_padded, SymInt num_tokens, SymInt cp_size, SymInt head_parallel, "
    "SymInt rank, str strategy, SymInt stripe_size",
)


@cp_hybrid_plan.register_fake
def _(
    cu_seqlens,
    cu_seqlens_padded,
    num_tokens,
    cp_size,
    head_parallel,
    rank,
    strategy,
    stripe_size,
    group_name="",
    calls=None,
    dims=None,
):
    spec = op_spec(strategy, stripe_size)
    check_fake_tokens(num_tokens, cp_size, spec)
    t_local = num_tokens // cp_size
    pieces = torch.sym_min(t_local * head_parallel, head_parallel * max_pieces(spec, cu_seqlens.shape[0] - 1, t_local))
    return fake_plan(cu_seqlens, num_tokens, pieces)

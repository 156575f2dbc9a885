"""Head-parallel (Ulysses) CP attention: ``cp_head_plan`` and ``cp_head_attention``.

With ``head_parallel == cp`` no document is cut: an all-to-all over heads
(``comm.heads``) gives each rank every token of its ``Hq / cp`` query heads (and the
K/V heads they read, replicated where ``Hkv`` is too small), in the all-gather's order;
the plan's ``gather_index`` puts them in physical order, where one single-device kernel
call runs the documents whole; the output (and ``lse``) go back by the mirror
all-to-all. The backward sends ``dO`` with q, k, v and the output again (autograd keeps
only the op's local inputs and outputs, nothing of the head-sharded buffers), runs the
kernel's backward and returns dQ, dK, dV the same way, the K/V copies' gradients summed
in the accumulation dtype before the one rounding. Any token layout works, since every
rank receives every token; the plan comes from the strategy's layout.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..comm.groups import resolve_group
from ..comm.heads import heads_to_tokens, kv_replication, replicate, sum_replicas, tokens_to_heads
from ..plan import head_step_plan, max_pieces
from ..strategy import Strategy, StrategySpec
from .common import (
    agree_in_op,
    check_fake_qkv,
    check_fake_tokens,
    out_and_lse,
    register_attention_autograd,
    softmax_scale,
)
from .cp_plan import fake_plan, plan_op
from .gathered import gathered_order

#: :func:`cpcompile.plan.head_step_plan` as an op: ``(gather_index [T], cu_q [P + 1], k_start,
#: k_len_causal, k_len_full [P])``, the pieces whole documents over the physical buffer.
cp_head_plan = plan_op(
    "cp_head_plan",
    head_step_plan,
    "Tensor cu_seqlens, Tensor? cu_seqlens_padded, SymInt num_tokens, SymInt cp_size, str strategy, SymInt stripe_size",
)


@cp_head_plan.register_fake
def _(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, strategy, stripe_size):
    check_fake_tokens(num_tokens, cp_size, StrategySpec(Strategy(strategy), stripe_size))
    pieces = max_pieces(StrategySpec(Strategy.NO_LOAD_BALANCE), cu_seqlens.shape[0] - 1, num_tokens)
    return fake_plan(cu_seqlens, num_tokens, pieces)


def _to_physical(xs, gather_index):
    return [x.index_select(0, gather_index) for x in xs]  # [T, h, D] in physical order


def _to_gathered(xs, gather_index):
    order = gathered_order(gather_index)  # physical row of each gathered row, once per plan
    return [x.index_select(0, order) for x in xs]


def _lse_rows(lse: torch.Tensor) -> torch.Tensor:
    return lse.t().unsqueeze(-1)  # [H, T] -> [T, H, 1]: heads in the middle, as the all-to-all takes them


def _call(q, k, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, kernel_name):
    group = resolve_group(group_name)
    f = kv_replication(q.shape[1], k.shape[1], group.size())
    pieces = kernels.Pieces(cu_q, k_start, k_len, max_q=max_seqlen, max_k=max_seqlen)
    kw = {"causal": causal, "scale": softmax_scale(q, scale)}
    return group, f, kernels.select(q, kernel_name), pieces, kw


#: the plan and call arguments of the head-parallel ops, after their tensors
_PLAN_SCHEMA = (
    "Tensor gather_index, Tensor cu_q, Tensor k_start, Tensor k_len, str group_name, bool causal, float? scale, "
    "SymInt? max_seqlen, str? kernel_name"
)


def _head_attention(q, k, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, kernel_name):
    """q ``[T_local, Hq, D]``, k, v ``[T_local, Hkv, D]`` -> ``(out [T_local, Hq, D], lse [Hq, T_local])``."""
    group = resolve_group(group_name)
    config = {"kernel": kernel_name, "head_parallel": group.size()}
    agree_in_op("cp_head_attention (all_to_all)", group, q, k, causal, scale, gather_index, config)
    plan = (gather_index, cu_q, k_start, k_len)
    group, f, kern, pieces, kw = _call(q, k, *plan, group_name, causal, scale, max_seqlen, kernel_name)
    heads = heads_to_tokens([q, replicate(k, f), replicate(v, f)], group)  # [T, Hq/u | Hkv*f/u, D]
    out, lse = kern.forward(*_to_physical(heads, gather_index), pieces, **kw)  # [T, Hq/u, D], [Hq/u, T]
    out, lse = _to_gathered([out, _lse_rows(lse)], gather_index)
    (out,) = tokens_to_heads([out], group)  # [T_local, Hq, D]
    (lse,) = tokens_to_heads([lse], group)  # [T_local, Hq, 1]
    return out, lse.squeeze(-1).t().contiguous()


_cp_head_attention = torch.library.custom_op(
    "cpcompile::cp_head_attention",
    _head_attention,
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_PLAN_SCHEMA}) -> (Tensor, Tensor)",
)


@_cp_head_attention.register_fake
def _(q, k, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, kernel_name):
    check_fake_qkv(q, k, v)
    u = resolve_group(group_name).size()
    torch._check(k.shape[0] == q.shape[0], lambda: f"q {q.shape} and k {k.shape} differ in local tokens")
    torch._check(q.shape[1] % u == 0, lambda: f"head_parallel={u} must divide the query heads {q.shape[1]}")
    torch._check(
        gather_index.shape[0] == q.shape[0] * u,
        lambda: f"plan covers {gather_index.shape[0]} tokens, q holds {q.shape[0]} x cp {u}",
    )
    return out_and_lse(q)


def _head_attention_backward(dout, q, k, v, out, lse, gather_index, cu_q, k_start, k_len, *call):
    """The gradients ``(dq, dk, dv)`` of :func:`_head_attention`; ``call``: its arguments after the plan."""
    group_name, causal, scale, max_seqlen, kernel_name = call
    plan = (gather_index, cu_q, k_start, k_len)
    group, f, kern, pieces, kw = _call(q, k, *plan, group_name, causal, scale, max_seqlen, kernel_name)
    # one all-to-all for everything of q's dtype: dO, q, the output, and K/V with their copies
    sent = heads_to_tokens([dout.to(q.dtype), q, out, replicate(k, f), replicate(v, f)], group)
    (lse_t,) = heads_to_tokens([_lse_rows(lse)], group)  # [T, Hq/u, 1]
    dout_p, q_p, out_p, k_p, v_p, lse_p = _to_physical([*sent, lse_t], gather_index)
    dq, dk, dv = kern.backward(dout_p, q_p, k_p, v_p, out_p, lse_p.squeeze(-1).t().contiguous(), pieces, **kw)
    dq, dk, dv = _to_gathered([dq, dk, dv], gather_index)
    (dq,) = tokens_to_heads([dq], group)  # [T_local, Hq, D]
    dk, dv = tokens_to_heads([dk, dv], group)  # [T_local, Hkv * f, D], the accumulation dtype
    return dq.to(q.dtype), sum_replicas(dk, f).to(k.dtype), sum_replicas(dv, f).to(v.dtype)


_cp_head_attention_backward = torch.library.custom_op(
    "cpcompile::cp_head_attention_backward",
    _head_attention_backward,
    mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_PLAN_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)",
)


@_cp_head_attention_backward.register_fake
def _(dout, q, k, v, out, lse, gather_index, cu_q, k_start, k_len, group_name, causal, scale, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# plan: gather_index, cu_q, k_start, k_len
register_attention_autograd(_cp_head_attention, torch.ops.cpcompile.cp_head_attention_backward, num_plan=4)

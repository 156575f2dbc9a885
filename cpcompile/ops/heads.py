"""Head-parallel (Ulysses) CP attention: ``cp_head_plan`` and ``cp_head_attention``.

With ``head_parallel == cp`` no document is cut: an all-to-all over heads
(``comm.heads``) gives each rank every token of its ``Hq / cp`` query heads (and the
K/V heads they read, replicated where ``Hkv`` is too small), in the all-gather's order;
one gather takes the documents' real tokens from them, in physical order and back to
back (:func:`documents`), where one single-device kernel call runs the documents whole,
each reading the keys at its own rows (``kernels.Pieces.disjoint_keys``: the GPU kernels
then copy no key, and FA4's backward, wrong for overlapping or decreasing key ranges,
runs as it is); the output (and ``lse``) go back by the mirror all-to-all, zero (and
``-inf``) at the padding. The backward sends ``dO`` with q, k, v and the output again
(autograd keeps only the op's local inputs and outputs, nothing of the head-sharded
buffers), runs the kernel's backward and returns dQ, dK, dV the same way, the K/V
copies' gradients summed in the accumulation dtype before the one rounding. Any token
layout works, since every rank receives every token; the plan comes from the strategy's
layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from ..comm.groups import resolve_group
from ..comm.heads import heads_to_tokens, kv_replication, replicate, sum_replicas, tokens_to_heads
from ..per_plan import per_plan, twinned
from ..plan import head_step_plan, keys_read, max_pieces
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


class Documents(NamedTuple):
    """The pack as the kernel sees it after the head all-to-all: the documents' ``T_real`` real
    tokens back to back, in physical order, from the ``T`` gathered rows (``N`` documents).

    - ``rows``: ``[T_real]`` int64, the gathered row of each.
    - ``back``: ``[T]`` int64, each gathered row's kernel row (0 for padding).
    - ``live``: ``[T]`` bool, the gathered rows that are real tokens.
    - ``cu``: ``[N + 1]`` int32, the documents' offsets among the kernel rows; ``lengths``: ``[N]`` int32.
    """

    rows: torch.Tensor
    back: torch.Tensor
    live: torch.Tensor
    cu: torch.Tensor
    lengths: torch.Tensor


@per_plan
@twinned  # on the host where the plan has twins: T_real is read there
def documents(gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor) -> Documents:
    """:class:`Documents` of a head plan (``gather_index [T]``; ``k_start``, ``k_len`` ``[P]``: whole
    documents over the physical buffer, as :func:`cpcompile.plan.make_head_plan` makes them), once
    per plan; a host sync where the plan has no host twins."""
    real = keys_read(k_start, k_len, gather_index.shape[0])  # [T] physical rows: a whole piece reads its own
    lengths = k_len[k_len > 0]
    kernel_row = real.cumsum(0) - 1
    back = torch.empty_like(gather_index).scatter_(0, gather_index, kernel_row.clamp(min=0))
    return Documents(
        rows=gather_index[real],
        back=back,
        live=torch.empty_like(real).scatter_(0, gather_index, real),
        cu=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32),
        lengths=lengths.to(torch.int32),
    )


def _to_documents(xs, docs: Documents):
    return [x.index_select(0, docs.rows) for x in xs]  # [T_real, h, D]: the documents back to back


def _to_gathered(xs, docs: Documents, fill: float = 0.0):
    """Kernel rows -> gathered rows, ``fill`` at the padding (a gather, then a fill where there is padding)."""
    out = [x.index_select(0, docs.back) for x in xs]
    if docs.rows.shape[0] < docs.back.shape[0]:
        out = [x.masked_fill_(~docs.live.view(-1, *(1,) * (x.dim() - 1)), fill) for x in out]
    return out


def _lse_rows(lse: torch.Tensor) -> torch.Tensor:
    return lse.t().unsqueeze(-1)  # [H, T] -> [T, H, 1]: heads in the middle, as the all-to-all takes them


def _call(q, k, gather_index, k_start, k_len, group_name, causal, scale, max_seqlen, kernel_name):
    group = resolve_group(group_name)
    f = kv_replication(q.shape[1], k.shape[1], group.size())
    docs = documents(gather_index, k_start, k_len)
    # each document reads the keys at its own rows: disjoint, increasing key ranges
    pieces = kernels.Pieces(docs.cu, docs.cu[:-1], docs.lengths, max_q=max_seqlen, max_k=max_seqlen, disjoint_keys=True)
    kw = {"causal": causal, "scale": softmax_scale(q, scale)}
    return group, f, docs, kernels.select(q, kernel_name), pieces, kw


#: the plan and call arguments of the head-parallel ops, after their tensors
_PLAN_SCHEMA = (
    "Tensor gather_index, Tensor cu_q, Tensor k_start, Tensor k_len, str group_name, bool causal, float? scale, "
    "SymInt? max_seqlen, str? kernel_name"
)


def _head_attention(q, k, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, *call):
    """q ``[T_local, Hq, D]``, k, v ``[T_local, Hkv, D]`` -> ``(out [T_local, Hq, D], lse [Hq, T_local])``;
    ``call``: ``(max_seqlen, kernel_name)``."""
    group = resolve_group(group_name)
    config = {"kernel": call[1], "head_parallel": group.size()}
    agree_in_op("cp_head_attention (all_to_all)", group, q, k, causal, scale, gather_index, config)
    group, f, docs, kern, pieces, kw = _call(q, k, gather_index, k_start, k_len, group_name, causal, scale, *call)
    heads = heads_to_tokens([q, replicate(k, f), replicate(v, f)], group)  # [T, Hq/u | Hkv*f/u, D]
    out, lse = kern.forward(*_to_documents(heads, docs), pieces, **kw)  # [T_real, Hq/u, D], [Hq/u, T_real]
    (out,) = _to_gathered([out], docs)  # [T, Hq/u, D]
    (lse,) = _to_gathered([_lse_rows(lse)], docs, float("-inf"))  # [T, Hq/u, 1]: padding sees no key
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
    group, f, docs, kern, pieces, kw = _call(q, k, gather_index, k_start, k_len, *call)
    # one all-to-all for everything of q's dtype: dO, q, the output, and K/V with their copies
    sent = heads_to_tokens([dout.to(q.dtype), q, out, replicate(k, f), replicate(v, f)], group)
    (lse_t,) = heads_to_tokens([_lse_rows(lse)], group)  # [T, Hq/u, 1]
    dout_d, q_d, out_d, k_d, v_d, lse_d = _to_documents([*sent, lse_t], docs)  # [T_real, ...]
    dq, dk, dv = kern.backward(dout_d, q_d, k_d, v_d, out_d, lse_d.squeeze(-1).t().contiguous(), pieces, **kw)
    # copies' gradients travel in the accumulation dtype, to be summed before the one rounding;
    # without copies that rounding is the same before the all-to-all, which then moves half the bytes
    wire = k.dtype if f == 1 else torch.promote_types(dk.dtype, torch.float32)
    dq, dk, dv = _to_gathered([dq.to(q.dtype), dk.to(wire), dv.to(wire)], docs)
    (dq,) = tokens_to_heads([dq], group)  # [T_local, Hq, D]
    dk, dv = tokens_to_heads([dk, dv], group)  # [T_local, Hkv * f, D]
    return dq, sum_replicas(dk, f).to(k.dtype), sum_replicas(dv, f).to(v.dtype)


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

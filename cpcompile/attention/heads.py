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

from cpcompile import kernels
from cpcompile.attention.common import (
    NOT_CAPTURED,
    check_fake_gather,
    check_fake_qkv,
    check_fake_tokens,
    communicates,
    out_and_lse,
    register_attention_autograd,
    softmax_scale,
)
from cpcompile.attention.plan_op import fake_plan, plan_op
from cpcompile.attention.sinks import check_fake_sinks
from cpcompile.cache import per_plan, twinned
from cpcompile.comm.groups import resolve_group
from cpcompile.comm.heads import heads_to_tokens, kv_replication, replicate, sum_replicas, tokens_to_heads
from cpcompile.kernels.sinks import joined
from cpcompile.layouts.reads import keys_read
from cpcompile.plan.pieces import head_step_plan, max_pieces, op_spec
from cpcompile.spec import Strategy, StrategySpec

#: :func:`cpcompile.plan.pieces.head_step_plan` as an op: ``(gather_index [T], cu_q [P + 1], k_start,
#: k_len_causal, k_len_full [P], cu_seqlens, cu_seqlens_padded [B + 1])``, the pieces whole documents over
#: the physical buffer.
cp_head_plan = plan_op(
    "cp_head_plan",
    head_step_plan,
    "Tensor cu_seqlens, Tensor? cu_seqlens_padded, SymInt num_tokens, SymInt cp_size, str strategy, SymInt stripe_size",
)


@cp_head_plan.register_fake
def _(cu_seqlens, cu_seqlens_padded, num_tokens, cp_size, strategy, stripe_size, group_name="", calls=None, dims=None):
    check_fake_tokens(num_tokens, cp_size, op_spec(strategy, stripe_size))
    pieces = max_pieces(StrategySpec(Strategy.NO_LOAD_BALANCE), cu_seqlens.shape[0] - 1, num_tokens)
    return fake_plan(cu_seqlens, num_tokens, pieces)


class Documents(NamedTuple):
    """The pack as the kernel sees it after the head all-to-all: the documents' ``T_real`` real
    tokens back to back, in physical order, from the ``T`` gathered rows (``N`` documents).

    - ``rows``: ``[T_real]`` int64, the gathered row of each.
    - ``back``: ``[T]`` int64, each gathered row's kernel row (0 for padding).
    - ``live``: ``[T]`` bool, the gathered rows that are real tokens.
    - ``cu``: ``[N + 1]`` int32, the documents' offsets among the kernel rows; ``lengths``: ``[N]`` int32.
    - ``in_place``: the real tokens are the first ``T_real`` gathered rows, in order (a layout that
      pads only after them, as ``no_load_balance`` does): the kernel takes those rows (a plain copy
      where they are strided views, no index gather), and its output is padded rather than
      gathered back and filled.
    """

    rows: torch.Tensor
    back: torch.Tensor
    live: torch.Tensor
    cu: torch.Tensor
    lengths: torch.Tensor
    in_place: bool


@per_plan
@twinned  # on the host where the plan has twins: T_real is read there
def documents(gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor) -> Documents:
    """:class:`Documents` of a head plan (``gather_index [T]``; ``k_start``, ``k_len`` ``[P]``: whole
    documents over the physical buffer, as :func:`cpcompile.plan.pieces.make_head_plan` makes them), once
    per plan; a host sync where the plan has no host twins."""
    real = keys_read(k_start, k_len, gather_index.shape[0])  # [T] physical rows: a whole piece reads its own
    lengths = k_len[k_len > 0]
    kernel_row = real.cumsum(0) - 1
    back = torch.empty_like(gather_index).scatter_(0, gather_index, kernel_row.clamp(min=0))
    rows = gather_index[real]
    return Documents(
        rows=rows,
        back=back,
        live=torch.empty_like(real).scatter_(0, gather_index, real),
        cu=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32),
        lengths=lengths.to(torch.int32),
        in_place=torch.equal(rows, torch.arange(rows.shape[0], device=rows.device)),
    )


def _to_documents(xs, docs: Documents):
    """Gathered rows -> ``[T_real, h, D]``, the documents back to back (in place: the first rows)."""
    if docs.in_place:  # contiguous, as a gather would give them (the all-to-all's are views of one buffer)
        return [x[: docs.rows.shape[0]].contiguous() for x in xs]
    return [x.index_select(0, docs.rows) for x in xs]


def _to_gathered(xs, docs: Documents, fill: float = 0.0):
    """Kernel rows -> gathered rows, ``fill`` at the padding (in place: the rows padded after
    them; else a gather, then a fill where there is padding)."""
    padding = docs.back.shape[0] - docs.rows.shape[0]
    if docs.in_place:
        return [torch.cat([x, x.new_full((padding, *x.shape[1:]), fill)]) if padding else x.contiguous() for x in xs]
    out = [x.index_select(0, docs.back) for x in xs]
    if padding:
        out = [x.masked_fill_(~docs.live.view(-1, *(1,) * (x.dim() - 1)), fill) for x in out]
    return out


def _lse_rows(lse: torch.Tensor) -> torch.Tensor:
    return lse.t().unsqueeze(-1)  # [H, T] -> [T, H, 1]: heads in the middle, as the all-to-all takes them


class LocalCall(NamedTuple):
    """A rank's attention between the all-to-alls: one kernel call over whole documents, the same
    on every rank (``Hq / u`` query heads and ``h`` K/V heads after the all-to-all, ``T`` gathered
    rows). What the benchmarks time as a rank's step (``benchmarks/heads_gpu.py``)."""

    kernel: kernels.AttentionKernel
    docs: Documents
    pieces: kernels.Pieces
    causal: bool
    scale: float
    softcap: float = 0.0

    def forward(self, q, k, v):
        """q ``[T, Hq/u, D]``, k, v ``[T, h, D]`` in the all-gather's order -> ``(out [T, Hq/u, D],
        lse [T, Hq/u, 1])`` in that order, 0 and ``-inf`` at the padding (it sees no key)."""
        out, lse = self.kernel.forward(*_to_documents([q, k, v], self.docs), self.pieces, **self._kw)
        (out,) = _to_gathered([out], self.docs)
        (lse,) = _to_gathered([_lse_rows(lse)], self.docs, float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, wire: torch.dtype):
        """The gradients of :meth:`forward` (``lse`` as it returned it): ``dq [T, Hq/u, D]`` in q's
        dtype, ``dk``, ``dv`` ``[T, h, D]`` in ``wire``, 0 at the padding."""
        dout_d, q_d, k_d, v_d, out_d, lse_d = _to_documents([dout, q, k, v, out, lse], self.docs)  # [T_real, ...]
        lse_d = lse_d.squeeze(-1).t().contiguous()
        dq, dk, dv = self.kernel.backward(dout_d, q_d, k_d, v_d, out_d, lse_d, self.pieces, **self._kw)
        return _to_gathered([dq.to(q.dtype), dk.to(wire), dv.to(wire)], self.docs)

    @property
    def _kw(self) -> dict:
        return {"causal": self.causal, "scale": self.scale, "softcap": self.softcap}


def local_call(
    gather_index, k_start, k_len, *, q, causal, scale, max_seqlen, kernel_name, v=None, softcap=0.0
) -> LocalCall:
    """The :class:`LocalCall` of a head plan (``gather_index [T]``; ``k_start``, ``k_len`` ``[P]``)
    for queries like ``q`` (its dtype, device and head dim) and values like ``v`` (their head dim;
    default ``q``'s), launch bound ``max_seqlen``, soft-capping ``softcap`` (0: none)."""
    docs = documents(gather_index, k_start, k_len)
    # each document reads the keys at its own rows: disjoint, increasing key ranges
    pieces = kernels.Pieces(docs.cu, docs.cu[:-1], docs.lengths, max_q=max_seqlen, max_k=max_seqlen, disjoint_keys=True)
    kernel = kernels.select(q, kernel_name, v=v, softcap=softcap)
    return LocalCall(kernel, docs, pieces, causal, softmax_scale(q, scale), softcap)


def _call(q, k, v, gather_index, k_start, k_len, group_name, causal, scale, max_seqlen, kernel_name, softcap=0.0):
    group = resolve_group(group_name)
    kw = {"q": q, "v": v, "causal": causal, "scale": scale, "max_seqlen": max_seqlen, "kernel_name": kernel_name}
    kw["softcap"] = softcap
    call = local_call(gather_index, k_start, k_len, **kw)
    return group, kv_replication(q.shape[1], k.shape[1], group.size()), call


#: the plan and call arguments of the head-parallel ops, after their tensors
_PLAN_SCHEMA = (
    "Tensor gather_index, Tensor cu_q, Tensor k_start, Tensor k_len, str group_name, bool causal, float? scale, "
    "SymInt? max_seqlen, str? kernel_name, float softcap=0.0"
)


def _head_attention(q, k, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, *call, sinks=None):
    """q ``[T_local, Hq, D]``, k, v ``[T_local, Hkv, D]`` -> ``(out [T_local, Hq, D], lse [Hq, T_local])``;
    ``call``: ``(max_seqlen, kernel_name, softcap)``; ``sinks`` ``[Hq]``, applied back in the rank's rows (every
    head)."""
    if len(call) > 3:  # sinks given by position
        *call, sinks = call
    group, f, local = _call(q, k, v, gather_index, k_start, k_len, group_name, causal, scale, *call)
    heads = heads_to_tokens([q, replicate(k, f), replicate(v, f)], group)  # [T, Hq/u | Hkv*f/u, D]
    out, lse = local.forward(*heads)  # [T, Hq/u, D], [T, Hq/u, 1]
    (out,) = tokens_to_heads([out], group)  # [T_local, Hq, D]
    (lse,) = tokens_to_heads([lse], group)  # [T_local, Hq, 1]
    out, lse = joined((out, lse.squeeze(-1).t()), sinks)
    return out.contiguous(), lse.contiguous()  # contiguous whatever q's layout, as the fake says


_cp_head_attention = torch.library.custom_op(
    "cpcompile::cp_head_attention",
    communicates("cp_head_attention (all_to_all)")(_head_attention),
    mutates_args=(),
    tags=NOT_CAPTURED,
    schema=f"(Tensor q, Tensor k, Tensor v, {_PLAN_SCHEMA}, Tensor? sinks=None) -> (Tensor, Tensor)",
)


@_cp_head_attention.register_fake
def _(q, k, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, kernel_name, softcap=0.0,
      sinks=None):  # fmt: skip
    check_fake_qkv(q, k, v)
    check_fake_sinks(q, sinks)
    u = resolve_group(group_name).size()
    torch._check(q.shape[1] % u == 0, lambda: f"head_parallel={u} must divide the query heads {q.shape[1]}")
    check_fake_gather(q, gather_index, u)
    return out_and_lse(q, v)  # out contiguous, as the op returns it


def _head_attention_backward(dout, q, k, v, out, lse, gather_index, cu_q, k_start, k_len, *call):
    """The gradients ``(dq, dk, dv)`` of :func:`_head_attention`; ``call``: its arguments after the plan."""
    group, f, local = _call(q, k, v, gather_index, k_start, k_len, *call)
    # one all-to-all for everything of q's dtype: dO, q, the output, and K/V with their copies
    dout_t, q_t, out_t, k_t, v_t = heads_to_tokens([dout.to(q.dtype), q, out, replicate(k, f), replicate(v, f)], group)
    (lse_t,) = heads_to_tokens([_lse_rows(lse)], group)  # [T, Hq/u, 1]
    # copies' gradients travel in the accumulation dtype, to be summed before the one rounding;
    # without copies that rounding is the same before the all-to-all, which then moves half the bytes
    wire = k.dtype if f == 1 else torch.promote_types(lse.dtype, k.dtype)
    dq, dk, dv = local.backward(dout_t, q_t, k_t, v_t, out_t, lse_t, wire)
    (dq,) = tokens_to_heads([dq], group)  # [T_local, Hq, D]
    dk, dv = tokens_to_heads([dk, dv], group)  # [T_local, Hkv * f, D]
    dk, dv = sum_replicas(dk, f).to(k.dtype), sum_replicas(dv, f).to(v.dtype)
    return tuple(t.contiguous() for t in (dq, dk, dv))  # whatever q's, k's and v's layouts, as the fake says


_cp_head_attention_backward = torch.library.custom_op(
    "cpcompile::cp_head_attention_backward",
    communicates("cp_head_attention (all_to_all)", "backward")(_head_attention_backward),
    mutates_args=(),
    tags=NOT_CAPTURED,
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_PLAN_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)",
)


@_cp_head_attention_backward.register_fake
def _(dout, q, k, v, out, lse, gather_index, cu_q, k_start, k_len, group_name, causal, scale, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op returns them


# plan: gather_index, cu_q, k_start, k_len
register_attention_autograd(_cp_head_attention, torch.ops.cpcompile.cp_head_attention_backward, num_plan=4)

"""All-gather CP attention with its transfers as graph nodes, for compiled graphs (``overlap_kv``).

``cp_attention`` gathers K/V inside the op, so nothing can run while they travel. With
``cpcompile.backend(..., overlap_kv=True)`` the pass (``compiler.shard_attention``) writes the
call as three parts instead, each a node of the graph:

- the all-gathers of K and V (functional collectives, ``comm.collectives.start_all_gather``),
  started as soon as K and V exist, and waited for just before attention;
- ``cpcompile::cp_attention_split``: the kernel over the gathered K/V (``gathered.forward_on_gathered``).

Its backward (traced by AOT autograd into the backward graph) is again nodes: the re-gathers of
K and V (``cpcompile::cp_attention_split_regather``, then their waits: autograd saves nothing of
size ``T``), ``cpcompile::cp_attention_split_backward``
(the kernel; dK/dV sums in at least float32, in the all-gather's order), and the reduce-scatters of
those sums, whose waits ``compiler.overlap.sink_waits`` moves to where dK and dV are first read: the
dQ path and the weight gradients run while the sums travel. Sizes are the local token count times
cp, symbolic, so one graph serves every pack. ``kv="exchange"`` and ``kv="auto"`` take
``attention.split_exchange`` instead, whose transfers are nodes too (docs/communication.md,
"Transfers as graph nodes").
"""

from __future__ import annotations

import torch

from cpcompile import kernels
from cpcompile.attention.api import kernel_keywords, op_window
from cpcompile.attention.common import (
    NOT_CAPTURED,
    accumulation_dtype,
    check_fake_gather,
    check_fake_qkv,
    communicates,
    dense,
    out_and_lse,
)
from cpcompile.attention.gathered import backward_on_gathered, forward_on_gathered
from cpcompile.attention.sinks import check_fake_sinks
from cpcompile.attention.sinks import grad as sinks_grad
from cpcompile.checks import check_device
from cpcompile.comm.collectives import start_all_gather, start_reduce_scatter, wait
from cpcompile.comm.groups import resolve_group
from cpcompile.plan.window import beyond_gpu


def _call(
    q, v, cu_q, k_start, k_len, scale, max_seqlen, max_seqlen_q, kernel_name, q_pos, window_left, window_right, causal,
    softcap,
):  # fmt: skip
    window = op_window(causal, window_left, window_right)
    kern = kernels.select(q, kernel_name, band=beyond_gpu(window), v=v, softcap=softcap)
    pieces = kernels.Pieces(cu_q, k_start, k_len, max_q=max_seqlen_q, max_k=max_seqlen, q_pos=q_pos)
    return kern, pieces, kernel_keywords(q, scale, window, softcap)


def check_fake_gathered(k, v, k_all, v_all, cp_size: int) -> None:
    torch._check(
        k_all.shape[:2] == v_all.shape[:2],
        lambda: f"gathered k {k_all.shape} and v {v_all.shape} differ in rows or heads",
    )
    torch._check(
        k_all.shape[0] == k.shape[0] * cp_size and k_all.shape[1:] == k.shape[1:],
        lambda: f"gathered k {k_all.shape} must be k {k.shape} of {cp_size} ranks",
    )
    torch._check(
        v_all.shape[2] == v.shape[2], lambda: f"gathered v {v_all.shape} must have v's head dim ({v.shape[2]})"
    )


@torch.library.custom_op("cpcompile::cp_attention_split", mutates_args=(), tags=NOT_CAPTURED)
def _cp_attention_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    gather_index: torch.Tensor,
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
    max_seqlen: int | None,
    max_seqlen_q: int | None,
    kernel_name: str | None,
    q_pos: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T_local, Hq, D]``; k, v ``[T_local, Hkv, D]`` the rank's own (for their gradients); k_all,
    v_all ``[T, Hkv, D]`` their all-gathers (rank-major) -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``;
    ``sinks`` ``[Hq]`` applied to them (``attention.sinks``)."""
    args = (scale, max_seqlen, max_seqlen_q, kernel_name, q_pos, window_left, window_right, causal, softcap)
    kern, pieces, kw = _call(q, v_all, cu_q, k_start, k_len, *args)
    return dense(*forward_on_gathered(kern, q, k_all, v_all, gather_index, pieces, sinks=sinks, **kw))


@_cp_attention_split.register_fake
def _(q, k, v, k_all, v_all, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, max_seqlen_q,
      kernel_name, q_pos=None, window_left=-1, window_right=-1, sinks=None, softcap=0.0):  # fmt: skip
    check_fake_qkv(q, k, v)
    check_fake_sinks(q, sinks)
    cp_size = resolve_group(group_name).size()
    check_fake_gathered(k, v, k_all, v_all, cp_size)
    plan = {"gather_index": gather_index, "cu_q": cu_q, "k_start": k_start, "k_len": k_len}
    check_device(q, **plan, q_pos=q_pos, k_all=k_all, v_all=v_all, sinks=sinks)
    check_fake_gather(q, gather_index, cp_size)
    return out_and_lse(q, v)


@torch.library.custom_op("cpcompile::cp_attention_split_backward", mutates_args=(), tags=NOT_CAPTURED)
def _cp_attention_split_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    gather_index: torch.Tensor,
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
    max_seqlen: int | None,
    max_seqlen_q: int | None,
    kernel_name: str | None,
    q_pos: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``[T_local, Hq, D]`` in q's dtype; dK, dV sums ``[T, Hkv, D]`` of every key in the all-gather's
    order, float32 (float64 for float64 inputs), this rank's part: summed over ranks by the caller."""
    args = (scale, max_seqlen, max_seqlen_q, kernel_name, q_pos, window_left, window_right, causal, softcap)
    kern, pieces, kw = _call(q, v_all, cu_q, k_start, k_len, *args)
    return dense(*backward_on_gathered(kern, dout, q, k_all, v_all, out, lse, gather_index, pieces, **kw))


@_cp_attention_split_backward.register_fake
def _(dout, q, k_all, v_all, out, lse, *rest):
    acc = accumulation_dtype(k_all.dtype)
    return q.new_empty(q.shape), k_all.new_empty(k_all.shape, dtype=acc), v_all.new_empty(v_all.shape, dtype=acc)


@torch.library.custom_op("cpcompile::cp_attention_split_regather", mutates_args=(), tags=NOT_CAPTURED)
@communicates("cp_attention (all_gather, split)", "backward")  # the backward's agreement, before its first collective
def _regather(
    dout: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Start the backward's all-gathers of k and v ``[T_local, Hkv, D]``: ``[T, Hkv, D]`` each, valid once
    ``wait_tensor`` has returned them (the functional collectives' own outputs, their work registered).

    ``dout`` is read for its place alone: what does not depend on the backward's incoming gradients,
    AOT autograd's partitioner computes in the forward and saves for the backward, and a collective it
    never recomputes: the re-gathers would then run in the forward, and their ``T`` rows be saved."""
    cp = resolve_group(group_name).size()
    return start_all_gather(k, cp, group_name), start_all_gather(v, cp, group_name)


@_regather.register_fake
def _(dout, k, v, group_name):
    cp = resolve_group(group_name).size()
    return tuple(x.new_empty((x.shape[0] * cp, *x.shape[1:])) for x in (k, v))


_PLAN = 4  # gather_index, cu_q, k_start, k_len
_NAMES = [a.name for a in _cp_attention_split._opoverload._schema.arguments]


def _setup_context(ctx, inputs, output):
    q, k, v, _k_all, _v_all, *plan = inputs[: 5 + _PLAN]
    group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name, *window, sinks, softcap = inputs[5 + _PLAN :]
    q_pos = window[0] if window else None
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *plan, q_pos, sinks)
    ctx.args = (group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name)
    ctx.window = (*window[1:], softcap)  # the backward op's window_left, window_right, softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    """The re-gathers, the kernel, and the reduce-scatters, each a node where AOT autograd traces this."""
    q, k, v, out, lse, *plan, q_pos, sinks = ctx.saved_tensors
    group_name = ctx.args[0]
    cp = resolve_group(group_name).size()
    k_all, v_all = (wait(x) for x in torch.ops.cpcompile.cp_attention_split_regather(dout, k, v, group_name))
    dq, *sums = torch.ops.cpcompile.cp_attention_split_backward(
        dout, q, k_all, v_all, out, lse, *plan, *ctx.args, q_pos, *ctx.window
    )
    # only the sums whose gradient is needed travel (LoRA on q alone, frozen layers below): needs_input_grad
    # is the same on every rank, so every rank starts the same reduce-scatters
    needed = ctx.needs_input_grad[1:3]  # k, v
    pending = [start_reduce_scatter(s, cp, group_name) if need else None for s, need in zip(sums, needed)]
    dk, dv = (None if p is None else wait(p).to(x.dtype) for p, x in zip(pending, (k, v)))
    # the op returned (out_final, lse_final) with sinks, which the kernel's backward above needs (attention.sinks)
    # by its place: needs_input_grad may leave out the trailing arguments that were not passed (softcap)
    n, at = len(ctx.needs_input_grad), _NAMES.index("sinks")
    grads = [dq, dk, dv] + [None] * (n - 3)
    if sinks is not None and at < n and ctx.needs_input_grad[at]:
        grads[at] = sinks_grad(dout, out, lse, sinks)
    return tuple(grads)


_cp_attention_split.register_autograd(_backward, setup_context=_setup_context)

"""CP attention with the sparse K/V exchange as graph nodes, for compiled graphs (``overlap_kv``).

``attention.split`` writes the all-gather path as functional collectives; the sparse exchange
(``kv="exchange"``, and ``kv="auto"`` where the plan picks it) moves a number of rows that follows
from the pack, and a node holding exactly those rows would have a data-dependent size. So every
transfer here goes into a buffer of the all-gather's ``T = T_local x cp`` rows, which every
exchange fits, and one graph serves every pack:

- ``cpcompile::cp_exchange_fetch`` (started as soon as K and V exist): per tensor a buffer
  ``[T, Hkv, D]`` with the rank's own rows first, and the all-to-all of the rows peers read
  (``comm.exchange.start_fetch``) writing the received ones behind them; where the plan picks the
  all-gather (``plan.exchange.exchange_plan`` returns none, per plan, as in ``cp_attention``), the
  all-gather into it. Either way the collective's work is registered on the buffer
  (``comm.collectives.registered``), so that ``_c10d_functional.wait_tensor``, a node of its own
  just before attention, waits for it;
- ``cpcompile::cp_attention_exchange``: the kernel over the compact keys read from the buffer
  (``comm.exchange.compact_keys``), or over the all-gathered keys, as ``cp_attention`` reads them.

Its backward (traced by AOT autograd into the backward graph): ``cp_exchange_refetch`` (the
backward's agreement, then the same fetch; nothing of size ``T`` is saved) and its waits;
``cp_attention_exchange_backward``: dq, the sums of the received keys' dK/dV (at least float32)
in the first rows of a ``[T]`` buffer, and the rank's own rows' parts summed ``[T_local]``
(``attention.exchange.own_sums``); ``cp_exchange_return`` starts the all-to-all that returns the
sums to their owners (``[(cp - 1) T_local]`` rows, which every return fits), its wait is
sunk to its first reader (``compiler.overlap``), and ``cp_exchange_add`` adds the senders' sums
to the own parts, rounding once to the input dtype (``attention.exchange.add_returned``). On
the all-gather the buffer holds every key's sums and the return is their reduce-scatter.

Every op reads the plan's :class:`~cpcompile.plan.exchange.Exchange` (``per_plan``: made once per
plan and window, alike on every rank), so the ranks start the same collectives in the same order.
The memory is the all-gather's; the traffic the exchange's.
"""

from __future__ import annotations

import torch

from cpcompile import kernels
from cpcompile.attention import exchange
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
from cpcompile.attention.split import check_fake_gathered
from cpcompile.checks import check_device
from cpcompile.comm.collectives import all_gather_rows, reduce_scatter_rows, registered, wait
from cpcompile.comm.exchange import compact_keys, start_fetch, start_return
from cpcompile.comm.groups import resolve_group
from cpcompile.plan.exchange import exchange_plan
from cpcompile.plan.window import beyond_gpu

_OP = "cp_attention (exchange, split)"


def _exchange(gather_index, k_start, k_len, group_name, kv_exchange, window, cu_seqlens, cu_seqlens_padded):
    """The plan's :class:`~cpcompile.plan.exchange.Exchange`, or ``None`` where it all-gathers, as
    ``cp_attention`` decides (``window``: ``(left, right)``, right 0 when causal)."""
    return exchange_plan(gather_index, k_start, k_len, cu_seqlens, cu_seqlens_padded, window, group_name, kv_exchange)


def _start(k, v, gather_index, k_start, k_len, group_name, kv_exchange, window_left, window_right,
           cu_seqlens, cu_seqlens_padded):  # fmt: skip
    group = resolve_group(group_name)
    window = (window_left, window_right)
    ex = _exchange(gather_index, k_start, k_len, group_name, kv_exchange, window, cu_seqlens, cu_seqlens_padded)
    rows = gather_index.shape[0]  # T: the all-gather's rows, which every exchange fits
    pending = [all_gather_rows(x, group, async_op=True) if ex is None else start_fetch(x, ex, group, rows)
               for x in (k, v)]  # fmt: skip
    return tuple(registered(buffer, work) for buffer, work in pending)


def _fake_start(k, v, gather_index, *rest):
    cp = resolve_group(rest[2]).size()
    check_fake_gather(k, gather_index, cp)
    return tuple(x.new_empty((x.shape[0] * cp, *x.shape[1:])) for x in (k, v))


@torch.library.custom_op("cpcompile::cp_exchange_fetch", mutates_args=(), tags=NOT_CAPTURED)
@communicates(_OP)
def _fetch(
    k: torch.Tensor,
    v: torch.Tensor,
    gather_index: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    kv_exchange: str,
    window_left: int,
    window_right: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Start bringing the K/V rows ``[T_local, Hkv, D]`` this rank's pieces read: ``[T, Hkv, D]`` each,
    the own rows first, valid once ``wait_tensor`` has returned them (see the module's docstring)."""
    return _start(k, v, gather_index, k_start, k_len, group_name, kv_exchange, window_left, window_right,
                  cu_seqlens, cu_seqlens_padded)  # fmt: skip


_fetch.register_fake(_fake_start)


@torch.library.custom_op("cpcompile::cp_exchange_refetch", mutates_args=(), tags=NOT_CAPTURED)
@communicates(_OP, "backward")  # the backward's agreement, before its first collective
def _refetch(
    dout: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gather_index: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    kv_exchange: str,
    window_left: int,
    window_right: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's :func:`_fetch`. ``dout`` is read for its place alone, as
    ``cp_attention_split_regather`` reads it: else the partitioner would run the fetch in the forward
    and save its ``T`` rows."""
    return _start(k, v, gather_index, k_start, k_len, group_name, kv_exchange, window_left, window_right,
                  cu_seqlens, cu_seqlens_padded)  # fmt: skip


@_refetch.register_fake
def _(dout, k, v, *rest):
    return _fake_start(k, v, *rest)


def _call(q, v, cu_q, k_start, k_len, scale, max_seqlen, max_seqlen_q, kernel_name, q_pos, window, softcap):
    kern = kernels.select(q, kernel_name, band=beyond_gpu(window), v=v, softcap=softcap)
    pieces = kernels.Pieces(cu_q, k_start, k_len, max_q=max_seqlen_q, max_k=max_seqlen, q_pos=q_pos)
    return kern, pieces, kernel_keywords(q, scale, window, softcap)


@torch.library.custom_op("cpcompile::cp_attention_exchange", mutates_args=(), tags=NOT_CAPTURED)
def _cp_attention_exchange(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
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
    kv_exchange: str,
    q_pos: torch.Tensor | None,
    window_left: int,
    window_right: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T_local, Hq, D]``; k, v ``[T_local, Hkv, D]`` the rank's own (for their gradients); k_buffer,
    v_buffer ``[T, Hkv, D]`` what :func:`_fetch` brought -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``;
    ``sinks`` ``[Hq]`` applied to them (``attention.sinks``)."""
    window = op_window(causal, window_left, window_right)
    plan = (gather_index, k_start, k_len, group_name, kv_exchange, window, cu_seqlens, cu_seqlens_padded)
    ex = _exchange(*plan)
    kern, pieces, kw = _call(q, v, cu_q, k_start, k_len, scale, max_seqlen, max_seqlen_q, kernel_name, q_pos,
                             window, softcap)  # fmt: skip
    if ex is None:
        result = forward_on_gathered(kern, q, k_buffer, v_buffer, gather_index, pieces, sinks=sinks, **kw)
    else:
        k_read, v_read = (compact_keys(b, ex) for b in (k_buffer, v_buffer))
        result = exchange.forward_on_fetched(kern, q, k_read, v_read, ex, pieces, sinks=sinks, **kw)
    return dense(*result)


@_cp_attention_exchange.register_fake
def _(q, k, v, k_buffer, v_buffer, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen,
      max_seqlen_q, kernel_name, kv_exchange, q_pos, window_left, window_right, cu_seqlens, cu_seqlens_padded,
      sinks=None, softcap=0.0):  # fmt: skip
    check_fake_qkv(q, k, v)
    check_fake_sinks(q, sinks)
    cp_size = resolve_group(group_name).size()
    check_fake_gathered(k, v, k_buffer, v_buffer, cp_size)
    plan = {"gather_index": gather_index, "cu_q": cu_q, "k_start": k_start, "k_len": k_len}
    check_device(q, **plan, q_pos=q_pos, k_buffer=k_buffer, v_buffer=v_buffer, sinks=sinks)
    check_device(q, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
    check_fake_gather(q, gather_index, cp_size)
    return out_and_lse(q, v)


@torch.library.custom_op("cpcompile::cp_attention_exchange_backward", mutates_args=(), tags=NOT_CAPTURED)
def _cp_attention_exchange_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
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
    kv_exchange: str,
    q_pos: torch.Tensor | None,
    window_left: int,
    window_right: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``[T_local, Hq, D]`` in q's dtype; per K and V, what :func:`_return` sends ``[T, Hkv, D]``
    and the own rows' parts summed ``[T_local, Hkv, D]``, both float32 (float64 for float64 inputs).
    On the exchange the first rows sent are the received keys' sums (:attr:`Exchange.recv_dst`'s
    order); on the all-gather every key's sums in its order, and the own sums are not written (the
    reduce-scatter gives each rank its rows whole)."""
    window = op_window(causal, window_left, window_right)
    plan = (gather_index, k_start, k_len, group_name, kv_exchange, window, cu_seqlens, cu_seqlens_padded)
    ex = _exchange(*plan)
    kern, pieces, kw = _call(q, v_buffer, cu_q, k_start, k_len, scale, max_seqlen, max_seqlen_q, kernel_name,
                             q_pos, window, softcap)  # fmt: skip
    acc = accumulation_dtype(k_buffer.dtype)
    own = [x.new_empty((q.shape[0], *x.shape[1:]), dtype=acc) for x in (k_buffer, v_buffer)]
    if ex is None:
        dq, *sums = backward_on_gathered(kern, dout, q, k_buffer, v_buffer, out, lse, gather_index, pieces, **kw)
        return dense(dq, *sums, *own)
    k_read, v_read = (compact_keys(b, ex) for b in (k_buffer, v_buffer))
    pack_keys = gather_index.shape[0]
    dq, parts = exchange.backward_on_fetched(kern, dout, q, k_read, v_read, out, lse, ex, pieces, pack_keys, **kw)
    sent = exchange.sums_to_send(parts, ex.recv_dst, (k_buffer, v_buffer), rows=gather_index.shape[0])
    own = [exchange.own_sums(p, ex, o) for p, o in zip(parts, own)]
    return dense(dq, *sent, *own)


@_cp_attention_exchange_backward.register_fake
def _(dout, q, k_buffer, v_buffer, out, lse, *rest):
    acc = accumulation_dtype(k_buffer.dtype)
    sent = [x.new_empty(x.shape, dtype=acc) for x in (k_buffer, v_buffer)]
    own = [x.new_empty((q.shape[0], *x.shape[1:]), dtype=acc) for x in (k_buffer, v_buffer)]
    return q.new_empty(q.shape), *sent, *own


@torch.library.custom_op("cpcompile::cp_exchange_return", mutates_args=(), tags=NOT_CAPTURED)
@communicates(_OP, "backward")
def _return(
    sent: torch.Tensor,
    gather_index: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    kv_exchange: str,
    window_left: int,
    window_right: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
) -> torch.Tensor:
    """Start returning the sums ``sent`` ``[T, Hkv, D]`` to their owners: ``[(cp - 1) T_local, Hkv, D]``
    (:func:`_returned_rows`),
    valid once ``wait_tensor`` has returned it, its first rows the senders' sums in rank order (on the
    all-gather: the first ``T_local``, this rank's rows summed over ranks)."""
    group = resolve_group(group_name)
    window = (window_left, window_right)
    ex = _exchange(gather_index, k_start, k_len, group_name, kv_exchange, window, cu_seqlens, cu_seqlens_padded)
    cp, t_local = group.size(), gather_index.shape[0] // group.size()
    returned = sent.new_empty((_returned_rows(cp, t_local), *sent.shape[1:]))
    if ex is None:
        _, work = reduce_scatter_rows(sent, group, async_op=True, out=returned[:t_local])
    else:
        received, n_send = sum(ex.recv_counts), sum(ex.send_counts)
        _, work = start_return(sent[:received], ex, group, out=returned[:n_send])
    return registered(returned, work)


@_return.register_fake
def _(sent, gather_index, k_start, k_len, group_name, *rest):
    cp = resolve_group(group_name).size()
    return sent.new_empty((_returned_rows(cp, sent.shape[0] // cp), *sent.shape[1:]))


def _returned_rows(cp: int, t_local):
    """What every return fits: at most ``T_local`` rows from each of ``cp - 1`` peers, or the reduce-scatter's
    ``T_local`` (a group of one, whose exchange returns nothing)."""
    return max(cp - 1, 1) * t_local


@torch.library.custom_op("cpcompile::cp_exchange_add", mutates_args=(), tags=NOT_CAPTURED)
def _add(
    own: torch.Tensor,
    returned: torch.Tensor,
    gather_index: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    kv_exchange: str,
    window_left: int,
    window_right: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """dK or dV ``[T_local, Hkv, D]`` in ``dtype``: the own parts' sums ``own`` and the senders' sums
    :func:`_return` brought (on the all-gather: its first ``T_local`` rows, whole)."""
    window = (window_left, window_right)
    ex = _exchange(gather_index, k_start, k_len, group_name, kv_exchange, window, cu_seqlens, cu_seqlens_padded)
    total = own.new_empty(own.shape, dtype=dtype)
    if ex is None:
        return total.copy_(returned[: own.shape[0]])
    return exchange.add_returned(own, returned[: sum(ex.send_counts)], ex, total)


@_add.register_fake
def _(own, returned, *rest):
    return own.new_empty(own.shape, dtype=rest[-1])


_EXCHANGE_ARGS = ("gather_index", "k_start", "k_len", "group_name", "kv_exchange")
_PACK = ("cu_seqlens", "cu_seqlens_padded")
_SAVED = ("q", "k", "v", "gather_index", "cu_q", "k_start", "k_len", "q_pos", "cu_seqlens", "cu_seqlens_padded",
          "sinks")  # fmt: skip
_NAMES = [a.name for a in _cp_attention_exchange._opoverload._schema.arguments]


def _setup_context(ctx, inputs, output):
    a = dict(zip(_NAMES, inputs))
    out, lse = output
    ctx.save_for_backward(*(a.get(n) for n in _SAVED), out, lse)
    ctx.args = {n: a.get(n, d) for n, d in (("group_name", None), ("causal", True), ("scale", None),
                ("max_seqlen", None), ("max_seqlen_q", None), ("kernel_name", None), ("kv_exchange", "auto"),
                ("window_left", -1), ("window_right", -1), ("softcap", 0.0))}  # fmt: skip
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    """The re-fetches, the kernel, the returns of the sums and the adds, each a node where AOT autograd
    traces this."""
    *saved, out, lse = ctx.saved_tensors
    s, a = dict(zip(_SAVED, saved)), ctx.args
    window = op_window(a["causal"], a["window_left"], a["window_right"])
    plan = (*(s[n] if n in s else a[n] for n in _EXCHANGE_ARGS), *window, *(s[n] for n in _PACK))
    k_buffer, v_buffer = (wait(x) for x in torch.ops.cpcompile.cp_exchange_refetch(dout, s["k"], s["v"], *plan))
    dq, *rest = torch.ops.cpcompile.cp_attention_exchange_backward(
        dout, s["q"], k_buffer, v_buffer, out, lse, s["gather_index"], s["cu_q"], s["k_start"], s["k_len"],
        a["group_name"], a["causal"], a["scale"], a["max_seqlen"], a["max_seqlen_q"], a["kernel_name"],
        a["kv_exchange"], s["q_pos"], a["window_left"], a["window_right"], s["cu_seqlens"], s["cu_seqlens_padded"],
        a["softcap"],
    )  # fmt: skip
    sent, own = rest[:2], rest[2:]
    # only the sums whose gradient is needed travel (LoRA on q alone, frozen layers below): needs_input_grad
    # is the same on every rank, so every rank starts the same returns
    needed = ctx.needs_input_grad[1:3]  # k, v
    pending = [torch.ops.cpcompile.cp_exchange_return(x, *plan) if need else None for x, need in zip(sent, needed)]
    dk, dv = (
        None if p is None else torch.ops.cpcompile.cp_exchange_add(o, wait(p), *plan, x.dtype)
        for p, o, x in zip(pending, own, (s["k"], s["v"]))
    )
    # the op returned (out_final, lse_final) with sinks, which the kernel's backward above needs (attention.sinks)
    # by its place: needs_input_grad may leave out the trailing arguments that were not passed
    n, at, sinks = len(ctx.needs_input_grad), _NAMES.index("sinks"), s["sinks"]
    grads = [dq, dk, dv] + [None] * (n - 3)
    if sinks is not None and at < n and ctx.needs_input_grad[at]:
        grads[at] = sinks_grad(dout, out, lse, sinks)
    return tuple(grads)


_cp_attention_exchange.register_autograd(_backward, setup_context=_setup_context)

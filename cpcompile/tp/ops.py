"""Tensor-parallel matmuls overlapped with their communication, on a capacity buffer.

``ag_gemm(x, w)`` is ``all_gather(x) @ w.T`` and ``gemm_rs(x, w)`` is
``reduce_scatter(x @ w.T)``, both along dim 0 (the tokens of sequence parallelism).
Rank r multiplies the chunk it holds while the next one travels the ring of
``comm.ring`` (capacity buffers, since the token count is symbolic; symmetric memory
or NCCL p2p on CUDA, as ``transport`` (``backend(tp_comm=...)``) says, p2p otherwise).

The backward of one op runs the other's ring: ag_gemm's dx is ``gemm_rs(dy, w.T)``,
gemm_rs's dx is ``ag_gemm(dy, w.T)``; the weight gradient is accumulated (in float32
for 16-bit dtypes) from the chunks as they pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpcompile.cache import NOT_CAPTURED, refuse_capture
from cpcompile.comm.groups import group_name as _group_name
from cpcompile.comm.groups import resolve_group
from cpcompile.comm.ring import TpRing, gather_ring, reduce_scatter_ring
from cpcompile.config import DEFAULTS, TP_COMMS, check_choice


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[d0, ..., F]`` -> contiguous ``[d0 * ..., F]``: p2p ops need contiguous rows."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _call(op: str, x: torch.Tensor) -> dict[str, object]:
    """What every rank's ring must equal beyond its rows (``comm.ring``): the op, and the shape of
    the input it brings (the same rows as ``[2, 3, K]`` on one rank and ``[3, 2, K]`` on another
    would come back in other shapes)."""
    return {"op": op, "input shape": tuple(x.shape)}


def _wgrad_accumulator(w: torch.Tensor) -> torch.Tensor:
    return torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)


# --- ag_gemm ---------------------------------------------------------------------------


@torch.library.custom_op("cpcompile::ag_gemm", mutates_args=(), tags=NOT_CAPTURED)
def _ag_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    capacity_tokens: int | None,
    transport: str,
) -> torch.Tensor:
    refuse_capture("ag_gemm (its overlapped transport is not checked under capture)")
    pg = resolve_group(group_name)
    x2, rows = _rows(x), x.shape[:-1].numel()
    out = x2.new_empty((pg.size() * rows, w.shape[0]))  # [tp * rows, N]

    def consume(src: int, chunk: torch.Tensor) -> None:
        dest = out[src * rows : (src + 1) * rows]
        if bias is None:
            torch.mm(chunk, w.t(), out=dest)
        else:
            torch.addmm(bias, chunk, w.t(), out=dest)

    gather_ring(x2, TpRing(pg, capacity_tokens, transport), consume, _call("ag_gemm", x))
    return out.view(pg.size() * x.shape[0], *x.shape[1:-1], w.shape[0])


def _check_fake_matmul(x, w, bias=None) -> None:
    torch._check(x.dim() >= 2 and w.dim() == 2, lambda: f"x must be [t, ..., K] and w [N, K], got {x.shape}, {w.shape}")
    torch._check(x.shape[-1] == w.shape[1], lambda: f"x {x.shape} and w {w.shape} differ in K")
    torch._check(bias is None or bias.shape == (w.shape[0],), lambda: f"bias must be [N = {w.shape[0]}]")


@_ag_gemm.register_fake
def _(x, w, bias, group_name, capacity_tokens, transport):
    _check_fake_matmul(x, w, bias)
    tp = resolve_group(group_name).size()
    return x.new_empty((tp * x.shape[0], *x.shape[1:-1], w.shape[0]))


@torch.library.custom_op("cpcompile::ag_gemm_backward", mutates_args=(), tags=NOT_CAPTURED)
def _ag_gemm_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_name: str, capacity_tokens: int | None, transport: str
) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_capture("ag_gemm backward (its overlapped transport is not checked under capture)")
    pg = resolve_group(group_name)
    dx = _gemm_rs_impl(dy, w.t(), pg, capacity_tokens, transport, "ag_gemm backward")  # reduce_scatter(dy @ w)
    dy2, rows = _rows(dy), x.shape[:-1].numel()
    dw = _wgrad_accumulator(w)  # [N, K] = dy.T @ all_gather(x), x re-gathered rather than kept

    def consume(src: int, chunk: torch.Tensor) -> None:
        dw.add_(dy2[src * rows : (src + 1) * rows].t() @ chunk)

    gather_ring(_rows(x), TpRing(pg, capacity_tokens, transport), consume, _call("ag_gemm backward", x))
    return dx, dw.to(w.dtype)


@_ag_gemm_backward.register_fake
def _(dy, x, w, group_name, capacity_tokens, transport):
    return x.new_empty(x.shape), w.new_empty(w.shape)  # contiguous, as the op's, whatever x's and w's strides


def _ag_gemm_setup(ctx, inputs, output):
    x, w, bias, *args = inputs  # args: group_name, capacity_tokens, transport
    ctx.save_for_backward(x, w)
    ctx.args = tuple(args)
    ctx.has_bias = bias is not None


def _ag_gemm_grad(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = torch.ops.cpcompile.ag_gemm_backward(dy, x, w, *ctx.args)
    dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
    return dx, dw, dbias, None, None, None


_ag_gemm.register_autograd(_ag_gemm_grad, setup_context=_ag_gemm_setup)


# --- gemm_rs ---------------------------------------------------------------------------


def _gemm_rs_impl(
    x: torch.Tensor, w: torch.Tensor, pg: dist.ProcessGroup, capacity_tokens: int | None, transport: str, op: str
) -> torch.Tensor:
    x2 = _rows(x)
    rows = x2.shape[0] // pg.size()
    out = x2.new_empty((rows, w.shape[0]))  # [rows, N]

    def produce(dest_rank: int, dest: torch.Tensor) -> None:
        torch.mm(x2[dest_rank * rows : (dest_rank + 1) * rows], w.t(), out=dest)

    reduce_scatter_ring(out, TpRing(pg, capacity_tokens, transport), produce, _call(op, x))
    return out.view(x.shape[0] // pg.size(), *x.shape[1:-1], w.shape[0])


@torch.library.custom_op("cpcompile::gemm_rs", mutates_args=(), tags=NOT_CAPTURED)
def _gemm_rs(
    x: torch.Tensor, w: torch.Tensor, group_name: str, capacity_tokens: int | None, transport: str
) -> torch.Tensor:
    refuse_capture("gemm_rs (its overlapped transport is not checked under capture)")
    return _gemm_rs_impl(x, w, resolve_group(group_name), capacity_tokens, transport, "gemm_rs")


@_gemm_rs.register_fake
def _(x, w, group_name, capacity_tokens, transport):
    _check_fake_matmul(x, w)
    tp = resolve_group(group_name).size()
    torch._check(x.shape[0] % tp == 0, lambda: f"x has {x.shape[0]} rows, not a multiple of the group size {tp}")
    return x.new_empty((x.shape[0] // tp, *x.shape[1:-1], w.shape[0]))


@torch.library.custom_op("cpcompile::gemm_rs_backward", mutates_args=(), tags=NOT_CAPTURED)
def _gemm_rs_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_name: str, capacity_tokens: int | None, transport: str
) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_capture("gemm_rs backward (its overlapped transport is not checked under capture)")
    pg = resolve_group(group_name)
    x2, dy2 = _rows(x), _rows(dy)
    rows = dy2.shape[0]
    dx = x2.new_empty(x2.shape)  # [tp * rows, K] = all_gather(dy) @ w: ag_gemm's ring
    dw = _wgrad_accumulator(w)  # [N, K] = all_gather(dy).T @ x, from the same gathered chunks

    def consume(src: int, chunk: torch.Tensor) -> None:
        torch.mm(chunk, w, out=dx[src * rows : (src + 1) * rows])
        dw.add_(chunk.t() @ x2[src * rows : (src + 1) * rows])

    gather_ring(dy2, TpRing(pg, capacity_tokens, transport), consume, _call("gemm_rs backward", dy))
    return dx.view(x.shape), dw.to(w.dtype)


@_gemm_rs_backward.register_fake
def _(dy, x, w, group_name, capacity_tokens, transport):
    return x.new_empty(x.shape), w.new_empty(w.shape)  # contiguous, as the op's


def _gemm_rs_setup(ctx, inputs, output):
    x, w, *args = inputs  # args: group_name, capacity_tokens, transport
    ctx.save_for_backward(x, w)
    ctx.args = tuple(args)


def _gemm_rs_grad(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = torch.ops.cpcompile.gemm_rs_backward(dy, x, w, *ctx.args)
    return dx, dw, None, None, None


_gemm_rs.register_autograd(_gemm_rs_grad, setup_context=_gemm_rs_setup)


# --- public API --------------------------------------------------------------------------


def _check_args(x: object, w: object, bias: object, capacity_tokens: object) -> None:
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if not (isinstance(t, torch.Tensor) or (name == "bias" and t is None)):
            accepted = "a torch.Tensor or None" if name == "bias" else "a torch.Tensor"
            raise TypeError(f"{name} must be {accepted}, got {type(t).__name__}")
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.dim() < 2 or x.shape[-1] == 0:
        raise ValueError(f"x must be [tokens, ..., K] (at least 2-D, K >= 1), got shape {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"w must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got shape {tuple(w.shape)}")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bias must be [N] = [{w.shape[0]}], got shape {tuple(bias.shape)}")
    for name, t in (("w", w), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{name} must match x's dtype and device ({x.dtype}, {x.device}), got {t.dtype}, {t.device}"
            )
    if capacity_tokens is not None and (
        not isinstance(capacity_tokens, int) or isinstance(capacity_tokens, bool) or capacity_tokens < 1
    ):
        raise ValueError(f"capacity_tokens must be None or an int >= 1, got {capacity_tokens!r}")


def ag_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group=None,
    capacity_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    tp_comm: str | None = None,
) -> torch.Tensor:
    """``all_gather(x, dim=0) @ w.T + bias`` with the gather overlapped with the matmul.

    Args:
        x: ``[t, ..., K]`` this rank's tokens (every rank of ``group`` passes the same shape).
        w: ``[N, K]`` this rank's weight (a column-parallel shard); bias: ``[N]`` or None.
        group: the TP process group, its name, or ``None`` (default group).
        capacity_tokens: the most tokens (rows ``t * ...``) a call may pass; the gather
            buffer ``[tp * capacity_tokens, K]`` is allocated once. ``None``: sized by the
            largest call so far, rounded up to a power of two.
        tp_comm: the transport, one of :data:`cpcompile.config.TP_COMMS` (``None``: ``cpcompile.config.DEFAULTS``'s).
    Returns:
        ``[tp * t, ..., N]``, rank-major like ``all_gather_into_tensor``; same dtype as x.
    """
    _check_args(x, w, bias, capacity_tokens)
    transport = DEFAULTS.tp_comm if tp_comm is None else check_choice("tp_comm", tp_comm, TP_COMMS)
    return torch.ops.cpcompile.ag_gemm(x, w, bias, _group_name(group), capacity_tokens, transport)


def gemm_rs(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group=None,
    capacity_tokens: int | None = None,
    tp_comm: str | None = None,
) -> torch.Tensor:
    """``reduce_scatter(x @ w.T, dim=0)`` (sum) with the matmul overlapped with the communication.

    Args:
        x: ``[tp * t, ..., K]`` this rank's activations (a row-parallel layer's input).
        w: ``[N, K]`` this rank's weight (a row-parallel shard).
        group: the TP process group, its name, or ``None`` (default group).
        capacity_tokens: the most tokens (rows ``t * ...``) of the *output* per rank; the
            buffer ``[3 * capacity_tokens, N]`` is allocated once. ``None`` as in :func:`ag_gemm`.
        tp_comm: the transport, one of :data:`cpcompile.config.TP_COMMS` (``None``: ``cpcompile.config.DEFAULTS``'s).
    Returns:
        ``[t, ..., N]``: rank r's rows ``[r * t, (r + 1) * t)`` of the sum over ranks.
    """
    _check_args(x, w, None, capacity_tokens)
    # traced, the op's fake kernel checks it: resolving a group by its name cannot be traced
    if not torch.compiler.is_compiling():
        tp = resolve_group(group).size()
        if x.shape[0] % tp != 0:
            raise ValueError(f"x.shape[0] = {x.shape[0]} must be a multiple of the group size {tp}")
    transport = DEFAULTS.tp_comm if tp_comm is None else check_choice("tp_comm", tp_comm, TP_COMMS)
    return torch.ops.cpcompile.gemm_rs(x, w, _group_name(group), capacity_tokens, transport)

"""Tensor-parallel matmuls overlapped with their communication, on a capacity buffer.

``ag_gemm(x, w)`` is ``all_gather(x) @ w.T`` and ``gemm_rs(x, w)`` is
``reduce_scatter(x @ w.T)``, both along dim 0 (the tokens of sequence parallelism).

Design constraint: the token count ``t`` changes every microbatch and stays symbolic
in compiled graphs, so the communication buffer can neither be registered at one
fixed shape (TransformerEngine's comm/GEMM overlap) nor be allocated per call in the
hot loop. One buffer per (role, group, dtype, device, feature size) is allocated at
capacity; each call uses a contiguous prefix of it, the active shape.

Ring: rank r multiplies the chunk it holds while the next chunk is in flight.
Two transports, same numbers:

- CUDA on NCCL (default): torch's symmetric memory. Peers' chunks are copied by the
  copy engine on a side stream, which takes no SMs from the matmuls on the current
  stream (NCCL's p2p kernels were seen to serialize with a concurrent GEMM on H200).
  ``CPCOMPILE_TP_COMM=p2p`` selects the other transport.
- Otherwise (CPU/gloo, or ``CPCOMPILE_TP_COMM=p2p``): ``batch_isend_irecv`` to r + 1
  and from r - 1, exact and plain.

The backward of one op runs the other's ring: ag_gemm's dx is ``gemm_rs(dy, w.T)``,
gemm_rs's dx is ``ag_gemm(dy, w.T)``; the weight gradient is accumulated (in float32
for 16-bit dtypes) from the chunks as they pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import distributed as cpdist
from ..checks import data_checks_enabled


class CapacityBuffers:
    """Communication buffers, one per (role, group, dtype, device, features), allocated at capacity.

    ``allocations`` counts every allocation (tests pin that it stays flat in the loop).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, object]] = {}
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.allocations = 0

    def prefix(
        self,
        role: str,
        group_name: str,
        like: torch.Tensor,
        *,
        slots: int,
        rows: int,
        features: int,
        capacity: int | None,
        symmetric: bool = False,
    ) -> tuple[torch.Tensor, object]:
        """The active prefix ``[slots, rows, features]`` of the buffer for this key, and its handle.

        With ``capacity`` the buffer holds ``slots * capacity`` rows; without, it holds
        the largest ``rows`` seen so far rounded up to a power of two. ``symmetric``:
        torch symmetric memory that peers read and write (the handle); allocating it is
        collective, which holds because every rank calls with the same ``rows``.
        """
        key = (role, symmetric, group_name, like.dtype, like.device, features)
        entry = self._buffers.get(key)
        if entry is None or entry[0].shape[0] < slots * max(rows, capacity or 0):
            per_slot = capacity if capacity is not None else 1 << (rows - 1).bit_length()
            if entry is not None and symmetric:  # peers may still be reading the old buffer
                entry[1].barrier(channel=0)
                torch.cuda.synchronize(like.device)
            if symmetric:
                from torch.distributed import _symmetric_memory as symm_mem  # only the CUDA transport needs it

                buf = symm_mem.empty(slots * per_slot, features, dtype=like.dtype, device=like.device)
                entry = (buf, symm_mem.rendezvous(buf, group_name))
            else:
                entry = (like.new_empty((slots * per_slot, features)), None)
            self._buffers[key] = entry
            self.allocations += 1
        buf, handle = entry
        return buf[: slots * rows].view(slots, rows, features), handle

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def clear(self) -> None:
        """Free every buffer (the next call allocates again)."""
        self._buffers.clear()


BUFFERS = CapacityBuffers()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[d0, ..., F]`` -> contiguous ``[d0 * ..., F]``: p2p ops need contiguous rows."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _enter_ring(pg: dist.ProcessGroup, rows: int, capacity: int | None, like: torch.Tensor) -> None:
    """Raise on every rank, before any p2p, if ``rows`` exceeds capacity or ranks disagree on it.

    The agreement check is one min/max all-reduce; it runs where data checks run (CPU
    always, CUDA with ``CPCOMPILE_VALIDATE=1``) because on CUDA it costs a host sync.
    """
    error = None
    if capacity is not None and rows > capacity:
        error = ValueError(
            f"{rows} tokens per rank exceed capacity_tokens={capacity}: the buffer is allocated once at "
            "capacity and never grown in the loop; pass capacity_tokens >= the largest token count"
        )
    if pg.size() > 1 and data_checks_enabled(like):
        _agree_on_rows(pg, rows, error)
    elif error is not None:
        raise error


def _agree_on_rows(pg: dist.ProcessGroup, rows: int, error: Exception | None) -> None:
    device = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
    stats = torch.tensor([int(error is not None), rows, -rows], dtype=torch.int64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=pg)  # max(-x) = -min(x)
    failed, hi, neg_lo = stats.tolist()
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"another rank of TP group {pg.group_name!r} rejected its token count (see its error)")
    if hi != -neg_lo:
        # Every rank saw the same min/max, so every rank joins this second collective.
        counts = cpdist.all_gather_rows(torch.tensor([rows], device=device), pg).tolist()
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(
            f"ranks of TP group {pg.group_name!r} disagree on the token count ({listed}); "
            "all ranks must pass the same number of tokens"
        )


def _copy_engine(pg: dist.ProcessGroup, t: torch.Tensor) -> bool:
    return t.is_cuda and dist.get_backend(pg) == "nccl" and os.environ.get("CPCOMPILE_TP_COMM", "symm_mem") != "p2p"


def _shift(send: torch.Tensor, recv: torch.Tensor, pg: dist.ProcessGroup) -> list:
    """Start sending ``send`` to rank + 1 and receiving ``recv`` from rank - 1."""
    tp, rank = pg.size(), pg.rank()
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, group=pg, group_peer=(rank + 1) % tp),
            dist.P2POp(dist.irecv, recv, group=pg, group_peer=(rank - 1) % tp),
        ]
    )


def _gather_ring(
    x: torch.Tensor, pg: dist.ProcessGroup, capacity: int | None, consume: Callable[[int, torch.Tensor], None]
) -> None:
    """Call ``consume(src, x_src)`` for every rank's ``x [rows, F]``, the next one in flight meanwhile."""
    tp, rank = pg.size(), pg.rank()
    _enter_ring(pg, x.shape[0], capacity, x)
    if tp == 1:
        return consume(rank, x)
    shape = dict(rows=x.shape[0], features=x.shape[1], capacity=capacity)
    buf, _ = BUFFERS.prefix("gather", pg.group_name, x, slots=tp, **shape)  # [tp, rows, F]
    if _copy_engine(pg, x):
        return _gather_copy_engine(x, pg, buf, shape, consume)
    chunk = x
    for i in range(tp):
        src = (rank - i) % tp
        works = _shift(chunk, buf[(src - 1) % tp], pg) if i < tp - 1 else []
        consume(src, chunk)
        for work in works:
            work.wait()
        chunk = buf[(src - 1) % tp]


def _gather_copy_engine(x, pg, buf, shape, consume) -> None:
    """Peers' chunks copied from their symmetric buffers on a side stream, consumed in arrival order."""
    tp, rank = pg.size(), pg.rank()
    mine, handle = BUFFERS.prefix("gather", pg.group_name, x, slots=1, symmetric=True, **shape)
    current, side = torch.cuda.current_stream(), BUFFERS.side_stream(x.device)
    handle.barrier(channel=0)  # every peer is done reading `mine` from the previous call
    mine[0].copy_(x)
    handle.barrier(channel=1)  # every rank's chunk is readable
    side.wait_stream(current)
    arrivals = []
    with torch.cuda.stream(side):
        for step in range(1, tp):
            src = (rank + step) % tp
            buf[src].copy_(handle.get_buffer(src, tuple(x.shape), x.dtype, 0))
            arrivals.append((src, side.record_event()))
    consume(rank, x)
    for src, arrived in arrivals:
        current.wait_event(arrived)
        consume(src, buf[src])


def _reduce_scatter_ring(
    out: torch.Tensor, pg: dist.ProcessGroup, capacity: int | None, produce: Callable[[int, torch.Tensor], None]
) -> None:
    """``out [rows, F]`` = sum over ranks of their ``produce(rank, dest)`` partials for this rank.

    The partial sum for rank d starts at d + 1 and travels the ring, each rank adding
    its own partial while the previous sum is in flight; it ends at d after tp - 1 hops.
    """
    tp, rank = pg.size(), pg.rank()
    _enter_ring(pg, out.shape[0], capacity, out)
    if tp == 1:
        return produce(rank, out)
    shape = dict(rows=out.shape[0], features=out.shape[1], capacity=capacity)
    if _copy_engine(pg, out):
        return _reduce_scatter_copy_engine(out, pg, shape, produce)
    # [3, rows, F]: two partial sums alternating, one receive slot
    buf, _ = BUFFERS.prefix("reduce_scatter", pg.group_name, out, slots=3, **shape)
    works: list = []
    for i in range(tp):
        acc = out if i == tp - 1 else buf[i % 2]
        produce((rank - 1 - i) % tp, acc)
        for work in works:
            work.wait()
        if i:
            acc.add_(buf[2])
        if i < tp - 1:
            works = _shift(acc, buf[2], pg)


def _reduce_scatter_copy_engine(out, pg, shape, produce) -> None:
    """Each partial is written into its owner's symmetric inbox on a side stream while the next is computed."""
    tp, rank = pg.size(), pg.rank()
    rows, features = out.shape
    inbox, handle = BUFFERS.prefix("reduce_scatter", pg.group_name, out, slots=tp, symmetric=True, **shape)
    outgoing, _ = BUFFERS.prefix("reduce_scatter", pg.group_name, out, slots=tp, **shape)  # [tp, rows, F]
    current, side = torch.cuda.current_stream(), BUFFERS.side_stream(out.device)
    handle.barrier(channel=0)  # every peer has summed its inbox of the previous call
    for step in range(1, tp):
        dest = (rank + step) % tp
        produce(dest, outgoing[dest])
        side.wait_stream(current)
        with torch.cuda.stream(side):  # into slot `rank` of dest's inbox
            handle.get_buffer(dest, (rows, features), out.dtype, rank * rows * features).copy_(outgoing[dest])
    produce(rank, inbox[rank])
    current.wait_stream(side)
    handle.barrier(channel=1)  # every partial has landed
    out.copy_(inbox.sum(0, dtype=torch.promote_types(out.dtype, torch.float32)))


def _wgrad_accumulator(w: torch.Tensor) -> torch.Tensor:
    return torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)


# --- ag_gemm ---------------------------------------------------------------------------


@torch.library.custom_op("cpcompile::ag_gemm", mutates_args=())
def _ag_gemm(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, group_name: str, capacity_tokens: int | None
) -> torch.Tensor:
    pg = cpdist.resolve_group(group_name)
    x2, rows = _rows(x), x.shape[:-1].numel()
    out = x2.new_empty((pg.size() * rows, w.shape[0]))  # [tp * rows, N]

    def consume(src: int, chunk: torch.Tensor) -> None:
        dest = out[src * rows : (src + 1) * rows]
        if bias is None:
            torch.mm(chunk, w.t(), out=dest)
        else:
            torch.addmm(bias, chunk, w.t(), out=dest)

    _gather_ring(x2, pg, capacity_tokens, consume)
    return out.view(pg.size() * x.shape[0], *x.shape[1:-1], w.shape[0])


def _check_fake_matmul(x, w, bias=None) -> None:
    torch._check(x.dim() >= 2 and w.dim() == 2, lambda: f"x must be [t, ..., K] and w [N, K], got {x.shape}, {w.shape}")
    torch._check(x.shape[-1] == w.shape[1], lambda: f"x {x.shape} and w {w.shape} differ in K")
    torch._check(bias is None or bias.shape == (w.shape[0],), lambda: f"bias must be [N = {w.shape[0]}]")


@_ag_gemm.register_fake
def _(x, w, bias, group_name, capacity_tokens):
    _check_fake_matmul(x, w, bias)
    tp = cpdist.resolve_group(group_name).size()
    return x.new_empty((tp * x.shape[0], *x.shape[1:-1], w.shape[0]))


@torch.library.custom_op("cpcompile::ag_gemm_backward", mutates_args=())
def _ag_gemm_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_name: str, capacity_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    pg = cpdist.resolve_group(group_name)
    dx = _gemm_rs_impl(dy, w.t(), pg, capacity_tokens)  # reduce_scatter(dy @ w): [t, ..., K]
    dy2, rows = _rows(dy), x.shape[:-1].numel()
    dw = _wgrad_accumulator(w)  # [N, K] = dy.T @ all_gather(x), x re-gathered rather than kept

    def consume(src: int, chunk: torch.Tensor) -> None:
        dw.add_(dy2[src * rows : (src + 1) * rows].t() @ chunk)

    _gather_ring(_rows(x), pg, capacity_tokens, consume)
    return dx, dw.to(w.dtype)


@_ag_gemm_backward.register_fake
def _(dy, x, w, group_name, capacity_tokens):
    return torch.empty_like(x), torch.empty_like(w)


def _ag_gemm_setup(ctx, inputs, output):
    x, w, bias, group_name, capacity_tokens = inputs
    ctx.save_for_backward(x, w)
    ctx.args = (group_name, capacity_tokens)
    ctx.has_bias = bias is not None


def _ag_gemm_grad(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = torch.ops.cpcompile.ag_gemm_backward(dy, x, w, *ctx.args)
    dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
    return dx, dw, dbias, None, None


_ag_gemm.register_autograd(_ag_gemm_grad, setup_context=_ag_gemm_setup)


# --- gemm_rs ---------------------------------------------------------------------------


def _gemm_rs_impl(x: torch.Tensor, w: torch.Tensor, pg: dist.ProcessGroup, capacity_tokens: int | None) -> torch.Tensor:
    x2 = _rows(x)
    rows = x2.shape[0] // pg.size()
    out = x2.new_empty((rows, w.shape[0]))  # [rows, N]

    def produce(dest_rank: int, dest: torch.Tensor) -> None:
        torch.mm(x2[dest_rank * rows : (dest_rank + 1) * rows], w.t(), out=dest)

    _reduce_scatter_ring(out, pg, capacity_tokens, produce)
    return out.view(x.shape[0] // pg.size(), *x.shape[1:-1], w.shape[0])


@torch.library.custom_op("cpcompile::gemm_rs", mutates_args=())
def _gemm_rs(x: torch.Tensor, w: torch.Tensor, group_name: str, capacity_tokens: int | None) -> torch.Tensor:
    return _gemm_rs_impl(x, w, cpdist.resolve_group(group_name), capacity_tokens)


@_gemm_rs.register_fake
def _(x, w, group_name, capacity_tokens):
    _check_fake_matmul(x, w)
    tp = cpdist.resolve_group(group_name).size()
    torch._check(x.shape[0] % tp == 0, lambda: f"x has {x.shape[0]} rows, not a multiple of the group size {tp}")
    return x.new_empty((x.shape[0] // tp, *x.shape[1:-1], w.shape[0]))


@torch.library.custom_op("cpcompile::gemm_rs_backward", mutates_args=())
def _gemm_rs_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_name: str, capacity_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    pg = cpdist.resolve_group(group_name)
    x2, dy2 = _rows(x), _rows(dy)
    rows = dy2.shape[0]
    dx = x2.new_empty(x2.shape)  # [tp * rows, K] = all_gather(dy) @ w: ag_gemm's ring
    dw = _wgrad_accumulator(w)  # [N, K] = all_gather(dy).T @ x, from the same gathered chunks

    def consume(src: int, chunk: torch.Tensor) -> None:
        torch.mm(chunk, w, out=dx[src * rows : (src + 1) * rows])
        dw.add_(chunk.t() @ x2[src * rows : (src + 1) * rows])

    _gather_ring(dy2, pg, capacity_tokens, consume)
    return dx.view(x.shape), dw.to(w.dtype)


@_gemm_rs_backward.register_fake
def _(dy, x, w, group_name, capacity_tokens):
    return torch.empty_like(x), torch.empty_like(w)


def _gemm_rs_setup(ctx, inputs, output):
    x, w, group_name, capacity_tokens = inputs
    ctx.save_for_backward(x, w)
    ctx.args = (group_name, capacity_tokens)


def _gemm_rs_grad(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = torch.ops.cpcompile.gemm_rs_backward(dy, x, w, *ctx.args)
    return dx, dw, None, None


_gemm_rs.register_autograd(_gemm_rs_grad, setup_context=_gemm_rs_setup)


# --- public API --------------------------------------------------------------------------


def _check_args(x: object, w: object, bias: object, capacity_tokens: object) -> None:
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if not (isinstance(t, torch.Tensor) or (name == "bias" and t is None)):
            accepted = "a torch.Tensor or None" if name == "bias" else "a torch.Tensor"
            raise TypeError(f"{name} must be {accepted}, got {type(t).__name__}")
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must be [tokens, ..., K] (at least 2-D), got shape {tuple(x.shape)}")
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
) -> torch.Tensor:
    """``all_gather(x, dim=0) @ w.T + bias`` with the gather overlapped with the matmul.

    Args:
        x: ``[t, ..., K]`` this rank's tokens (every rank of ``group`` passes the same shape).
        w: ``[N, K]`` this rank's weight (a column-parallel shard); bias: ``[N]`` or None.
        group: the TP process group, its name, or ``None`` (default group).
        capacity_tokens: the most tokens (rows ``t * ...``) a call may pass; the gather
            buffer ``[tp * capacity_tokens, K]`` is allocated once. ``None``: sized by the
            largest call so far, rounded up to a power of two.
    Returns:
        ``[tp * t, ..., N]``, rank-major like ``all_gather_into_tensor``; same dtype as x.
    """
    _check_args(x, w, bias, capacity_tokens)
    return torch.ops.cpcompile.ag_gemm(x, w, bias, cpdist.group_name(group), capacity_tokens)


def gemm_rs(x: torch.Tensor, w: torch.Tensor, *, group=None, capacity_tokens: int | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ w.T, dim=0)`` (sum) with the matmul overlapped with the communication.

    Args:
        x: ``[tp * t, ..., K]`` this rank's activations (a row-parallel layer's input).
        w: ``[N, K]`` this rank's weight (a row-parallel shard).
        group: the TP process group, its name, or ``None`` (default group).
        capacity_tokens: the most tokens (rows ``t * ...``) of the *output* per rank; the
            buffer ``[3 * capacity_tokens, N]`` is allocated once. ``None`` as in :func:`ag_gemm`.
    Returns:
        ``[t, ..., N]``: rank r's rows ``[r * t, (r + 1) * t)`` of the sum over ranks.
    """
    _check_args(x, w, None, capacity_tokens)
    tp = cpdist.resolve_group(group).size()
    if x.shape[0] % tp != 0:
        raise ValueError(f"x.shape[0] = {x.shape[0]} must be a multiple of the group size {tp}")
    return torch.ops.cpcompile.gemm_rs(x, w, cpdist.group_name(group), capacity_tokens)

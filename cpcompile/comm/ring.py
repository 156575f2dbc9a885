"""Rings of row chunks between ranks: the CP ring's K/V rotation (:func:`rotate`, for
``attention/ring.py``) and the TP overlap's transports on capacity buffers (:func:`gather_ring`,
:func:`reduce_scatter_ring`, for ``tp/ops.py``), all built on one p2p step (:func:`shift`).

Design constraint: the token count ``t`` changes every microbatch and stays symbolic
in compiled graphs, so the communication buffer can neither be registered at one
fixed shape (TransformerEngine's comm/GEMM overlap) nor be allocated per call in the
hot loop. One buffer per (role, group, dtype, device, feature size) is allocated at
capacity; each call uses a contiguous prefix of it, the active shape.

Ring: rank r works on the chunk it holds while the next chunk is in flight.
Two transports, same numbers:

- ``transport="symm_mem"`` (the default) on CUDA with NCCL: torch's symmetric memory.
  Peers' chunks are copied by the copy engine on a side stream, which takes no SMs from
  the matmuls on the current stream (NCCL's p2p kernels serialize with a concurrent
  GEMM: docs/communication.md).
- Otherwise (CPU/gloo, or ``transport="p2p"``): ``batch_isend_irecv`` to r + 1 and
  from r - 1, exact and plain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from cpcompile.checks import agreement_enabled
from cpcompile.comm.groups import agree
from cpcompile.config import TP_COMMS, check_choice


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


class TpRing(NamedTuple):
    """A TP group's ring for :func:`gather_ring` and :func:`reduce_scatter_ring`: the group, the
    rows per rank its buffers hold (``None``: each call's own), and the transport
    (``backend(tp_comm=...)``: ``"symm_mem"`` where it runs, else p2p)."""

    group: dist.ProcessGroup
    capacity: int | None
    transport: str = "symm_mem"


def _enter_ring(ring: TpRing, x: torch.Tensor, call: dict[str, object]) -> dict:
    """The ring's buffer shape for ``x [rows, F]`` (``BUFFERS.prefix``'s keywords), after raising on
    every rank, before any p2p, if ``rows`` exceeds the capacity or ranks disagree on it, on the rows'
    width, on their dtype or on ``call`` (the op and its input's shape: ranks in different ops, or
    with rows of other shapes, would exchange rows that fit yet mean something else) (``groups.agree``,
    where ``checks.agreement_enabled`` says so: on CUDA it costs a host sync)."""
    pg, capacity, _ = ring
    rows = x.shape[0]
    error = None
    if capacity is not None and rows > capacity:
        error = ValueError(
            f"{rows} tokens per rank exceed capacity_tokens={capacity}: the buffer is allocated once at "
            "capacity and never grown in the loop; pass capacity_tokens (cpcompile.backend's tp_capacity_tokens) "
            ">= the largest token count"
        )
    try:
        if agreement_enabled(pg, x):
            # rows of other widths or dtypes would be read as garbage, or abort the transport
            record = {"token count (rows per TP rank)": rows, "row width": x.shape[1], "dtype": str(x.dtype), **call}
            agree(pg, error, record if error is None else {})
        elif error is not None:
            raise error
    finally:
        error = None  # see groups.agree: a raised error must not hold the frame that holds it
    return dict(rows=rows, features=x.shape[1], capacity=capacity)


def _copy_engine(pg: dist.ProcessGroup, t: torch.Tensor, transport: str) -> bool:
    check_choice("transport", transport, TP_COMMS)
    return transport == "symm_mem" and t.is_cuda and dist.get_backend(pg) == "nccl"


def shift(send: torch.Tensor, recv: torch.Tensor, pg: dist.ProcessGroup) -> list:
    """Start sending ``send`` to rank + 1 and receiving ``recv`` from rank - 1."""
    tp, rank = pg.size(), pg.rank()
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, group=pg, group_peer=(rank + 1) % tp),
            dist.P2POp(dist.irecv, recv, group=pg, group_peer=(rank - 1) % tp),
        ]
    )


def rotate(x: torch.Tensor, group: dist.ProcessGroup) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(src, x_src)`` for every rank's ``x [T_local, ...]``, own first, in ring order
    (rank ``r`` gets rank ``r - i``'s at step ``i``); the next block is in flight while the
    caller works on the one yielded. At most three blocks exist at a time."""
    cp, rank = group.size(), group.rank()
    spare = [torch.empty_like(x) for _ in range(min(2, cp - 1))]  # the one received, the one arriving
    current = x
    for i in range(cp - 1):
        works = shift(current, spare[i % 2], group)
        yield (rank - i) % cp, current
        for work in works:
            work.wait()
        current = spare[i % 2]
    yield (rank + 1) % cp, current


def gather_ring(
    x: torch.Tensor, ring: TpRing, consume: Callable[[int, torch.Tensor], None], call: dict[str, object]
) -> None:
    """Call ``consume(src, x_src)`` for every rank's ``x [rows, F]``, the next one in flight meanwhile;
    ``call``: what every rank's must equal (:func:`_enter_ring`)."""
    pg = ring.group
    tp, rank, shape = pg.size(), pg.rank(), _enter_ring(ring, x, call)
    if tp == 1:
        return consume(rank, x)
    buf, _ = BUFFERS.prefix("gather", pg.group_name, x, slots=tp, **shape)  # [tp, rows, F]
    if _copy_engine(pg, x, ring.transport):
        return _gather_copy_engine(x, pg, buf, shape, consume)
    chunk = x
    for i in range(tp):
        src = (rank - i) % tp
        works = shift(chunk, buf[(src - 1) % tp], pg) if i < tp - 1 else []
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


def reduce_scatter_ring(
    out: torch.Tensor, ring: TpRing, produce: Callable[[int, torch.Tensor], None], call: dict[str, object]
) -> None:
    """``out [rows, F]`` = sum over ranks of their ``produce(rank, dest)`` partials for this rank;
    ``call``: what every rank's must equal (:func:`_enter_ring`).

    The partial sum for rank d starts at d + 1 and travels the ring, each rank adding
    its own partial while the previous sum is in flight; it ends at d after tp - 1 hops.
    """
    pg = ring.group
    tp, rank, shape = pg.size(), pg.rank(), _enter_ring(ring, out, call)
    if tp == 1:
        return produce(rank, out)
    if _copy_engine(pg, out, ring.transport):
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
            works = shift(acc, buf[2], pg)


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

"""The all-gather path's transport: K/V all-gathered in head groups, dK/dV reduce-scattered.

K/V heads are split into ``chunks`` groups (``StrategySpec.kv_chunks``, lowered to a divisor of
the K/V head count); every group's all-gather is issued at once, asynchronously, so that
attention over group i can run while group i+1 is in flight. K and V go in separate
collectives, so that nothing copies them into one buffer first. The backward's dK/dV
sums are written by the kernel straight into kept buffers in the gathered order
(:func:`grad_buffers`) and reduce-scattered from there. Whether pipelining by head
groups pays is measured in docs/communication.md (on 2 GPUs it does not, so 1 is the default).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

from cpcompile.cache import same_plan, token
from cpcompile.comm.collectives import all_gather_rows, reduce_scatter_rows


def kv_chunks(want: int, kv_heads: int) -> int:
    """How many head groups to pipeline: ``want`` (``StrategySpec.kv_chunks``), lowered to a divisor of ``kv_heads``."""
    if not isinstance(want, int) or isinstance(want, bool) or want < 1:
        raise ValueError(f"kv_chunks must be a positive int, got {want!r}")
    return max(c for c in range(1, min(want, kv_heads) + 1) if kv_heads % c == 0)


def start_gathers(k, v, group, chunks):
    """Start the all-gathers of K and V per head group: ``[((k_buffer, work), (v_buffer, work))]``.

    K and V go in separate collectives, so that nothing copies them into one buffer
    first (with one chunk they are sent as they are; the cost of that copy:
    docs/communication.md)."""
    per = k.shape[1] // chunks
    return [
        tuple(all_gather_rows(t[:, i * per : (i + 1) * per], group, async_op=True) for t in (k, v))
        for i in range(chunks)
    ]


@dataclasses.dataclass
class _Kept:
    """One pair of kept buffers and what it was last used for."""

    storage: torch.Tensor  # [capacity] float32 (float64 for float64 inputs): dK's, then dV's
    allocated: torch.cuda.Stream | None  # the stream it was allocated on (None off CUDA)
    pieces: list | None = None  # tokens of the pieces it is zeroed for
    chunks: int | None = None
    last: torch.cuda.Stream | None = None  # the stream of the last call


class _Held(dict):
    """One thread's kept buffers: (device, dtype, Hkv, D, Dv) -> :class:`_Kept`."""


_local = threading.local()  # a thread's _Held goes with the thread
_every = weakref.WeakValueDictionary()  # id -> every live thread's, for release_grad_buffers
_every_lock = threading.Lock()


def grad_buffers(
    gather_index: torch.Tensor, pieces, k: torch.Tensor, v: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduce-scatter inputs of dK and dV, float32 (float64 for float64 ``k``)
    ``[chunks, T, Hkv / chunks, D]`` and ``[chunks, T, Hkv / chunks, Dv]``
    (``T`` from ``gather_index``, ``Hkv, D`` from the local ``k``, ``Dv`` from ``v``), 0 at every key
    row the pieces ``(cu_q, k_start, k_len)`` do not read.

    Kept from call to call, one pair per thread, device and head shape, grown to the
    largest ``T`` yet (memory: ``T x Hkv x (D + Dv)`` floats, as one layer's dK/dV sums take
    anyway; :func:`release_grad_buffers` frees them), and zeroed when the pieces (plan
    and mask: causal and full layers read different keys of one plan) or ``chunks``
    change: the kernels write only the rows of the keys that pieces read
    (``scratch.add_back``). The layers of a step share their pieces, so the other rows
    are zeroed once per step, not written in every layer; backwards that alternate
    between pieces (causal and full layers, interleaved micro-batches) zero them at
    every switch. A call on another stream than the last waits for that stream, where
    the last reduce-scatters were waited for (they read these buffers), and the
    allocator is told of the stream, so that freeing them waits for it too.
    """
    t, (hkv, d), dv = gather_index.shape[0], k.shape[1:], v.shape[2]
    n_k, n = t * hkv * d, t * hkv * (d + dv)
    mine = getattr(_local, "held", None)
    if mine is None:
        mine = _local.held = _Held()
        with _every_lock:
            _every[id(mine)] = mine
    current = torch.cuda.current_stream(k.device) if k.is_cuda else None
    acc = torch.promote_types(k.dtype, torch.float32)
    kept = mine.get((k.device, acc, hkv, d, dv))
    if kept is None or kept.storage.shape[0] < n:
        kept = mine[k.device, acc, hkv, d, dv] = _Kept(torch.empty(n, dtype=acc, device=k.device), current)
    if kept.last is not None and kept.last != current:
        current.wait_stream(kept.last)
    if current is not None and current != kept.allocated:
        kept.storage.record_stream(current)
    plan = (gather_index, *pieces)
    if kept.pieces is None or kept.chunks != chunks or not all(map(same_plan, kept.pieces, plan)):
        kept.storage[:n].zero_()  # the previous pieces' sums
        kept.pieces, kept.chunks = [token(x) for x in plan], chunks
    kept.last = current
    shape = (chunks, t, hkv // chunks)
    return kept.storage[:n_k].view(*shape, d), kept.storage[n_k:n].view(*shape, dv)


def release_grad_buffers() -> None:
    """Free the dK/dV buffers that ``cp_attention``'s backward keeps (every thread's), e.g.
    before evaluation; the next backward makes them again."""
    with _every_lock:
        for held in list(_every.values()):
            held.clear()


def wait_physical(pending, gather_index):
    """Wait for one group's gathers and put them in physical order: k, v ``[T, Hkv / chunks, D]``."""
    out = []
    for buffer, work in pending:
        work.wait()
        out.append(buffer.index_select(0, gather_index))
    return out


def start_reduce_scatters(dk_all: torch.Tensor, dv_all: torch.Tensor, group) -> list:
    """Start summing one head group's dK/dV sums ``[T, Hkv / chunks, D]`` over ranks, each rank
    keeping its own rows: ``[(dk_out, work), (dv_out, work)]``. K's and V's go in separate
    collectives, so that nothing reorders or concatenates them first."""
    return [reduce_scatter_rows(t, group, async_op=True) for t in (dk_all, dv_all)]

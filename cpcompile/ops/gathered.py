"""All-gather CP attention with the K/V gather hidden behind compute.

K/V heads are split into ``chunks`` groups. Every group's all-gather is issued at
once (asynchronously); attention for group i, whose query heads are exactly those
that read its K/V heads (GQA keeps them contiguous), runs while group i+1 is still
in flight. The backward does the same with the re-gather, and starts each group's
dK/dV reduce-scatter as soon as that group's gradients exist. ``chunks = 1`` is the
plain path: K and V gathered as they are, one kernel call each way.

The kernel writes dK/dV sums straight in the gathered order (``key_order``: it only
reorders the index of its add-back, once per plan), and only at the rows of keys
the rank's pieces read, into buffers that are kept and zeroed when the pieces
change (:func:`grad_buffers`); K's and V's go to their reduce-scatters as they are.
Reordering them from physical order into one ``[T, 2 Hkv, D]`` float32 buffer
first took 2.1-2.4 ms of a 16/16 rank's forward+backward at cp=2 on 2 H200s
(0.7-1.1 ms at 32/8).

The number of chunks comes from ``CPCOMPILE_KV_CHUNKS`` (default 1), reduced to a
divisor of the K/V head count. Measured on 2 H200s (docs/communication.md, cp=2), 2
chunks were 6-11 % slower than 1 at heads 32/8 in forward and 4-5 % in
forward+backward, and within 1 % at 16/16 forward+backward, so pipelining is opt-in.
A timeline of a 16/16 forward shows why: the groups' gathers run one after the
other on NCCL's stream, group 1's overlapped group 0's kernel by only about 0.5 ms,
and the copies chunks need (K/V head slices made contiguous for NCCL, query heads
sliced for the kernel, the outputs concatenated) cost about as much. A NCCL
stream of high priority was nowhere faster.

Attending first, while the gather is in flight, over the pieces whose keys are
the rank's own rows (a whole document, or a document's first piece, causal: 65-97 %
of balanced's and no_load_balance's work at cp=2), then over the rest, with the two
results added (each row is one call's), did not pay either, on 2 H200s at cp=2: 16/16
forward 6.17 -> 5.90 ms (balanced), but 32/8 forward 8.84 -> 9.34, and
forward+backward slower for every layout (balanced 42.26 -> 45.28 ms; no_load_balance
44.65 -> 63.51, where the local call's scratch, bounded against the local keys alone,
sent it to flash's backward). The adds over the output and the float32 dK/dV and the
second call's tail ate what was hidden.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

import torch

from .. import distributed as cpdist
from ..per_plan import per_plan, same_plan, token


def kv_chunks(kv_heads: int) -> int:
    """How many head groups to pipeline: the setting, lowered to a divisor of ``kv_heads``."""
    want = int(os.environ.get("CPCOMPILE_KV_CHUNKS", "1"))
    if want < 1:
        raise ValueError(f"CPCOMPILE_KV_CHUNKS must be a positive int, got {want}")
    return max(c for c in range(1, min(want, kv_heads) + 1) if kv_heads % c == 0)


def _issue_gathers(k, v, group, chunks):
    """Start the all-gathers of K and V per head group: ``[((k_buffer, work), (v_buffer, work))]``.

    K and V go in separate collectives, so that nothing copies them into one buffer
    first (with one chunk they are sent as they are: at heads 16/16 on the H200 the
    concatenation took 0.27 ms of a 6.7 ms forward at cp=2)."""
    per = k.shape[1] // chunks
    return [
        tuple(cpdist.all_gather_rows(t[:, i * per : (i + 1) * per], group, async_op=True) for t in (k, v))
        for i in range(chunks)
    ]


@per_plan
def gathered_order(gather_index: torch.Tensor) -> torch.Tensor:
    """``[T]`` the physical row of each all-gathered row (``gather_index`` inverted), once per plan:
    the ``key_order`` in which the backward's kernel hands dK/dV to the reduce-scatter."""
    rows = torch.arange(gather_index.shape[0], device=gather_index.device)
    return torch.empty_like(gather_index).scatter_(0, gather_index, rows)


@dataclasses.dataclass
class _Kept:
    """One pair of kept buffers and what it was last used for."""

    storage: torch.Tensor  # [2, capacity] float32 (float64 for float64 inputs): dK's and dV's
    allocated: torch.cuda.Stream | None  # the stream it was allocated on (None off CUDA)
    pieces: list | None = None  # tokens of the pieces it is zeroed for
    chunks: int | None = None
    last: torch.cuda.Stream | None = None  # the stream of the last call


class _Held(dict):
    """One thread's kept buffers: (device, dtype, Hkv, D) -> :class:`_Kept`."""


_local = threading.local()  # a thread's _Held goes with the thread
_every = weakref.WeakValueDictionary()  # id -> every live thread's, for release_grad_buffers
_every_lock = threading.Lock()


def grad_buffers(gather_index: torch.Tensor, pieces, k: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduce-scatter inputs of dK and dV, float32 (float64 for float64 ``k``)
    ``[chunks, T, Hkv / chunks, D]`` each
    (``T`` from ``gather_index``, ``Hkv, D`` from the local ``k``), 0 at every key row the
    pieces ``(cu_q, k_start, k_len)`` do not read.

    Kept from call to call, one pair per thread, device and head shape, grown to the
    largest ``T`` yet (memory: ``2 x T x Hkv x D`` floats, as one layer's dK/dV sums take
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
    t, (hkv, d) = gather_index.shape[0], k.shape[1:]
    n = t * hkv * d
    mine = getattr(_local, "held", None)
    if mine is None:
        mine = _local.held = _Held()
        with _every_lock:
            _every[id(mine)] = mine
    current = torch.cuda.current_stream(k.device) if k.is_cuda else None
    acc = torch.promote_types(k.dtype, torch.float32)
    kept = mine.get((k.device, acc, hkv, d))
    if kept is None or kept.storage.shape[1] < n:
        kept = mine[k.device, acc, hkv, d] = _Kept(torch.empty(2, n, dtype=acc, device=k.device), current)
    if kept.last is not None and kept.last != current:
        current.wait_stream(kept.last)
    if current is not None and current != kept.allocated:
        kept.storage.record_stream(current)
    plan = (gather_index, *pieces)
    if kept.pieces is None or kept.chunks != chunks or not all(map(same_plan, kept.pieces, plan)):
        kept.storage[:, :n].zero_()  # the previous pieces' sums
        kept.pieces, kept.chunks = [token(x) for x in plan], chunks
    kept.last = current
    pair = kept.storage[:, :n].view(2, chunks, t, hkv // chunks, d)
    return pair[0], pair[1]


def release_grad_buffers() -> None:
    """Free the dK/dV buffers that ``cp_attention``'s backward keeps (every thread's), e.g.
    before evaluation; the next backward makes them again."""
    with _every_lock:
        for held in list(_every.values()):
            held.clear()


def _physical(pending, gather_index):
    """Wait for one group's gathers and put them in physical order: k, v ``[T, Hkv / chunks, D]``."""
    out = []
    for buffer, work in pending:
        work.wait()
        out.append(buffer.index_select(0, gather_index))
    return out


def forward(kernel, q, k, v, gather_index, pieces, group, **kw):
    """q ``[T_local, Hq, D]``, local k, v ``[T_local, Hkv, D]`` -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``."""
    chunks = kv_chunks(k.shape[1])
    pending = _issue_gathers(k, v, group, chunks)
    qh = q.shape[1] // chunks
    outs, lses = [], []
    for i in range(chunks):
        k_all, v_all = _physical(pending[i], gather_index)
        out, lse = kernel.forward(q[:, i * qh : (i + 1) * qh], k_all, v_all, *pieces, **kw)
        outs.append(out)
        lses.append(lse)
    if chunks == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=0)


def backward(kernel, dout, q, k, v, out, lse, gather_index, pieces, group, **kw):
    """Gradients of :func:`forward`: dq in the input dtype; dk, dv ``[T_local, Hkv, D]`` reduce-scattered."""
    chunks = kv_chunks(k.shape[1])
    pending = _issue_gathers(k, v, group, chunks)  # re-gathered, not saved by the forward
    key_order = gathered_order(gather_index)
    dk_sums, dv_sums = grad_buffers(gather_index, pieces, k, chunks)
    qh = q.shape[1] // chunks
    dqs, scatters = [], []
    for i in range(chunks):
        heads = slice(i * qh, (i + 1) * qh)
        k_all, v_all = _physical(pending[i], gather_index)
        dq, dk_all, dv_all = kernel.backward(
            *(dout[:, heads], q[:, heads], k_all, v_all, out[:, heads], lse[heads], *pieces),
            key_order=key_order,
            dkv_out=(dk_sums[i], dv_sums[i]),
            **kw,
        )
        dqs.append(dq)
        # this group's float32 partial dK/dV of every key, already in gather order, summed
        # over ranks while the next group computes: K's and V's in separate collectives,
        # so that nothing reorders or concatenates them first. The next writer of these
        # buffers (the next layer) is queued after the wait for these collectives below.
        scatters.append([cpdist.reduce_scatter_rows(t, group, async_op=True) for t in (dk_all, dv_all)])
    grads = [[], []]  # dK's and dV's head groups
    for pair in scatters:
        for parts, (buffer, work) in zip(grads, pair):
            work.wait()
            parts.append(buffer.to(k.dtype))
    dq, dk, dv = (parts[0] if chunks == 1 else torch.cat(parts, dim=1) for parts in (dqs, *grads))
    return dq, dk, dv

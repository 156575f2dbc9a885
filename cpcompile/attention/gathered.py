"""All-gather CP attention: the kernel over K/V that ``comm.kv_gather`` brings.

K/V heads may be split into ``chunks`` groups (``StrategySpec.kv_chunks``): attention for group
i, whose query heads are exactly those that read its K/V heads (GQA keeps them
contiguous), runs while group i+1 is still in flight; the backward does the same with
the re-gather, and starts each group's dK/dV reduce-scatter as soon as that group's
gradients exist. ``chunks = 1`` is the plain path: K and V gathered as they are, one
kernel call each way.

The kernel writes dK/dV sums straight in the gathered order (``key_order``: it only
reorders the index of its add-back, once per plan), and only at the rows of keys the
rank's pieces read, into buffers that are kept and zeroed when the pieces change
(``comm.kv_gather.grad_buffers``); K's and V's go to their reduce-scatters as they are.
Why (and why head-group pipelining and attending first over local keys did not pay):
docs/communication.md.

:func:`forward_on_gathered` and :func:`backward_on_gathered` are the kernel's part alone, for
compiled graphs whose all-gathers and reduce-scatters are nodes of their own
(``attention.split``): the gathered K/V come in, the dK/dV sums go out.
"""

from __future__ import annotations

import torch

from cpcompile.cache import per_plan
from cpcompile.comm.kv_gather import grad_buffers, kv_chunks, start_gathers, start_reduce_scatters, wait_physical
from cpcompile.kernels import KeyGrads, Pieces


@per_plan
def gathered_order(gather_index: torch.Tensor) -> torch.Tensor:
    """``[T]`` the physical row of each all-gathered row (``gather_index`` inverted), once per plan:
    the ``key_order`` in which the backward's kernel hands dK/dV to the reduce-scatter."""
    rows = torch.arange(gather_index.shape[0], device=gather_index.device)
    return torch.empty_like(gather_index).scatter_(0, gather_index, rows)


def forward(kernel, q, k, v, gather_index, pieces: Pieces, group, chunks: int = 1, sinks=None, **kw):
    """q ``[T_local, Hq, D]``, local k, v ``[T_local, Hkv, D]`` -> out ``[T_local, Hq, D]``, lse ``[Hq, T_local]``;
    ``pieces`` over the gathered keys, ``kw`` the kernel's keywords (``causal``, ``scale``); ``sinks`` ``[Hq]``
    to each head group's call (a chunk holds whole heads: every row of a head is in one call)."""
    chunks = kv_chunks(chunks, k.shape[1])
    pending = start_gathers(k, v, group, chunks)
    qh = q.shape[1] // chunks
    outs, lses = [], []
    for i in range(chunks):
        k_all, v_all = wait_physical(pending[i], gather_index)
        heads = slice(i * qh, (i + 1) * qh)
        group_sinks = None if sinks is None else sinks[heads]
        out, lse = kernel.forward(q[:, heads], k_all, v_all, pieces, sinks=group_sinks, **kw)
        outs.append(out)
        lses.append(lse)
    if chunks == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=0)


def backward(
    kernel, dout, q, k, v, out, lse, gather_index, pieces: Pieces, group, chunks: int = 1, layers=None, **kw
):  # fmt: skip
    """Gradients of :func:`forward`: dq in the input dtype; dk, dv ``[T_local, Hkv, D]`` reduce-scattered.

    ``layers``: the call is captured in a CUDA graph (``ops.captured``), with this bound on its
    pieces' layers (``BackwardOptions.layers``): the kernel then writes every dK/dV row into new
    buffers of the capture, rather than the read rows into the kept ones, which would be zeroed
    only when the host sees the plan change (it sees nothing at a replay)."""
    chunks = kv_chunks(chunks, k.shape[1])
    pending = start_gathers(k, v, group, chunks)  # re-gathered, not saved by the forward
    key_order = gathered_order(gather_index)
    if layers is None:
        dk_sums, dv_sums = grad_buffers(gather_index, pieces.tensors, k, v, chunks)
    else:
        kw["layers"] = layers
    qh = q.shape[1] // chunks
    dqs, scatters = [], []
    for i in range(chunks):
        heads = slice(i * qh, (i + 1) * qh)
        k_all, v_all = wait_physical(pending[i], gather_index)
        # in gather order, into the kept buffers (a captured call's: new ones, every row)
        sums = KeyGrads(key_order) if layers is not None else KeyGrads(key_order, dk_sums[i], dv_sums[i])
        dq, dk_all, dv_all = kernel.backward(
            dout[:, heads], q[:, heads], k_all, v_all, out[:, heads], lse[heads], pieces, grads=sums, **kw
        )
        dqs.append(dq)
        # this group's float32 partial dK/dV of every key, already in gather order, summed
        # over ranks while the next group computes: K's and V's in separate collectives,
        # so that nothing reorders or concatenates them first. The next writer of these
        # buffers (the next layer) is queued after the wait for these collectives below.
        scatters.append(start_reduce_scatters(dk_all, dv_all, group))
    grads = [[], []]  # dK's and dV's head groups
    for pair in scatters:
        for parts, (buffer, work) in zip(grads, pair):
            work.wait()
            parts.append(buffer.to(k.dtype))
    dq, dk, dv = (parts[0] if chunks == 1 else torch.cat(parts, dim=1) for parts in (dqs, *grads))
    return dq, dk, dv


def forward_on_gathered(kernel, q, k_all, v_all, gather_index, pieces: Pieces, **kw):
    """q ``[T_local, Hq, D]``, all-gathered (rank-major) k, v ``[T, Hkv, D]`` -> out ``[T_local, Hq, D]``,
    lse ``[Hq, T_local]``: :func:`forward` once its gathers have arrived."""
    k_all, v_all = (x.index_select(0, gather_index) for x in (k_all, v_all))
    return kernel.forward(q, k_all, v_all, pieces, **kw)


def backward_on_gathered(kernel, dout, q, k_all, v_all, out, lse, gather_index, pieces: Pieces, **kw):
    """Gradients of :func:`forward_on_gathered`: dq in the input dtype; the dK/dV sums of every key
    ``[T, Hkv, D]``, float32 (float64 for float64 inputs), in the all-gather's order, for the caller's
    reduce-scatter.

    They go into new zeroed buffers, not the kept ones (:func:`grad_buffers`): the reduce-scatter
    that reads them is a node of the graph, which may run after the next layer's backward (and
    inductor may reuse the memory of an op's dead output), so nothing may write them again."""
    k_all, v_all = (x.index_select(0, gather_index) for x in (k_all, v_all))
    acc = torch.promote_types(k_all.dtype, torch.float32)
    dk_sums, dv_sums = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k_all, v_all))
    sums = KeyGrads(gathered_order(gather_index), dk_sums, dv_sums)
    return kernel.backward(dout, q, k_all, v_all, out, lse, pieces, grads=sums, **kw)

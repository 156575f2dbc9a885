"""Row collectives across torch versions: all-gather, reduce-scatter, all-to-all of ``[rows, ...]``.

``torch.distributed`` renamed ``all_gather_into_tensor``/``reduce_scatter_tensor``
to ``*_single`` in 2.13; both spellings are supported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    """``[n, ...]`` on each rank -> ``[size * n, ...]``, rank-major; with ``async_op``,
    ``(output, work)`` where the output is valid after ``work.wait()``."""
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    work = _all_gather(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(
    x: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False, out: torch.Tensor | None = None
):
    """``[size * n, ...]`` summed over ranks, rank r keeps rows ``[r * n, (r + 1) * n)`` (into ``out``,
    contiguous, if given); with ``async_op``, ``(output, work)``."""
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:])) if out is None else out
    work = _reduce_scatter(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_to_all_rows(
    x: torch.Tensor,
    out_counts: list[int],
    in_counts: list[int],
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    out: torch.Tensor | None = None,
):
    """Rows ``x [sum(in_counts), ...]``, ``in_counts[s]`` of them to rank s in rank order ->
    ``[sum(out_counts), ...]`` (into ``out``, contiguous, if given), ``out_counts[s]`` from
    rank s in rank order; with ``async_op``, ``(output, work)``."""
    out = x.new_empty((sum(out_counts), *x.shape[1:])) if out is None else out
    work = dist.all_to_all_single(out, x.contiguous(), out_counts, in_counts, group=group, async_op=async_op)
    return (out, work) if async_op else out


# --- functional collectives: graph nodes ------------------------------------------------
#
# ``torch.ops._c10d_functional`` (the same op names in torch 2.11 through 2.13; only the Python
# wrappers in ``torch.distributed._functional_collectives`` were renamed, ``all_gather_tensor`` ->
# ``all_gather_single``): each op starts its collective and returns a tensor that is valid once
# ``wait_tensor`` has returned it. In a compiled graph the start and the wait are nodes of their own,
# which AOT autograd keeps and inductor lowers to an asynchronous collective and its wait, so that
# the graph may run independent work between them (``cpcompile.compiler.overlap``).


def start_all_gather(x: torch.Tensor, cp: int, group_name: str) -> torch.Tensor:
    """Start gathering ``[n, ...]`` of the ``cp`` ranks: ``[cp * n, ...]`` rank-major, valid after :func:`wait`."""
    return torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), cp, group_name)


def start_reduce_scatter(x: torch.Tensor, cp: int, group_name: str) -> torch.Tensor:
    """Start summing ``[cp * n, ...]`` over the ``cp`` ranks, each keeping its ``n`` rows; valid after :func:`wait`."""
    return torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", cp, group_name)


def registered(x: torch.Tensor, work) -> torch.Tensor:
    """``x``, the output of ``work`` (an asynchronous collective a custom op started), registered as the
    functional collectives register theirs: :func:`wait` (``wait_tensor``) waits for ``work`` before it
    returns ``x``, so that a graph node of its own waits for a transfer that the op started."""
    torch._C._distributed_c10d._register_work(x, work)
    return x


def wait(x: torch.Tensor) -> torch.Tensor:
    """The result of a started functional collective, once it has arrived."""
    return torch.ops._c10d_functional.wait_tensor(x)

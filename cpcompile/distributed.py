"""Process-group plumbing: groups by name, row collectives across torch versions.

Ops receive groups by name (a ``str`` in their schema) and resolve them here.
``torch.distributed`` renamed ``all_gather_into_tensor``/``reduce_scatter_tensor``
to ``*_single`` in 2.13; both spellings are supported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group: dist.ProcessGroup | str | None) -> dist.ProcessGroup:
    """A process group from a group, its name, or ``None`` (the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first (group=None needs it)")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        return _resolve_process_group(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be a ProcessGroup, its name or None, got {type(group).__name__}")


def group_name(group: dist.ProcessGroup | str | None) -> str:
    return group if isinstance(group, str) else resolve_group(group).group_name


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    """``[n, ...]`` on each rank -> ``[size * n, ...]``, rank-major; with ``async_op``,
    ``(output, work)`` where the output is valid after ``work.wait()``."""
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    work = _all_gather(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    """``[size * n, ...]`` summed over ranks, rank r keeps rows ``[r * n, (r + 1) * n)``;
    with ``async_op``, ``(output, work)``."""
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
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


def agree_before_collectives(group: dist.ProcessGroup, error: Exception | None, **values: int) -> None:
    """Raise the same way on every rank unless all ranks passed their checks and agree.

    A rank that rejects its arguments while the others enter a collective would leave
    them hanging; so each rank reports whether its checks passed and the sizes its
    collectives will use, in one small all-reduce, and every rank raises if any
    rank failed or any value differs.
    """
    names = ["failed", *values]
    local = [int(error is not None), *values.values()]
    t = torch.tensor(local + [-x for x in local], dtype=torch.int64)  # max(-x) = -min(x)
    t = t.to("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    n = len(names)
    hi, lo = t[:n].tolist(), (-t[n:]).tolist()
    if error is not None:
        raise error
    if hi[0]:
        raise ValueError(f"another rank of group {group.group_name!r} rejected its arguments (see its error)")
    bad = [f"{name} (min {a}, max {b})" for name, a, b in zip(names[1:], lo[1:], hi[1:]) if a != b]
    if bad:
        raise ValueError(f"ranks of group {group.group_name!r} disagree on " + ", ".join(bad))

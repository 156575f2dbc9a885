"""Process groups by name, and the agreement every CP op runs before its collectives.

Ops receive groups by name (a ``str`` in their schema) and resolve them here. Before an
op's first collective, ranks compare their arguments (:func:`agree`), so that a
mistake on one rank is an error on every rank rather than a hang or a wrong result.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

# Imported with cpcompile, before the user's init_process_group: the functions of
# torch.distributed.nn.functional take ``group=group.WORLD`` as a default, evaluated when
# it is imported. Imported after init (torch._dynamo imports it, at the first compile or
# custom-op call), those defaults keep the default group alive past destroy_process_group(),
# and gloo's worker threads then abort the process at interpreter exit.
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed.distributed_c10d import _resolve_process_group

T = TypeVar("T")


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
    raise _not_a_group(group)


def group_name(group: dist.ProcessGroup | str | None) -> str:
    return group if isinstance(group, str) else resolve_group(group).group_name


def held_group(group: dist.ProcessGroup | str | None) -> str | None:
    """What an object that outlives a call keeps of ``group``: its name (``None`` stays the default
    group, resolved at use). Torch keeps compiled backends (``torch._dynamo``'s cache, until
    ``torch._dynamo.reset()``), so one holding the ``ProcessGroup`` kept it past
    ``destroy_process_group()`` to interpreter exit, where gloo's threads abort the process."""
    if group is None or isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    raise _not_a_group(group)


def _not_a_group(group: object) -> Exception:
    # dist.new_group gives the ranks outside the group a sentinel in its place
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        who = f"global rank {dist.get_rank()}" if dist.is_initialized() else "this process"
        return ValueError(
            f"group is torch.distributed's NON_GROUP_MEMBER: {who} is not in the group "
            "passed (dist.new_group returns it on the ranks outside); pass the CP group that holds this rank "
            "(with a DeviceMesh: mesh['cp'].get_group())"
        )
    return TypeError(f"group must be a ProcessGroup, its name or None, got {type(group).__name__}")


def digest(t: torch.Tensor) -> str:
    """A collision-resistant fingerprint of ``t``'s values (reads them: a host sync on CUDA)."""
    data = t.detach().to("cpu", torch.int64).contiguous()
    h = hashlib.blake2b(str(tuple(data.shape)).encode(), digest_size=12)
    h.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))  # no numpy, no per-item copy
    return h.hexdigest()


def agree(group: dist.ProcessGroup, error: Exception | None, record: dict[str, object]) -> None:
    """Raise on every rank unless all ranks passed their checks and their ``record``s are equal.

    Called before an op's first collective. A rank that rejected its arguments while the
    others enter a collective would leave them waiting until the group's timeout, and
    ranks that disagree on what to compute (strategy, documents, causal mask, K/V path)
    would run mismatched collectives or return wrong values. So each rank shares its
    error, if any, and a record of everything that must be equal (plain values, tensors
    by :func:`digest`) in one ``all_gather_object``; every rank then raises the same way,
    naming the rank and the argument. The failing rank raises its own error.

    One gather of a few hundred bytes, but a host sync: callers run it where
    ``checks.agreement_enabled`` says so, alike on every rank.
    """
    mine = {"error": None if error is None else f"{type(error).__name__}: {error}", **record}
    entries: list[dict] = [{} for _ in range(group.size())]
    dist.all_gather_object(entries, mine, group=group)
    if error is not None:
        try:
            raise error
        finally:
            # The error's traceback holds this frame (and the caller's): holding the error in
            # them too would make a reference cycle, which keeps the process group alive past
            # destroy_process_group() until a gc pass, or until exit, where gloo then aborts.
            error = None
    name = _named(group)
    failed = [f"rank {r} rejected its arguments ({e['error']})" for r, e in enumerate(entries) if e["error"]]
    if failed:
        raise ValueError(f"cpcompile: in process group {name}, " + "; ".join(failed))
    keys = list(dict.fromkeys(k for e in entries for k in e if k != "error"))
    disagree = []
    for key in keys:
        ranks_by_value: dict[str, list[int]] = {}
        for r, e in enumerate(entries):
            ranks_by_value.setdefault(repr(e.get(key, "(not given)")), []).append(r)
        if len(ranks_by_value) > 1:
            held = "; ".join(f"{_ranks(rs)}: {value}" for value, rs in ranks_by_value.items())
            disagree.append(f"{key} ({held})")
    if disagree:
        raise ValueError(
            f"cpcompile: ranks of process group {name} disagree on " + ", ".join(disagree) + "; this is rank "
            f"{group.rank()}. Every rank must pass the same arguments and the same global cu_seqlens."
        )


def agree_on(group: dist.ProcessGroup, enabled: bool, check: Callable[[], T], record: Callable[[T], dict]) -> T:
    """``check()``'s result; where ``enabled`` (``checks.agreement_enabled``, alike on every rank), the
    ranks first :func:`agree` on its failure, if any, or else on ``record(result)``: any exception,
    not just a check's own, raises on every rank."""
    if not enabled:
        return check()
    result, error = None, None
    try:
        result = check()
    except Exception as e:  # any failure on one rank alone: the others must learn of it
        error = e
    try:
        agree(group, error, {} if error else record(result))
    finally:
        error = None  # see agree: a raised error must not hold the frame that holds it
    return result


_skip = threading.local()


@contextlib.contextmanager
def agreed() -> Iterator[None]:
    """Inside: ops skip their own :func:`agree` (the caller's covered this very call)."""
    before = getattr(_skip, "on", False)
    _skip.on = True
    try:
        yield
    finally:
        _skip.on = before


def already_agreed() -> bool:
    return getattr(_skip, "on", False)


def _named(group: dist.ProcessGroup) -> str:
    """``group``'s name, and for a group of fewer ranks than the world its global ranks in group rank order
    (messages name group ranks; on a mesh the name alone does not say which processes are meant)."""
    name = repr(group.group_name)
    if group.size() == dist.get_world_size():
        return name
    return f"{name} (global ranks {dist.get_process_group_ranks(group)})"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))

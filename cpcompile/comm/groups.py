"""Process groups by name, and the agreement every CP op runs before its collectives.

Ops receive groups by name (a ``str`` in their schema) and resolve them here. Before an
op's first collective, forward and backward, ranks compare their arguments and where they are
(:func:`agree`), so that a mistake on one rank is an error on every rank rather than a hang or a
wrong result. What no agreement can see (a rank that fails inside an op once its collectives
began) is bounded by the process group's timeout, and :func:`collective_failure` names the op
and the step in the error it ends in (docs/failures.md).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable
from datetime import timedelta
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


#: ``where`` of an agreement before a forward's collectives (the ops' say which op)
FORWARD = "forward"


def agree(
    group: dist.ProcessGroup, error: Exception | None, record: dict[str, object], *, where: str = FORWARD
) -> None:
    """Raise on every rank unless all ranks passed their checks and their ``record``s are equal.

    Called before an op's first collective. A rank that rejected its arguments while the
    others enter a collective would leave them waiting until the group's timeout, and
    ranks that disagree on what to compute (strategy, documents, causal mask, K/V path)
    would run mismatched collectives or return wrong values. So each rank shares its
    error, if any, and a record of everything that must be equal (plain values, tensors
    by :func:`digest`) in one ``all_gather_object``; every rank then raises the same way,
    naming the rank and the argument. The failing rank raises its own error.

    ``where``: the step the ranks are at, ``"forward"`` or ``"forward of <op>"`` before a
    forward's collectives, ``"backward of <op>"`` before a backward's. Ranks at different steps
    pair their agreements (a rank that failed after the forward and started the next step while
    the others run the backward meets them here, not in mismatched collectives): every rank
    raises, naming where each one is. A rank that failed inside an op once its collectives began
    (:func:`collective_failure`) says so at its next agreement on the group.

    One gather of a few hundred bytes, but a host sync: callers run it where
    ``checks.agreement_enabled`` says so, alike on every rank.
    """
    mine = {
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "where": where,
        "failed inside": _failed.pop(group.group_name, None),
        **record,
    }
    entries: list[dict] = [{} for _ in range(group.size())]
    try:
        dist.all_gather_object(entries, mine, group=group)
    except Exception as e:
        error = None  # see below: a raised error must not hold the frame that holds it
        raise collective_failure(e, group, f"agreement before the {where}") from e
    try:
        _check_steps(group, entries)
    except Exception:
        error = None
        raise
    if error is not None:
        try:
            raise _every_rank(error)  # the others raise too, naming this rank
        finally:
            # The error's traceback holds this frame (and the caller's): holding the error in
            # them too would make a reference cycle, which keeps the process group alive past
            # destroy_process_group() until a gc pass, or until exit, where gloo then aborts.
            error = None
    name = _named(group)
    failed = [f"rank {r} rejected its arguments ({e['error']})" for r, e in enumerate(entries) if e["error"]]
    if failed:
        raise _every_rank(ValueError(f"cpcompile: in process group {name}, " + "; ".join(failed)))
    keys = list(dict.fromkeys(k for e in entries for k in e if k not in ("error", "where", "failed inside")))
    disagree = []
    for key in keys:
        ranks_by_value: dict[str, list[int]] = {}
        for r, e in enumerate(entries):
            ranks_by_value.setdefault(repr(e.get(key, "(not given)")), []).append(r)
        if len(ranks_by_value) > 1:
            held = "; ".join(f"{_ranks(rs)}: {value}" for value, rs in ranks_by_value.items())
            disagree.append(f"{key} ({held})")
    if disagree:
        raise _every_rank(
            ValueError(
                f"cpcompile: ranks of process group {name} disagree on " + ", ".join(disagree) + "; this is rank "
                f"{group.rank()}. Every rank must pass the same arguments and the same global cu_seqlens."
            )
        )


def agree_on(
    group: dist.ProcessGroup,
    enabled: bool,
    check: Callable[[], T],
    record: Callable[[T], dict],
    *,
    where: str = FORWARD,
) -> T:
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
        agree(group, error, {} if error else record(result), where=where)
    finally:
        error = None  # see agree: a raised error must not hold the frame that holds it
    return result


def _check_steps(group: dist.ProcessGroup, entries: list[dict]) -> None:
    """Raise on every rank where the ranks' agreements pair calls at different steps, or where a rank
    failed inside an op (after its collectives began) that the others went on from: from there on
    their collectives pair wrongly (mismatched sizes, or none that completes)."""
    name, this = _named(group), group.rank()
    failed = _by_value(entries, "failed inside")
    went_on = failed.pop(None, None)
    told = "; ".join(f"{_ranks(rs)} failed inside the {what}" for what, rs in failed.items())
    told = f"{told}, once its collectives had begun" if failed and (went_on or len(failed) > 1) else ""
    phases = {e["where"].split(" ", 1)[0] for e in entries}
    if len(phases) > 1 or ("backward" in phases and len({e["where"] for e in entries}) > 1):
        at = "; ".join(f"{_ranks(rs)} at the {where}" for where, rs in _by_value(entries, "where").items())
        raise _every_rank(
            RuntimeError(
                f"cpcompile: the ranks of process group {name} are at different steps: {at} (this is rank "
                f"{this}){'; before, ' + told if told else ''}. A rank that failed after the forward and started the "
                "next step while the others ran the backward, or that skipped a backward the others ran, leaves the "
                "group's collectives mismatched: every rank must run the backward, or none (let an error on one rank "
                "end the step on every rank; docs/failures.md)"
            )
        )
    if told:  # not every rank failed alike: the others went on to collectives this rank skipped
        raise _every_rank(
            RuntimeError(
                f"cpcompile: in process group {name}, {told}, and the other ranks went on to this agreement (this is "
                f"rank {this}): the group's collectives no longer pair. Let such an error end the step on every rank "
                "(docs/failures.md)"
            )
        )


def _by_value(entries: list[dict], key: str) -> dict:
    ranks: dict = {}
    for r, e in enumerate(entries):
        ranks.setdefault(e.get(key), []).append(r)
    return ranks


#: per group name, where this rank failed inside an op after its collectives began (see
#: :func:`failed_inside`): told to the others at the next agreement, then forgotten
_failed: dict[str, str] = {}


def failed_inside(group: dist.ProcessGroup, where: str) -> None:
    """Record that this rank raised inside ``where`` (``"forward of <op>"``) once the op's collectives
    may have begun: the ranks that went on have collectives this rank skipped."""
    _failed[group.group_name] = where


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout of ``group``'s collectives (``init_process_group(timeout=...)``, ``new_group(timeout=...)``),
    where the backend says (gloo and NCCL do); ``None`` where it does not."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for this device, or one without options
            continue
    return None


def collective_failure(error: Exception, group: dist.ProcessGroup, step: str) -> Exception:
    """The error to raise where a collective of ``group`` failed during ``step`` (``"forward of
    cp_attention (all_gather)"``): a timeout (no other rank came), a closed connection (another rank's
    process ended) or the backend's error, with the op, the step, the rank and the bound."""
    timeout = group_timeout(group)
    bound = "" if timeout is None else f" ({timeout.total_seconds():g} s)"
    message = (
        f"cpcompile: a collective of process group {_named(group)} failed on rank {group.rank()} in the {step}: "
        f"{type(error).__name__}: {error}. Another rank failed inside this op or before it, skipped it, or is "
        f"in another collective (see its error); a collective no other rank joins fails after the group's "
        f"timeout{bound}, set by init_process_group(timeout=...) (docs/failures.md)"
    )
    try:
        wrapped = type(error)(message)  # DistError and its kinds stay what they are
    except Exception:
        wrapped = RuntimeError(message)
    return _every_rank(wrapped)


def _every_rank(error: Exception) -> Exception:
    error._cpcompile_every_rank = True  # raised by every rank, or told to them: in step
    return error


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether ``error`` comes from an agreement or a failed collective (not one rank's failure alone)."""
    return getattr(error, "_cpcompile_every_rank", False)


def _named(group: dist.ProcessGroup) -> str:
    """``group``'s name, and for a group of fewer ranks than the world its global ranks in group rank order
    (messages name group ranks; on a mesh the name alone does not say which processes are meant)."""
    name = repr(group.group_name)
    if group.size() == dist.get_world_size():
        return name
    return f"{name} (global ranks {dist.get_process_group_ranks(group)})"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))

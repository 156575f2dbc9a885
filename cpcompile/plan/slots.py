"""Plan slots: the plans a captured step (:class:`cpcompile.CapturedStep`) reads from device buffers.

The plan op makes a pack's plan on the host, which a CUDA graph would record once and replay for
every pack. While a :class:`~cpcompile.compiler.captured_step.CapturedStep` warms up, the plan op
tells it each plan's shapes (:func:`note_plan`); in its capture the op hands out copies of a slot
(:func:`plan_in_capture`), device buffers that the step fills from the next pack's plan before each
replay (:meth:`PlanSlots.fill`). A capture may also be told how many layers of pieces the captured
attention's backward runs (:func:`layers_in_capture`): the pack's own count rather than the strategy's
bound, so that a step keeps one graph per count it meets instead of running every pack at the bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Active:
    """The plan slots of the step that is warming up or being captured, for every thread: the
    autograd engine runs a CUDA backward, and the plan ops it recomputes (checkpointed layers), on
    a thread of its own."""

    slots: PlanSlots | None = None


#: The plan slots in force, for every thread (one step warms up or is captured at a time).
ACTIVE = _Active()


class PlanSlots:
    """The plans a captured step reads: per plan op call, device buffers in the graph and how to make
    them again for another pack (the op's arguments, with the step's inputs by position).

    A plan op call seen while the step warms up (:meth:`warming`, :func:`note_plan`) tells its plan's
    shapes; the same call in the capture (:meth:`capture`, :func:`plan_in_capture`) gets buffers of
    those shapes; before each replay :meth:`fill` writes the pack's plans into them."""

    def __init__(self):
        self._warmup: dict = {}
        self._capture: dict = {}
        self._seen: dict = {}
        self._slots: list[tuple[Callable, tuple, tuple[torch.Tensor, ...]]] = []
        self.capturing = False
        self.layers: int | None = None  # the captured backward's layers in the capture under way

    def warming(self, inputs: list) -> None:
        """A warm-up call of the step on ``inputs`` (its flattened inputs) follows."""
        self._warmup = _memory(inputs)

    def capture(self, static: list, layers: int | None = None) -> None:
        """The capture of the step on ``static`` (the graph's input buffers) follows; ``layers``: the layers of
        pieces its captured attention runs in its backward (``None``: the strategy's bound)."""
        self._capture, self.capturing, self.layers = _memory(static), True, layers
        self._slots = []

    def captured(self) -> list:
        """The slots of the capture just made (:meth:`fill` writes them), ending it."""
        slots, self._slots = self._slots, []
        self.capturing, self.layers = False, None
        return slots

    def calls(self, originals: list) -> dict:
        """Each plan op call seen in the warm-up, with its arguments for the pack of ``originals`` (the step's
        inputs as the caller gives them): ``(make, where) -> args``."""
        return {
            (make, where): tuple(originals[a[1]] if isinstance(a, tuple) and a[:1] == ("input",) else a for a in where)
            for make, where in self._seen
        }

    @staticmethod
    def plans(calls: dict) -> dict:
        """The plans of ``calls`` (:meth:`calls`): ``(make, where) -> plan``."""
        return {(make, where): make(*args) for (make, where), args in calls.items()}

    @staticmethod
    def _where(args: tuple, positions: dict) -> tuple | None:
        """``args`` with each tensor as ``("input", i)``, the step's input ``i`` (the same memory: the
        compiled code may hand the op an alias of it); ``None`` where a tensor is none of them."""
        where = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if location(a) not in positions:
                    return None
                a = ("input", positions[location(a)])
            where.append(a)
        return tuple(where)

    def seen(self, make: Callable, args: tuple, plan: tuple) -> None:
        where = self._where(args, self._warmup)
        if where is not None:
            self._seen[make, where] = [(t.shape, t.dtype, t.device) for t in plan]

    def add(self, make: Callable, args: tuple) -> tuple[torch.Tensor, ...]:
        """Buffers for plan ``make(*args)`` in the capture, as the warm-up's same call made it."""
        where = self._where(args, self._capture)
        if where is None or (make, where) not in self._seen:
            raise ValueError(
                "a plan inside a CapturedStep must be made from the step's own inputs (cu_seqlens as the data loader "
                "gives it), not from a tensor computed in the step: its values would be the captured pack's at every "
                "replay"
            )
        buffers = tuple(torch.empty(shape, dtype=dt, device=device) for shape, dt, device in self._seen[make, where])
        self._slots.append((make, where, buffers))
        return buffers

    def fill(self, plans: dict, slots: list) -> None:
        """Write ``plans`` (:meth:`plans`) into the buffers of ``slots`` (:meth:`captured`)."""
        for make, where, buffers in slots:
            for buffer, t in zip(buffers, plans[make, where], strict=True):
                if buffer.shape != t.shape:
                    raise ValueError(
                        f"a pack's plan has shape {tuple(t.shape)}, the captured step's {tuple(buffer.shape)}: "
                        "pad every pack of a bucket to its capacity (StrategySpec(..., capacity=...))"
                    )
                buffer.copy_(t, non_blocking=True)


def location(t: torch.Tensor) -> tuple:
    return t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _memory(inputs: list) -> dict:
    """Where each tensor of ``inputs`` lies (:func:`location`) -> its first position."""
    where: dict = {}
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            where.setdefault(location(t), i)
    return where


def note_plan(make: Callable, args: tuple, plan: tuple) -> None:
    """A plan op's call outside a capture: a :class:`CapturedStep` warming up keeps its shapes."""
    slots = ACTIVE.slots
    if slots is not None and not slots.capturing:
        slots.seen(make, args, plan)


def plan_in_capture(make: Callable, args: tuple) -> tuple[torch.Tensor, ...]:
    """What a plan op returns while a CUDA graph is captured: copies of the active
    :class:`CapturedStep`'s plan slot for this call; ``RuntimeError`` in a capture that is no
    :class:`CapturedStep`'s."""
    slots = ACTIVE.slots
    if slots is None or not slots.capturing:
        raise RuntimeError(
            "cpcompile's plan ops make a pack's plan on the host, which a CUDA graph captured by hand would replay "
            "for every pack: capture the step with cpcompile.CapturedStep, or compile with "
            "torch.compile(..., mode='reduce-overhead') (docs/cuda-graphs.md)"
        )
    return tuple(b.clone() for b in slots.add(make, args))


def layers_in_capture(bound: int) -> int:
    """The layers of pieces a captured attention backward runs: ``bound`` (its strategy's), or fewer where the
    :class:`CapturedStep` capturing it was told its pack's count (:meth:`PlanSlots.capture`). A layer without
    pieces still costs a kernel call over every key and query row, so a pack that needs fewer layers than the
    bound gets a graph of its own."""
    slots = ACTIVE.slots
    if slots is not None and slots.capturing and slots.layers is not None:
        return min(bound, max(slots.layers, 1))
    return bound

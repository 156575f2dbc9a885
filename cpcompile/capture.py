"""A whole CP training step as one CUDA graph per bucket of packs: :class:`CapturedStep`.

``torch.compile(..., mode="reduce-overhead")`` records the forward and the backward as two CUDA
graphs (cudagraph trees: one per compiled function) and leaves the rest of the step (the loss where
it is not compiled, the optimizer) outside. :class:`CapturedStep` captures whatever a step function
does, forward, loss, backward and optimizer alike, as one graph with ``torch.cuda.graph``, and
replays it for every pack of the bucket: the model is compiled by cpcompile's backend with
``captured_step=True``, so that its attention is the captured op (``ops.captured``).

What a hand-made capture cannot do by itself is the plan: the plan op (``cp_plan``) makes a pack's
plan on the host, which a capture would record once and replay for every pack. Inside a
:class:`CapturedStep` the plan op instead hands out a copy of a *plan slot*, device buffers that the
step fills before each replay from the new pack's plan (made on the host ahead of the step, from
its host twins: ``shard_batch(..., device=...)``), the same way it copies the pack's tensors into
the graph's input buffers. cpcompile's ops that size their work on the host raise inside a capture
rather than replay one pack's sizes for every other (``per_plan.refuse_capture``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from .strategy import current_spec


class _Active:
    """The plan slots of the step that is warming up or being captured, for every thread: the
    autograd engine runs a CUDA backward, and the plan ops it recomputes (checkpointed layers), on
    a thread of its own."""

    slots: PlanSlots | None = None


_capturing = _Active()


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

    def warming(self, inputs: list) -> None:
        """A warm-up call of the step on ``inputs`` (its flattened inputs) follows."""
        self._warmup = _memory(inputs)

    def capture(self, static: list) -> None:
        """The capture of the step on ``static`` (the graph's input buffers) follows."""
        self._capture, self.capturing = _memory(static), True

    @staticmethod
    def _where(args: tuple, positions: dict) -> tuple | None:
        """``args`` with each tensor as ``("input", i)``, the step's input ``i`` (the same memory: the
        compiled code may hand the op an alias of it); ``None`` where a tensor is none of them."""
        where = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if _at(a) not in positions:
                    return None
                a = ("input", positions[_at(a)])
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

    def fill(self, originals: list) -> None:
        """Write each slot's plan for the pack of ``originals`` (the step's inputs as the caller gives them)."""
        for make, where, buffers in self._slots:
            args = tuple(originals[a[1]] if isinstance(a, tuple) and a[:1] == ("input",) else a for a in where)
            for buffer, t in zip(buffers, make(*args), strict=True):
                if buffer.shape != t.shape:
                    raise ValueError(
                        f"a pack's plan has shape {tuple(t.shape)}, the captured step's {tuple(buffer.shape)}: "
                        "pad every pack of a bucket to its capacity (StrategySpec(..., capacity=...))"
                    )
                buffer.copy_(t, non_blocking=True)


def _at(t: torch.Tensor) -> tuple:
    return t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _memory(inputs: list) -> dict:
    """Where each tensor of ``inputs`` lies (:func:`_at`) -> its first position."""
    where: dict = {}
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            where.setdefault(_at(t), i)
    return where


def _shapes(inputs: list) -> list:
    """What a graph is captured for, per input: a tensor's shape, dtype, device and the first input
    in the same memory (inputs given twice stay one tensor); other values as they are."""
    first: dict[tuple, int] = {}
    return [(tuple(x.shape), x.dtype, x.device, first.setdefault(_at(x), i)) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(inputs)]  # fmt: skip


def note_plan(make: Callable, args: tuple, plan: tuple) -> None:
    """A plan op's call outside a capture: a :class:`CapturedStep` warming up keeps its shapes."""
    slots = _capturing.slots
    if slots is not None and not slots.capturing:
        slots.seen(make, args, plan)


def plan_in_capture(make: Callable, args: tuple) -> tuple[torch.Tensor, ...]:
    """What a plan op returns while a CUDA graph is captured: copies of the active
    :class:`CapturedStep`'s plan slot for this call; ``RuntimeError`` in a capture that is no
    :class:`CapturedStep`'s."""
    slots = _capturing.slots
    if slots is None or not slots.capturing:
        raise RuntimeError(
            "cpcompile's plan ops make a pack's plan on the host, which a CUDA graph captured by hand would replay "
            "for every pack: capture the step with cpcompile.CapturedStep, or compile with "
            "torch.compile(..., mode='reduce-overhead') (docs/cuda-graphs.md)"
        )
    return tuple(b.clone() for b in slots.add(make, args))


class _Bucket:
    """One shape of a :class:`CapturedStep`'s inputs: its warm-up calls so far, then its graph, input
    buffers, plan slots, outputs and the gradients the graph writes."""

    def __init__(self):
        self.warmed = 0
        self.slots = PlanSlots()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list = []
        self.out = None
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []


class CapturedStep:
    """``step(*inputs)`` as one CUDA graph per shape of its inputs, replayed for every pack of a bucket.

    ``step``: forward, loss, backward and anything else (an optimizer made with ``capturable=True``);
    it returns what the caller reads (tensors are the graph's, overwritten by the next replay).
    Its model is compiled with ``cpcompile.backend(..., captured_step=True)`` and ``dynamic=False``,
    and its packs padded to a capacity (``StrategySpec.capacity``), so that every pack of a bucket
    has one shape. ``inputs``: tensors on the GPU, as ``shard_batch(..., device=...)`` gives them
    (``cu_seqlens`` with its host twin: the plan of each pack is made on the host from it, before
    the replay, without a sync), and other values that stay the same for a bucket.

    A bucket is a shape of the inputs (which of them are one tensor included) under one active
    ``cpcompile.strategy``. Each call is one step on its own pack, whatever it does for the graph.
    The first ``warmup`` calls of a bucket run ``step`` without a graph (compilation, FA4's kernels;
    on a side stream, as CUDA graphs need); the next one captures it and replays it, and every later
    one copies its inputs and its pack's plans into the graph's buffers and replays. ``captures``
    counts the graphs recorded. What ``step`` does on the host runs only in those first calls: a
    learning rate that changes must be a tensor the step reads, not a Python number. Each bucket
    keeps its graph's memory (activations, gradients) for as long as this object lives.

    ``module``: the model whose gradients ``step`` makes, or ``None`` for a step that makes none
    (required: a replay adds into gradients that exist when it is captured, memory the graph does
    not own). Each call's gradients are its own pack's: they are set to ``None`` before each warm-up
    call and before the capture, so that the backward allocates them in the graph and each replay
    writes them (not adds to them), and after each replay the parameters' ``.grad`` are the graph's
    again, so that an optimizer outside the step sees them even where the loop set them to ``None``
    (``zero_grad()``). Gradients cannot be accumulated over several calls.
    """

    def __init__(self, step: Callable, *, module: torch.nn.Module | None, warmup: int = 1):
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be a positive int (runs before the capture), got {warmup!r}")
        self._step, self._module, self._warmup = step, module, warmup
        self._buckets: dict = {}
        self.captures = 0

    def __call__(self, *inputs):
        leaves, spec = pytree.tree_flatten(inputs)
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and not x.is_cuda:
                raise ValueError(f"CapturedStep takes CUDA tensors, got input {i} on {x.device}")
        key = (spec, repr(current_spec()), *_shapes(leaves))
        bucket = self._buckets.setdefault(key, _Bucket())
        if bucket.graph is None:
            if bucket.warmed < self._warmup:
                bucket.warmed += 1
                return self._warm(bucket, leaves, spec)
            try:
                self._capture(bucket, leaves, spec)
            except BaseException:
                del self._buckets[key]  # the next call of the bucket starts again, with a warm-up
                raise
        for buffer, x in zip(bucket.static, leaves, strict=True):
            if isinstance(x, torch.Tensor):  # a buffer given twice takes the same values twice
                buffer.copy_(x, non_blocking=True)
        bucket.slots.fill(leaves)
        bucket.graph.replay()
        for p, grad in bucket.grads:
            p.grad = grad
        return bucket.out

    def _warm(self, bucket: _Bucket, leaves: list, spec):
        """One step without a graph, on a side stream; its plan calls tell the plan slots' shapes."""
        if self._module is not None:
            self._module.zero_grad(set_to_none=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        bucket.slots.warming(leaves)
        _capturing.slots = bucket.slots
        try:
            with torch.cuda.stream(side):
                out = self._step(*pytree.tree_unflatten(leaves, spec))
        finally:
            _capturing.slots = None
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, bucket: _Bucket, leaves: list, spec) -> None:
        # one buffer per distinct tensor: inputs given twice (Hugging Face's cu_seq_lens_q and _k) stay
        # one tensor, as the compiled code saw them in the warm-up (else it would recompile, in the capture)
        copies: dict[tuple, torch.Tensor] = {}
        bucket.static = [copies.setdefault(_at(x), x.clone()) if isinstance(x, torch.Tensor) else x for x in leaves]
        if self._module is not None:
            self._module.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        bucket.slots.capture(bucket.static)
        _capturing.slots = bucket.slots
        try:
            with torch.cuda.graph(graph):
                bucket.out = self._step(*pytree.tree_unflatten(bucket.static, spec))
        finally:
            _capturing.slots = None
        if self._module is not None:
            bucket.grads = [(p, p.grad) for p in self._module.parameters() if p.grad is not None]
        bucket.graph = graph
        self.captures += 1

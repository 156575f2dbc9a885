"""A whole CP training step as one CUDA graph per bucket of packs: :class:`CapturedStep`.

``torch.compile(..., mode="reduce-overhead")`` records the forward and the backward as two CUDA
graphs (cudagraph trees: one per compiled function) and leaves the rest of the step (the loss where
it is not compiled, the optimizer) outside. :class:`CapturedStep` captures whatever a step function
does, forward, loss, backward and optimizer alike, as one graph with ``torch.cuda.graph``, and
replays it for every pack of the bucket: the model is compiled by cpcompile's backend with
``captured_step=True``, so that its attention is the captured op (``attention.captured``).

What a hand-made capture cannot do by itself is the plan: the plan op (``cp_plan``) makes a pack's
plan on the host, which a capture would record once and replay for every pack. Inside a
:class:`CapturedStep` the plan op instead hands out a copy of a *plan slot*, device buffers that the
step fills before each replay from the new pack's plan (made on the host ahead of the step, from
its host twins: ``shard_batch(..., device=...)``), the same way it copies the pack's tensors into
the graph's input buffers. cpcompile's ops that size their work on the host raise inside a capture
rather than replay one pack's sizes for every other (``cache.refuse_capture``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from cpcompile.attention.plan_op import key_layers, step_plan_in_layers
from cpcompile.cache import within_capture
from cpcompile.plan.pieces import every_rank_key_ranges
from cpcompile.plan.slots import ACTIVE, PlanSlots, location
from cpcompile.spec import current_spec


def _shapes(inputs: list) -> list:
    """What a graph is captured for, per input: a tensor's shape, dtype, device and the first input
    in the same memory (inputs given twice stay one tensor); other values as they are."""
    first: dict[tuple, int] = {}
    return [(tuple(x.shape), x.dtype, x.device, first.setdefault(location(x), i)) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(inputs)]  # fmt: skip


class _Graph:
    """One capture of a bucket: its graph, input buffers, plan slots, outputs and the gradients it writes."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static: list, slots: list, out, grads: list):
        self.graph, self.static, self.slots, self.out, self.grads = graph, static, slots, out, grads


class _Bucket:
    """One shape of a :class:`CapturedStep`'s inputs: its warm-up calls so far, the plan calls they made, and
    a graph per count of layers of pieces its packs' captured attention needs (:func:`pack_layers`), sharing
    one memory pool (they never run at once, and each replay's outputs are read before the next)."""

    def __init__(self):
        self.warmed = 0
        self.slots = PlanSlots()
        self.graphs: dict[int, _Graph] = {}
        self.pool = None


def pack_layers(calls: dict) -> int:
    """The layers of pieces over one key that a pack's plans need on the rank that needs the most, at least 1
    (``calls``: its plan op calls, ``PlanSlots.calls``). A captured attention backward runs one kernel call
    per layer, each over every key and query row however few pieces it has, so a pack needing one runs in a
    graph of one. The count is every rank's: each rank lays the pack out and finds every rank's pieces' key
    ranges on the host (``plan.pieces.every_rank_key_ranges``, no communication), so that all ranks replay
    the graph of one count, captured on the same call (a rank holding the head and the tail of a cut
    document needs two where its peers need one)."""
    need = 1
    for (make, _), args in calls.items():
        if make is not step_plan_in_layers:  # the attention plan (``cp_plan``); other plans are not captured
            continue
        bound = inspect.signature(make).bind(*args)
        bound.apply_defaults()
        given = dict(bound.arguments)
        del given["rank"], given["layers"]
        rank, k_start, *k_lens = every_rank_key_ranges(**given)
        # each rank's keys moved past the others' (the full mask's ranges reach furthest): one count over all
        span = int((k_start + k_lens[-1]).max()) + 1 if rank.numel() else 0
        need = max(need, key_layers(rank * span + k_start, *k_lens)[0])
    return need


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
        if bucket.warmed < self._warmup:
            bucket.warmed += 1
            return self._warm(bucket, leaves, spec)
        calls = bucket.slots.calls(leaves)
        plans = bucket.slots.plans(calls)  # on the host, from the inputs' host twins: no sync
        layers = pack_layers(calls)
        captured = bucket.graphs.get(layers)
        if captured is None:
            try:
                captured = bucket.graphs[layers] = self._capture(bucket, leaves, spec, layers)
            except BaseException:
                del self._buckets[key]  # the next call of the bucket starts again, with a warm-up
                raise
        for buffer, x in zip(captured.static, leaves, strict=True):
            if isinstance(x, torch.Tensor):  # a buffer given twice takes the same values twice
                buffer.copy_(x, non_blocking=True)
        bucket.slots.fill(plans, captured.slots)
        captured.graph.replay()
        for p, grad in captured.grads:
            p.grad = grad
        return captured.out

    def _warm(self, bucket: _Bucket, leaves: list, spec):
        """One step without a graph, on a side stream; its plan calls tell the plan slots' shapes."""
        if self._module is not None:
            self._module.zero_grad(set_to_none=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        bucket.slots.warming(leaves)
        ACTIVE.slots = bucket.slots
        try:
            with torch.cuda.stream(side):
                out = self._step(*pytree.tree_unflatten(leaves, spec))
        finally:
            ACTIVE.slots = None
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, bucket: _Bucket, leaves: list, spec, layers: int) -> _Graph:
        # one buffer per distinct tensor: inputs given twice (Hugging Face's cu_seq_lens_q and _k) stay
        # one tensor, as the compiled code saw them in the warm-up (else it would recompile, in the capture)
        copies: dict[tuple, torch.Tensor] = {}
        static = [copies.setdefault(location(x), x.clone()) if isinstance(x, torch.Tensor) else x for x in leaves]
        if self._module is not None:
            self._module.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        if bucket.pool is None:
            bucket.pool = torch.cuda.graph_pool_handle()
        bucket.slots.capture(static, layers)
        ACTIVE.slots = bucket.slots
        try:
            # each layer's captured attention reads the plan's device derivations the first one made
            with torch.cuda.graph(graph, pool=bucket.pool), within_capture():
                out = self._step(*pytree.tree_unflatten(static, spec))
        finally:
            ACTIVE.slots = None
            slots = bucket.slots.captured()
        grads = [] if self._module is None else [(p, p.grad) for p in self._module.parameters() if p.grad is not None]
        self.captures += 1
        return _Graph(graph, static, slots, out, grads)

"""Metadata derived from a plan, built once per step instead of once per layer.

Every layer of a step calls the kernels with the same plan tensors (``cu_q``,
``k_start``, ``k_len``), so what the kernels derive from them (cuDNN's ragged
offsets; the backward's scratch rows, whose size is a host sync) is the same for
every layer, and so is what the ops derive (the all-gather's key order, the sparse
exchange's plan). Built per call, the backward's sync drained the stream in
every layer, and the GPU then waited for the host's metadata work
(docs/attention-kernels.md, "Launch bounds and metadata once per plan").

A step can use several plans in turn: the ring attends over one key block per
step (``k_start[src]``: a new view of the same plan every call), and ``auto``
sizes cuDNN's backward before it may fall back to flash's. So a tensor is known
by its memory (address, layout, version), not by its Python object, and an entry
lives as long as its argument tensors (or the tensors they are views of) do: a
step's plans stay cached through all its layers, and go, with what was derived
from them, when the step drops them. ``ENTRIES`` only bounds the cache.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref

import torch

#: Most argument sets kept per function and thread: far more plans than one step uses.
ENTRIES = 64


def _key(a):
    if not isinstance(a, torch.Tensor):
        return a
    # Views of one storage share its version counter; an in-place change bumps it.
    return (a.data_ptr(), a.dtype, a.device, tuple(a.shape), a.stride(), a._version)


def token(t: torch.Tensor):
    """What :func:`per_plan` knows ``t`` by: its memory key, and a weak reference to the tensor
    that owns the memory (``t`` or the tensor it is a view of), for :func:`same_plan`."""
    return _key(t), weakref.ref(t if t._base is None else t._base)


def same_plan(known, t: torch.Tensor) -> bool:
    """Whether ``t`` is the plan tensor of ``known`` (a :func:`token`): the same memory, still
    owned by the same live tensor, unchanged since. Views of it count as it."""
    key, owner = known
    return owner() is not None and key == _key(t)


def per_plan(fn=None, *, collective: bool = False):
    """Memoize ``fn`` for its recent argument sets: tensors by memory and version, the rest by value.

    An entry goes when an argument tensor (or the tensor it is a view of) is freed,
    so its memory is not reused while the entry exists. A tensor is assumed to
    change only through itself or its views (which bump its version), not through
    another alias of its memory (``torch.from_numpy``, say). Inference tensors have
    no version counter: calls with them are not cached.

    ``collective``: ``fn`` runs collectives, so every rank must miss where the others
    miss. Then entries go only with their tensors, never to bound the cache: which
    entry a bound evicts depends on how many others are alive, which differs between
    ranks that free tensors at other times (garbage collection), and a rank that hits
    while another misses leaves that one waiting in a collective. Whether a live,
    unchanged plan was seen before is the same on every rank running the same program.
    """
    if fn is None:
        return functools.partial(per_plan, collective=collective)
    local = threading.local()

    @functools.wraps(fn)
    def wrapper(*args):
        if any(isinstance(a, torch.Tensor) and a.is_inference() for a in args):
            return fn(*args)
        cache = local.__dict__.setdefault("cache", collections.OrderedDict())
        key = tuple(_key(a) for a in args)
        if key in cache:
            cache.move_to_end(key)
            return cache[key][1]
        result = fn(*args)

        def forget(_, key=key):
            cache.pop(key, None)

        tensors = (a for a in args if isinstance(a, torch.Tensor))
        owners = {id(t): t for t in (a if a._base is None else a._base for a in tensors)}  # a view's base
        cache[key] = ([weakref.ref(o, forget) for o in owners.values()], result)
        if len(cache) > ENTRIES and not collective:
            cache.popitem(last=False)
        return result

    return wrapper

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
by its storage and memory (address, layout, version), not by its Python object,
and an entry lives as long as its argument tensors (or the tensors they are views of) do: a
step's plans stay cached through all its layers, and go, with what was derived
from them, when the step drops them. ``ENTRIES`` only bounds the cache. The cache is one
for all threads: on CUDA the autograd engine runs the backward on a thread of its
own, which must find what the forward derived.

The key, and when an entry holds: an argument tensor is known by its storage, address, dtype,
device, shape, strides and version (:func:`_key`); other arguments by value. A write through
the tensor or a view of it bumps the version, so the entry is not found again. A write that
bypasses the version counter (through the numpy array of ``torch.from_numpy``, DLPack, shared
memory: a data loader that refills one ``cu_seqlens`` buffer for every pack) is caught on the
host only: each entry keeps a copy of the values of its CPU tensor arguments, of any size, and
is found only while they are unchanged (compared in full, byte for byte, at every lookup: a
copy and a compare of the tensor's bytes, far below the cost of the plans and kernels keyed on
it). A CUDA tensor's values are never read for a lookup (that would wait for the stream): it is
known by its memory and version alone, and must change only through torch (a loader that
refills device memory behind torch's back must hand over a new tensor); a CUDA graph replay's
outputs are never cached (:func:`replayed`).

Host twins: some metadata has data-dependent sizes (the backward's scratch rows,
the keys a rank reads), and reading a size from a GPU tensor waits for the stream.
The plan is therefore made on the host (``plan.step_plan``) and uploaded with
:func:`upload`, which keeps each tensor's host copy, its *twin*; :func:`readable`
hands derivations the twins to read sizes from, and :func:`twinned` runs a small
derivation on the twins and uploads its results in turn. The data loader can
upload ``cu_seqlens`` the same way (``shard_batch(..., device=...)``), and then a
step reads nothing from the GPU at all.

Nothing else is found through a tensor: what a derivation needs beyond a plan tensor's values
travels as values (the plan carries the pack it was made from: ``plan.pieces.AttentionPlan``).
This module holds the two tensor-keyed tables, each with its key and lifetime stated: the
:func:`per_plan` caches (key: :func:`_key` of the argument tensors, and the values of CPU ones;
an entry lives until one of its tensors is freed, at most :data:`ENTRIES` per function; a caller
that makes a result together with its arguments may put it there first, ``fn.remember``) and the
host twins (key: the uploaded tensor's :func:`_key`; an entry lives as long as the uploaded tensor).

Under a CUDA graph capture (a captured CP step: docs/cuda-graphs.md) nothing is cached or
looked up: a capture records kernels, not host work, so a value found on the host would be
the one replayed for every later pack. Derivations then run on the device in the capture
(:func:`capturing`), and an upload from the host, which would replay the captured pack's
values, raises. Within one capture that a :class:`cpcompile.CapturedStep` makes
(:func:`within_capture`), a derivation made on the device is kept until that capture ends: the
kernels that made it are recorded once and rerun at every replay, before every layer that reads
it, as outside a graph a step's plan is derived once for all its layers.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

#: Most argument sets kept per function: far more plans than one step uses.
ENTRIES = 64


def _key(a):
    if not isinstance(a, torch.Tensor):
        return a
    # Views of one storage share its version counter; an in-place change bumps it. The storage's
    # identity tells apart another tensor over the same memory with a storage and version counter
    # of its own (``torch.from_numpy`` of a refilled buffer), and is shared by views and detached
    # aliases; an entry goes when its owner is freed, and a live owner keeps its storage.
    return (_storage(a), a.data_ptr(), a.dtype, a.device, tuple(a.shape), a.stride(), a._version)


def _values(a) -> bytes | None:
    """The bytes of ``a``'s values (a copy) where reading them costs no sync: ``a`` a CPU tensor with
    memory (not fake); else ``None``. Writes that bypass the version counter (through the numpy array
    a ``torch.from_numpy`` tensor shares, DLPack) are seen by comparing these (:func:`_values_of`)."""
    if not isinstance(a, torch.Tensor) or a.device.type != "cpu" or is_fake(a):
        return None
    a = a.detach()
    try:  # numpy reads the memory in place: one copy, in the tensor's element order
        array = a.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8), a conjugate or negative view
        array = a.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
    return array.tobytes()  # bytes, not elements: a NaN equals itself


def _values_of(args) -> tuple:
    """:func:`_values` of each of ``args``, ``()`` where none has any (no CPU tensor)."""
    values = tuple(_values(a) for a in args)
    return values if any(v is not None for v in values) else ()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph: :func:`per_plan` then caches
    nothing, :func:`twin` finds nothing, and :func:`upload` raises."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def refuse_capture(what: str) -> None:
    """Raise ``RuntimeError`` while a CUDA graph is captured: ``what`` (an op that derives host-side sizes
    from its tensors' values) would be replayed with the captured pack's sizes for every pack."""
    if capturing():
        raise RuntimeError(
            f"cpcompile's {what} cannot run inside a CUDA graph capture: it sizes its work on the host from the "
            "pack, which every replay would repeat. Compile with torch.compile(..., mode='reduce-overhead') "
            "(cpcompile's backend keeps such ops between the captured parts), or capture with "
            "cpcompile.CapturedStep a model compiled with cpcompile.backend(..., captured_step=True), whose "
            "attention is captured (docs/cuda-graphs.md)"
        )


#: Tags of every cpcompile op but the captured pair (:mod:`cpcompile.attention.captured`): kept out of CUDA graphs. The
#: attention and plan ops derive host-side data from their tensors' values (the plan, the kernels'
#: launch bounds and scratch sizes, the exchange's counts), so a captured call would replay the pack
#: it was captured on, silently wrong for every other; the collective ops run their own streams and
#: peers' signals, not checked under capture. Inductor's graph partitions leave tagged ops out of its
#: CUDA graphs and capture what lies between them (``mode="reduce-overhead"`` through cpcompile's
#: backend: docs/cuda-graphs.md); a capture made by hand (``torch.cuda.graph``) does not read tags.
NOT_CAPTURED = (torch.Tag.cudagraph_unsafe,)


_uncached = threading.local()


class _Scope:
    """The derivations kept while a :class:`cpcompile.CapturedStep` captures (:func:`within_capture`):
    ``(fn, key) -> (result, arguments)``, for every thread (the autograd engine runs the captured backward
    on a thread of its own); ``None`` outside such a capture."""

    entries: dict | None = None
    lock = threading.Lock()


_SCOPE = _Scope()


@contextlib.contextmanager
def within_capture():
    """Within, while the current stream captures a CUDA graph (entered inside the capture, so that what
    it keeps is freed before the capture ends, as the graph's other temporaries are): :func:`per_plan`
    keeps what it derives on the device, whatever :func:`uncached` says, until the end, and holds its
    argument tensors meanwhile, so that no other tensor takes their memory and key. Each layer of a
    captured step then reads the derivations of the first: their kernels are recorded once and rerun at
    every replay from the plan slots' new values, before the layers that read them. For a capture of
    one whole step (:class:`cpcompile.CapturedStep`), not for cudagraph trees', whose parts' first
    calls run without a capture in the graphs' pool, where nothing may outlive a call."""
    if _SCOPE.entries is not None:
        raise RuntimeError("cpcompile.cache.within_capture: one capture at a time")
    _SCOPE.entries = {}
    try:
        yield
    finally:
        with _SCOPE.lock:
            _SCOPE.entries = None


@contextlib.contextmanager
def uncached():
    """Within: :func:`per_plan` caches nothing (this thread). For calls whose memory belongs to a CUDA
    graph's pool, also when they run without a capture (cudagraph trees run each part once
    without one first, in the pool): a cached tensor would outlive the call there, which cudagraph
    trees refuse ("tensors in the cudagraph pool not tracked as outputs")."""
    before = getattr(_uncached, "on", False)
    _uncached.on = True
    try:
        yield
    finally:
        _uncached.on = before


def replayed(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the tensor it is a view of) is an output of a CUDA graph replay (inductor's
    cudagraph trees): each replay hands out the same memory, address and version with new values,
    so nothing may be known by its key; :func:`per_plan` recomputes and :func:`twin` finds none.
    Not recognised: a tensor over such an output's memory made as a new tensor rather than a view
    (cudagraph trees hand out aliased outputs that way, and inductor's ``reinterpret_tensor``): a
    plan op must not read a tensor computed inside a captured part of the model (docs/cuda-graphs.md)."""
    return torch._C._is_cached_tensor(t) or (t._base is not None and torch._C._is_cached_tensor(t._base))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``t``'s memory: ``t``, or the tensor it is a view of."""
    return t if t._base is None else t._base


def token(t: torch.Tensor):
    """What :func:`per_plan` knows ``t`` by: its memory key, its values on the host (a CPU
    tensor's: :func:`_values`), and a weak reference to the tensor that owns the memory (``t``
    or the tensor it is a view of), for :func:`same_plan`."""
    return _key(t), _values(t), weakref.ref(_owner(t))


def same_plan(known, t: torch.Tensor) -> bool:
    """Whether ``t`` is the plan tensor of ``known`` (a :func:`token`): the same memory, still
    owned by the same live tensor, unchanged since (on the host: the same values). Views of it count as it."""
    key, values, owner = known
    return owner() is not None and not replayed(t) and key == _key(t) and values == _values(t)


class _Cache:
    """Entries keyed by their tensors' memory (:func:`_key`), each holding the values of its CPU
    tensors (:func:`_values_of`) and found only while they are unchanged; each goes when one of its
    tensors (or the tensor a view is of) is freed. One lock for all threads, reentrant:
    an entry replaced or evicted under it may free tensors whose entries then go too."""

    def __init__(self, bound: int | None):
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.bound, self.lock = bound, threading.RLock()

    def get(self, key, values=()):
        """``(found, value)`` of the entry of ``key`` whose tensors hold ``values`` (:func:`_values_of`).
        An entry whose values differ stays: its tensors were written behind their version counter, and
        :meth:`put` replaces it (or they get its values back, and it holds again)."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and entry[2] == values:
                self.entries.move_to_end(key)
                return True, entry[1]
        return False, None

    def put(self, key, tensors, value, values=()) -> None:
        def forget(_, key=key):
            with self.lock:
                self.entries.pop(key, None)

        owners = {id(t): t for t in map(_owner, tensors)}
        with self.lock:
            self.entries[key] = ([weakref.ref(o, forget) for o in owners.values()], value, values)
            if self.bound is not None and len(self.entries) > self.bound:
                self.entries.popitem(last=False)


def per_plan(fn):
    """Memoize ``fn`` for its recent argument sets: tensors by storage, memory and version, the rest by value.

    An entry goes when an argument tensor (or the tensor it is a view of) is freed,
    so its memory is not reused while the entry exists. A tensor is assumed to
    change only through itself or its views (which bump its version); another tensor
    over the same memory (``torch.from_numpy`` of a reused buffer) is another key,
    but writes through it do not reach this tensor's version: those are seen in CPU
    tensors of any size, whose values an entry keeps and compares at every lookup, and
    not in CUDA tensors, whose values are never read here (module docstring). Inference tensors have
    no version counter, and CUDA graph replays' outputs (:func:`replayed`) change with the same
    version: calls with them are not cached, nor calls while a CUDA graph is captured
    (:func:`capturing`: each capture derives its own, on the device; a :class:`cpcompile.CapturedStep`'s
    capture keeps it for its other layers, :func:`within_capture`). ``fn`` must not communicate:
    which entries a rank keeps depends on when it frees tensors, so ranks would not
    miss alike.
    """
    cache = _Cache(ENTRIES)
    made = _Cache(ENTRIES)  # results put by :func:`remember`, found by key alone

    def cacheable(args) -> bool:
        if getattr(_uncached, "on", False) or capturing():
            return False
        return not any(isinstance(a, torch.Tensor) and (a.is_inference() or replayed(a)) for a in args)

    @functools.wraps(fn)
    def wrapper(*args):
        if _SCOPE.entries is not None and capturing():
            return _in_capture(fn, args)
        if not cacheable(args):
            return fn(*args)
        key = tuple(_key(a) for a in args)
        hit, result = made.get(key)
        if hit:
            return result
        values = _values_of(args)  # before fn reads them
        hit, result = cache.get(key, values)
        if not hit:
            result = fn(*args)
            cache.put(key, [a for a in args if isinstance(a, torch.Tensor)], result, values)
        return result

    def remember(*args, result) -> None:
        """Keep ``result`` as ``fn(*args)``, for a caller that made both together (a plan's gather index
        from the layout that is its inverse), so that calls find it instead of deriving it again. Such
        arguments are new tensors that must then change only through torch, as an upload's twin: the
        entry is found by their key alone (no values kept or compared, which would cost as much as
        deriving it), and goes, as a call's, when one of them is freed."""
        if cacheable(args) and not any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
            made.put(tuple(_key(a) for a in args), [a for a in args if isinstance(a, torch.Tensor)], result)

    wrapper.remember = remember
    return wrapper


def _in_capture(fn, args: tuple):
    """``fn(*args)``, kept for the rest of the capture under way (:func:`within_capture`); not kept with
    inference tensors among ``args`` (no version counter to key them by: a step captured under
    ``torch.inference_mode``)."""
    if any(isinstance(a, torch.Tensor) and a.is_inference() for a in args):
        return fn(*args)
    key = (fn, tuple(_key(a) for a in args))
    with _SCOPE.lock:
        entries = _SCOPE.entries
        found = None if entries is None else entries.get(key)
    if found is not None:
        return found[0]
    result = fn(*args)
    with _SCOPE.lock:
        if _SCOPE.entries is not None:  # the arguments held too: no other tensor takes their memory and key
            _SCOPE.entries.setdefault(key, (result, args))
    return result


# --- host twins -----------------------------------------------------------------------

_TWINS = _Cache(None)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, remembered with ``host`` as its twin.

    The copy does not wait for the stream (pinned memory, ``non_blocking``); the twin
    must not change afterwards. On the CPU the tensor is its own twin.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if capturing():
        raise RuntimeError(
            "a plan derivation uploaded host values while a CUDA graph was captured: every replay would read the "
            "captured pack's values; derive it on the device (cache.capturing)"
        )
    if host.is_inference():  # no version counter to key a twin by: a plain copy
        return host.to(device)
    pinned = host.pin_memory() if device.type == "cuda" else host
    on_device = pinned.to(device, non_blocking=True)
    _TWINS.put(_key(on_device), [on_device], host)
    return on_device


def twin(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values on the host without a sync: ``t`` on the CPU, else the copy it was
    uploaded from (:func:`upload`) while ``t`` is unchanged; ``None`` when there is none."""
    if t.device.type == "cpu":
        return t
    if t.is_inference() or replayed(t) or capturing():  # a plain copy (no version counter); a replay's output
        return None
    return _TWINS.get(_key(t))[1]


def on_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors' values on the host: their twins, and copies of the others, made in one
    transfer where they share a dtype (one host sync on GPUs, none where all have twins)."""
    twins = [twin(t) for t in tensors]
    missing = [t for t, h in zip(tensors, twins) if h is None]
    if len({t.dtype for t in missing}) == 1 and len(missing) > 1:
        copies = iter(torch.cat([t.reshape(-1) for t in missing]).cpu().split([t.numel() for t in missing]))
        missing = [next(copies).view(t.shape) for t in missing]
    else:
        missing = [t.cpu() for t in missing]
    rest = iter(missing)
    return tuple(next(rest) if h is None else h for h in twins)


def readable(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors to read values from on the host: their twins where every one has
    one, else the tensors themselves (reading those is then a host sync on GPUs)."""
    twins = tuple(twin(t) for t in tensors)
    return tensors if any(t is None for t in twins) else twins


def twinned(fn):
    """``fn`` over plan tensors, run on their twins where every tensor argument has one,
    with its tensor results (alone, or in a tuple or ``NamedTuple``) uploaded back to
    the arguments' device, twins kept: for small metadata whose sizes are read later.
    Without twins ``fn`` runs on the arguments as they are."""

    @functools.wraps(fn)
    def wrapper(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        twins = [twin(t) for t in tensors]
        if not tensors or tensors[0].device.type == "cpu" or any(t is None for t in twins):
            return fn(*args)
        it = iter(twins)
        result = fn(*(next(it) if isinstance(a, torch.Tensor) else a for a in args))
        device = tensors[0].device

        def up(x):
            return upload(x, device) if isinstance(x, torch.Tensor) else x

        if isinstance(result, tuple):
            values = [up(x) for x in result]
            return type(result)(*values) if hasattr(result, "_fields") else tuple(values)
        return up(result)

    return wrapper

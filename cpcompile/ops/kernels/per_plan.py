"""Metadata derived from a plan, built once per step instead of once per layer.

Every layer of a step calls the kernels with the same plan tensors (``cu_q``,
``k_start``, ``k_len``), so what the kernels derive from them (cuDNN's ragged
offsets; the backward's scratch rows, whose size is a host sync) is the same for
every layer. Built per call, the backward's sync drained the stream in every
layer, and the GPU then waited for the host's metadata work: 1.9 ms per rank's
backward on the H200 (dual_chunk_swap, cp=8, 128K tokens), for a 9.5 ms kernel.
"""

from __future__ import annotations

import functools
import threading

import torch


def per_plan(fn):
    """Memoize ``fn`` for its most recent arguments: tensors by identity and version, the rest by value.

    The cached call holds its argument tensors, so their ids are not reused while
    it is cached; an in-place change bumps a tensor's version. Inference tensors
    have no version counter: calls with them are not cached.
    """
    local = threading.local()

    @functools.wraps(fn)
    def wrapper(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.is_inference() for t in tensors):
            return fn(*args)
        key = tuple((id(a), a._version) if isinstance(a, torch.Tensor) else a for a in args)
        last = getattr(local, "last", None)
        if last is not None and last[0] == key:
            return last[2]
        result = fn(*args)
        local.last = (key, args, result)
        return result

    return wrapper

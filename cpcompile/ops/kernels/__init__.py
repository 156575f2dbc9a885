"""Attention kernels behind the ops, all with the piece contract of ``reference``.

``select(device, name)`` picks one: the ``CPCOMPILE_KERNEL`` environment variable or
``name`` overrides; otherwise CUDA tensors use torch's varlen flash kernel when
the dtype allows it, and everything else the exact reference.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import reference

KERNELS = ("reference", "flash")


def select(q: torch.Tensor, name: str | None = None) -> ModuleType:
    """The kernel module for ``q`` (``forward`` and ``backward`` functions)."""
    name = name or os.environ.get("CPCOMPILE_KERNEL") or None
    if name is not None and name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r} (argument or CPCOMPILE_KERNEL)")
    if name == "reference":
        return reference
    usable = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if name == "flash" and not usable:
        raise ValueError(f"kernel 'flash' needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}")
    if usable:
        from . import flash

        return flash
    return reference

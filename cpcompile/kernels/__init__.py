"""Attention kernels behind the ops, all with the piece contract of ``reference``.

``select(q, name)`` picks one: ``name`` or the ``CPCOMPILE_KERNEL`` environment
variable overrides. Otherwise CUDA fp16/bf16 tensors use ``auto`` (cuDNN's forward
and the faster backward per call, see ``auto``) when cudnn-frontend is installed
(the ``gpu`` extra), else torch's varlen flash kernel (``flash``); everything else
uses the exact ``reference``.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import reference

KERNELS = ("reference", "flash", "cudnn", "auto")


def select(q: torch.Tensor, name: str | None = None) -> ModuleType:
    """The kernel module for ``q`` (``forward`` and ``backward`` functions)."""
    name = name or os.environ.get("CPCOMPILE_KERNEL") or None
    if name is not None and name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r} (argument or CPCOMPILE_KERNEL)")
    if name == "reference":
        return reference
    usable = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if name is not None and not usable:
        raise ValueError(f"kernel {name!r} needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}")
    if not usable:
        return reference
    from . import cudnn, flash

    if name in ("cudnn", "auto") and not cudnn.available():
        raise ValueError(f"kernel {name!r} needs cudnn-frontend: pip install 'cpcompile[gpu]'")
    if name == "cudnn":
        return cudnn
    if name == "flash" or not cudnn.available():
        return flash
    from . import auto

    return auto

"""Attention kernels behind one stated contract (``contract``), and :func:`select`, which picks one.

Backends: ``reference`` (exact, any device), ``flash`` (torch's varlen flash kernel),
``cudnn`` (cuDNN's fused attention, the ``gpu`` extra) and ``auto`` (cuDNN's forward
and the backward chosen per call). ``metadata`` holds what the GPU backwards derive
from a plan, ``triton`` their Triton helpers. The GPU backends import without CUDA
or cudnn-frontend; they need them only when called.
"""

from __future__ import annotations

import os

import torch

from . import reference
from .contract import AttentionKernel, BackwardOptions

KERNELS = ("reference", "flash", "cudnn", "auto")

__all__ = ["KERNELS", "AttentionKernel", "BackwardOptions", "select"]


def select(q: torch.Tensor, name: str | None = None) -> AttentionKernel:
    """The kernel module for ``q`` (``forward`` and ``backward`` functions).

    ``name`` or the ``CPCOMPILE_KERNEL`` environment variable overrides. Otherwise CUDA
    fp16/bf16 tensors use ``auto`` when cudnn-frontend is installed (the ``gpu`` extra),
    else ``flash``; everything else uses the exact ``reference``.
    """
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

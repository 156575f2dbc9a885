"""Attention kernels behind one stated contract (``contract``), and :func:`select`, which picks one.

A call's pieces travel as a :class:`Pieces`, and where the backward's dK/dV sums go as
a :class:`KeyGrads`.

Backends: ``reference`` (exact, any device), ``flash`` (torch's varlen flash kernel),
``cudnn`` (cuDNN's fused attention, the ``gpu`` extra), ``fa4`` (FlashAttention-4, the
``fa4`` extra) and ``auto`` (each direction on the fastest one that runs the call).
``varlen`` is what ``flash`` and ``fa4`` share, ``metadata`` what the GPU backwards
derive from a plan, ``triton`` their Triton helpers. The GPU backends import without
CUDA, cudnn-frontend or FA4; they need them only when called.
"""

from __future__ import annotations

import warnings

import torch

from cpcompile.cache import refuse_capture
from cpcompile.config import KERNELS, check_choice
from cpcompile.kernels import contract, reference
from cpcompile.kernels.contract import AttentionKernel, BackwardOptions, KeyGrads, Pieces

__all__ = ["KERNELS", "AttentionKernel", "BackwardOptions", "KeyGrads", "Pieces", "select"]


def select(
    q: torch.Tensor,
    name: str | None = None,
    *,
    band: str | None = None,
    v: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> AttentionKernel:
    """The kernel module for ``q`` (``[T, Hq, D]``; only its device and dtype count).

    ``name``, one of :data:`KERNELS`, comes from the caller's configuration (``StrategySpec.kernel``); this function
    reads no environment. ``None`` chooses by what is installed: CUDA fp16/bf16 tensors get
    ``auto`` where cudnn-frontend imports, else ``fa4`` where FA4 runs ``q``, else ``flash``;
    every other tensor ``reference``. A named GPU kernel for other tensors, ``cudnn``/``auto``
    without cudnn-frontend, or ``fa4`` where FA4 cannot run ``q``, raises ``ValueError``.

    Called while a CUDA graph is captured, it raises ``RuntimeError``: the ops that select a kernel
    size their work on the host (the captured op, ``ops.captured``, takes FA4 without it).

    ``band``: where the call has a window that no GPU kernel runs (``contract.gpu_window``), why;
    a named GPU kernel then raises ``ValueError``, and ``None`` chooses ``reference`` (exact, slow),
    with a warning.

    ``v`` and ``softcap``: the call's values and soft-capping, where they may ask what not every GPU kernel
    runs (``contract.variant``: a value head dim of their own, soft-capping), which only FA4 of them runs:
    ``flash`` and ``cudnn`` then raise ``ValueError`` naming it, ``auto`` takes FA4 (``ValueError`` where
    FA4 cannot run the call), and ``None`` takes FA4 where it runs the call, else ``reference``, with a
    warning that says why.
    """
    if name is not None:
        check_choice("kernel", name, KERNELS)
    refuse_capture("attention")
    if name == "reference":
        return reference
    usable = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if band is not None and usable:
        if name is not None:
            raise ValueError(f"kernel {name!r} cannot run {band}; use kernel='reference' (StrategySpec.kernel) for it")
        warnings.warn(f"no GPU kernel runs {band}: the exact reference kernel runs it (slow)", stacklevel=2)
        return reference
    if name is not None and not usable:
        raise ValueError(f"kernel {name!r} needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}")
    if not usable:
        return reference
    from cpcompile.kernels import cudnn, fa4, flash

    variant = contract.variant(q, q if v is None else v, softcap)
    if variant is not None and name != "fa4":
        if name in ("flash", "cudnn"):
            raise ValueError(
                f"kernel {name!r} cannot run {variant}; use kernel='fa4' or 'reference' (StrategySpec.kernel)"
            )
        if fa4.supports(q, v):
            return fa4
        why = f"cuDNN and torch's flash kernel cannot run {variant}, and FlashAttention-4 cannot run it here"
        if name == "auto":
            raise ValueError(f"kernel 'auto' has no kernel for this call: {why} ({fa4.SUPPORTED}, Hopper or Blackwell)")
        warnings.warn(f"{why}: the exact reference kernel runs it (slow)", stacklevel=2)
        return reference

    if name in ("cudnn", "auto") and not cudnn.available():
        raise ValueError(f"kernel {name!r} needs cudnn-frontend: pip install 'cpcompile[gpu]'")
    if name == "fa4" and (why := fa4.why_not(q, v)) is not None:
        raise ValueError(f"kernel 'fa4' cannot run this call: {why}")
    if name == "cudnn":
        return cudnn
    if name == "fa4":
        return fa4
    if name == "flash":
        return flash
    if not cudnn.available():
        return fa4 if fa4.supports(q) else flash
    from cpcompile.kernels import auto

    return auto

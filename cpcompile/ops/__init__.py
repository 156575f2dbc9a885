"""Custom ops (namespace ``cpcompile``) and their kernels."""

from ..comm.kv_gather import release_grad_buffers
from . import (
    layout,  # noqa: F401  (registers cpcompile::balanced_layout, which balanced plans call, on import)
    ring,  # noqa: F401  (registers cpcompile::cp_ring_attention, which cp_attention(comm="ring") runs)
)
from .attention import cp_attention, packed_attention
from .overlap import ag_gemm, gemm_rs

__all__ = ["ag_gemm", "cp_attention", "gemm_rs", "packed_attention", "release_grad_buffers"]

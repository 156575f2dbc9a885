"""Tensor-parallel overlap on capacity buffers: the ops (:func:`ag_gemm`, :func:`gemm_rs`,
:mod:`~cpcompile.tp.ops`) and the graph pass that puts them in (:mod:`~cpcompile.tp.rewrite`)."""

from cpcompile.tp.ops import ag_gemm, gemm_rs

__all__ = ["ag_gemm", "gemm_rs"]

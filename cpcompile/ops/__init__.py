"""Custom ops (namespace ``cpcompile``) and their kernels."""

from .attention import cp_attention, packed_attention

__all__ = ["cp_attention", "packed_attention"]

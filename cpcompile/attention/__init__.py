"""Attention under CP: the calls a model makes and the custom ops (namespace ``cpcompile``) they run.

- :mod:`~cpcompile.attention.api`: :func:`cp_attention` and :func:`packed_attention`.
- :mod:`~cpcompile.attention.gathered`, :mod:`~cpcompile.attention.exchange`,
  :mod:`~cpcompile.attention.ring`, :mod:`~cpcompile.attention.heads`,
  :mod:`~cpcompile.attention.hybrid`: one op per way K/V move, over :mod:`cpcompile.comm`.
- :mod:`~cpcompile.attention.plan_op`: the plan as an op, which compiled graphs call once per step.
- :mod:`~cpcompile.attention.split`: the all-gather path with its transfers as graph nodes (``overlap_kv``);
  :mod:`~cpcompile.attention.split_exchange`: the sparse exchange's (and ``kv="auto"``'s) the same way.
- :mod:`~cpcompile.attention.captured`: the ops of a captured step (CUDA graphs).
- :mod:`~cpcompile.attention.common`: what the ops share (agreement, autograd registration).
"""

from cpcompile.attention import ring  # noqa: F401  (registers cpcompile::cp_ring_attention, which kv="ring" runs)
from cpcompile.attention.api import cp_attention, packed_attention
from cpcompile.comm.kv_gather import release_grad_buffers

__all__ = ["cp_attention", "packed_attention", "release_grad_buffers"]

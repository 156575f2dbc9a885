"""A rank's plan: its local queries cut into pieces and the keys each piece reads.

- :mod:`~cpcompile.plan.pieces`: :class:`AttentionPlan` and :func:`make_plan` (all-gather,
  head and hybrid plans), made once per step (``step_plan``).
- :mod:`~cpcompile.plan.ring`: the ring's per-step key blocks.
- :mod:`~cpcompile.plan.window`: a plan's keys under a sliding window.
- :mod:`~cpcompile.plan.exchange`: which rows the sparse exchange moves.
"""

from cpcompile.plan.pieces import AttentionPlan, make_plan

__all__ = ["AttentionPlan", "make_plan"]

"""Learnable sinks joined after a kernel's softmax (the math: ``cpcompile.attention.sinks``).

A backend whose kernel takes the sinks itself (FA4's ``learnable_sink``) joins them in its softmax and
writes no more than it would without them; every other backend calls :func:`apply` on its ``(out, lse)``.
"""

from __future__ import annotations

import torch


def apply(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [T, Hq, Dv]`` and ``lse [Hq, T]`` (natural log, accumulation dtype) of ordinary attention ->
    ``(out * w, logaddexp(lse, sinks))``, ``out`` in its dtype, computed in ``lse``'s."""
    acc = lse.dtype
    final = torch.logaddexp(lse, sinks.to(acc)[:, None])  # [Hq, T]; sinks[h] where lse = -inf
    w = torch.exp(lse - final)  # sigmoid(lse - sinks[h]): 0 where the row has no keys
    return (out.to(acc) * w.t().unsqueeze(-1)).to(out.dtype), final


def joined(out_and_lse: tuple[torch.Tensor, torch.Tensor], sinks: torch.Tensor | None):
    """``(out, lse)`` with ``sinks`` applied (:func:`apply`), or as they are without sinks: a backend's that
    does not join them in its kernel, and the ring's and head parallelism's after their merges."""
    return out_and_lse if sinks is None else apply(*out_and_lse, sinks)

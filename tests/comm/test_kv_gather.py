"""The all-gather path's head-group count and kept dK/dV buffers (``cpcompile.comm.kv_gather``)."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.comm.kv_gather import grad_buffers, kv_chunks


def test_kv_chunks_is_lowered_to_a_divisor_of_the_kv_heads():
    assert kv_chunks(1, 8) == 1  # the default: one gather each of K and V, one kernel call
    for want, heads, got in ((4, 8, 4), (3, 8, 2), (16, 4, 4), (2, 1, 1)):
        assert kv_chunks(want, heads) == got
    with pytest.raises(ValueError, match="kv_chunks must be a positive int, got 0"):
        kv_chunks(0, 8)


def test_grad_buffers_are_zeroed_once_per_plan():
    """The backward's dK/dV buffers: zero for new pieces (plan or mask) or head grouping; for
    the same ones, what the last layer's kernel wrote stays (each layer rewrites the same rows)."""

    k = torch.empty(4, 2, 3)
    plan = torch.arange(8)
    cu_q, k_start, causal, full = torch.tensor([0, 4]), torch.tensor([0]), torch.tensor([4]), torch.tensor([8])
    dk, dv = grad_buffers(plan, (cu_q, k_start, causal), k, k, 1)
    assert dk.shape == dv.shape == (1, 8, 2, 3) and not dk.any() and not dv.any()
    dk.fill_(1)
    dv.fill_(2)
    again = grad_buffers(plan, (cu_q, k_start, causal), k, k, 1)
    assert (again[0] == 1).all() and (again[1] == 2).all()
    dk, dv = grad_buffers(plan, (cu_q, k_start, full), k, k, 1)  # the same plan, another mask
    assert not dk.any() and not dv.any()
    dk.fill_(1)
    dv.fill_(2)
    for changed in (torch.arange(8), torch.arange(12)):  # a new plan: zeroed, grown to its T
        dk, dv = grad_buffers(changed, (cu_q, k_start, full), k, k, 1)
        assert dk.shape == (1, changed.shape[0], 2, 3) and not dk.any() and not dv.any()
        dk.fill_(1)
    dk, _ = grad_buffers(changed[:], (cu_q, k_start, full), k, k, 2)  # two head groups; a view of the plan is the plan
    assert dk.shape == (2, 12, 1, 3) and not dk.any()
    dk.fill_(1)
    assert (grad_buffers(changed[:], (cu_q, k_start, full), k, k, 2)[0] == 1).all()
    changed.add_(0)  # changed in place: a new plan too
    dk, _ = grad_buffers(changed, (cu_q, k_start, full), k, k, 2)
    assert not dk.any()
    dk.fill_(1)
    cpcompile.attention.release_grad_buffers()
    assert not grad_buffers(changed, (cu_q, k_start, full), k, k, 2)[0].any()
    # values of their own head dim (MLA): dV's buffer has it, and holds none of dK's floats
    dk, dv = grad_buffers(changed, (cu_q, k_start, full), k, torch.empty(4, 2, 5), 1)
    assert dk.shape == (1, 12, 2, 3) and dv.shape == (1, 12, 2, 5)
    assert dk.data_ptr() + dk.numel() * dk.element_size() <= dv.data_ptr()

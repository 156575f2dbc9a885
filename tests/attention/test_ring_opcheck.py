"""The ring ops under opcheck, on one rank, and the ``comm`` choice's argument checks."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import cpcompile
from cpcompile.plan.ring import make_ring_plan
from tests.fixtures import attention_case


def test_opcheck_ring_ops(single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    plan = cpcompile.plan.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    for causal in (True, False):
        opcheck(torch.ops.cpcompile.ring_key_ranges.default, (plan.gather_index, plan.k_start, plan.k_len(causal), 1))
        ring = make_ring_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), ring.cu_q, ring.k_start)
        args += (ring.k_len(causal), single_rank_group.group_name, causal, None, 9, 9, None)
        opcheck(torch.ops.cpcompile.cp_ring_attention.default, args)


def test_ring_on_one_rank_is_packed_attention(single_rank_group):
    cu, _, q, k, v, dout = attention_case([3, 9, 4])
    for causal in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = cpcompile.packed_attention(*leaves, cu, causal=causal)
        want_grads = torch.autograd.grad(want, leaves, dout)
        got = cpcompile.cp_attention(*leaves, cu, strategy="no_load_balance", comm="ring", causal=causal)
        for a, b in zip((got, *torch.autograd.grad(got, leaves, dout)), (want, *want_grads)):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_comm_comes_from_the_strategy_unless_given(single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    ring = make_ring_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    with cpcompile.strategy("no_load_balance", comm="ring") as spec:
        assert spec == cpcompile.StrategySpec(cpcompile.Strategy.NO_LOAD_BALANCE, comm="ring")
        cpcompile.cp_attention(q, k, v, cu, plan=ring)  # the active spec's comm: a ring plan fits
        with pytest.raises(TypeError, match="plan must be a AttentionPlan for comm='all_gather', got RingPlan"):
            cpcompile.cp_attention(q, k, v, cu, plan=ring, comm="all_gather")
    with pytest.raises(TypeError, match="plan must be a RingPlan for comm='ring', got AttentionPlan"):
        cpcompile.cp_attention(q, k, v, cu, plan=cpcompile.plan.make_plan(cu, cp_size=1, rank=0), comm="ring")
    two_ranks = make_ring_plan(cu, cp_size=2, rank=0, strategy="no_load_balance")
    with pytest.raises(ValueError, match="plan has key ranges for 2 ranks, the group has cp_size 1"):
        cpcompile.cp_attention(q, k, v, cu, plan=two_ranks, comm="ring")


@pytest.mark.parametrize(
    "call",
    [
        lambda: cpcompile.strategy("striped", comm="p2p").__enter__(),
        lambda: cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, comm="p2p"),
        lambda: cpcompile.backend(comm="p2p"),
    ],
)
def test_bad_comm_names_the_argument(call):
    with pytest.raises(ValueError, match=r"comm must be one of \('all_gather', 'ring'\), got 'p2p'"):
        call()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"overlap_tp": "no"}, TypeError, "overlap_tp must be a bool, got 'no'"),
        ({"captured_step": 1}, TypeError, "captured_step must be a bool, got 1"),
        ({"tp_capacity_tokens": -5}, ValueError, "tp_capacity_tokens must be an int >= 1, got -5"),
        ({"tp_capacity_tokens": "x"}, ValueError, "tp_capacity_tokens must be an int >= 1, got 'x'"),
    ],
)
def test_backend_names_a_bad_argument(kwargs, error, message):
    """The backend refuses its arguments when made, not at the first compile."""
    with pytest.raises(error, match=message):
        cpcompile.backend(**kwargs)

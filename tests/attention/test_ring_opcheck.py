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
        ring = cpcompile.StrategySpec("no_load_balance", kv="ring")
        got = cpcompile.cp_attention(*leaves, cu, strategy=ring, causal=causal)
        for a, b in zip((got, *torch.autograd.grad(got, leaves, dout)), (want, *want_grads)):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_kv_comes_from_the_strategy(single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    ring = make_ring_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    ring_spec = cpcompile.StrategySpec(cpcompile.Strategy.NO_LOAD_BALANCE, kv="ring")
    with cpcompile.strategy("no_load_balance", kv="ring") as spec:
        assert spec == ring_spec
        cpcompile.cp_attention(q, k, v, cu, plan=ring)  # the active spec's kv: a ring plan fits
        with pytest.raises(TypeError, match="plan must be a AttentionPlan for kv='auto', got RingPlan"):
            cpcompile.cp_attention(q, k, v, cu, plan=ring, strategy=cpcompile.StrategySpec("no_load_balance"))
    with pytest.raises(TypeError, match="plan must be a RingPlan for kv='ring', got AttentionPlan"):
        cpcompile.cp_attention(q, k, v, cu, plan=cpcompile.plan.make_plan(cu, cp_size=1, rank=0), strategy=ring_spec)
    two_ranks = make_ring_plan(cu, cp_size=2, rank=0, strategy="no_load_balance")
    with pytest.raises(ValueError, match="plan has key ranges for 2 ranks, the group has cp_size 1"):
        cpcompile.cp_attention(q, k, v, cu, plan=two_ranks, strategy=ring_spec)


@pytest.mark.parametrize(
    "call",
    [
        lambda: cpcompile.strategy("striped", kv="p2p").__enter__(),
        lambda: cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, kv="p2p"),
    ],
)
def test_bad_kv_names_the_argument(call):
    with pytest.raises(
        ValueError, match=r"kv must be one of \('auto', 'all_gather', 'exchange', 'ring', 'heads'\), got 'p2p'"
    ):
        call()

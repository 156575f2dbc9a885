"""Tier 2: the head-parallel ops on one rank: ``opcheck``, and single-device attention's answer.

On a one-process group the all-to-alls are identities and the plan's order is physical, so
``cp_head_attention`` must be ``packed_attention`` exactly. Real ranks: ``tests/test_heads_gloo.py``.
"""

from __future__ import annotations

import torch
from torch.library import opcheck

import cpcompile
from cpcompile.ops import heads  # noqa: F401  (registers the ops)
from tests.fixtures import attention_case


def _plan(cu, cu_p, tokens):
    return torch.ops.cpcompile.cp_head_plan(cu, cu_p, tokens, 1, "dual_chunk_swap", 1)


def test_opcheck_cp_head_plan():
    cu, cu_p, *_ = attention_case([3, 9, 4], padded_lengths=[4, 10, 6])
    opcheck(torch.ops.cpcompile.cp_head_plan.default, (cu, cu_p, 20, 1, "no_load_balance", 1))
    opcheck(torch.ops.cpcompile.cp_head_plan.default, (cu, None, 16, 1, "dual_chunk_swap", 1))


def test_opcheck_cp_head_attention(single_rank_group):
    cu, cu_p, q, k, v, _ = attention_case([3, 9, 4], padded_lengths=[4, 10, 6])
    gather_index, cu_q, k_start, k_len_causal, k_len_full = _plan(cu, cu_p, q.shape[0])
    for causal, k_len in ((True, k_len_causal), (False, k_len_full)):
        plan = (gather_index, cu_q, k_start, k_len)
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *plan)
        opcheck(
            torch.ops.cpcompile.cp_head_attention.default, (*args, single_rank_group.group_name, causal, None, 10, None)
        )


def test_cp_head_attention_on_one_rank_is_packed_attention(single_rank_group):
    cu, cu_p, q, k, v, dout = attention_case([3, 9, 0, 4], padded_lengths=[4, 10, 0, 6], dtype=torch.float64)
    for causal in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = cpcompile.packed_attention(*leaves, cu, cu_seqlens_padded=cu_p, causal=causal)
        want_grads = torch.autograd.grad(want, leaves, dout)
        gather_index, cu_q, k_start, *k_lens = _plan(cu, cu_p, q.shape[0])
        plan = (gather_index, cu_q, k_start, k_lens[0 if causal else 1])
        got, _ = torch.ops.cpcompile.cp_head_attention(
            *leaves, *plan, single_rank_group.group_name, causal, None, 10, None
        )
        got_grads = torch.autograd.grad(got, leaves, dout)
        assert torch.equal(got, want)
        for a, b in zip(got_grads, want_grads):
            assert torch.equal(a, b)

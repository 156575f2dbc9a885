"""The head-parallel ops on one rank: ``opcheck``, and single-device attention's answer.

On a one-process group the all-to-alls are identities and the plan's order is physical, so
``cp_head_attention`` must be ``packed_attention`` exactly. Real ranks: ``tests/attention/test_heads.py``.
"""

from __future__ import annotations

import torch
from torch.library import opcheck

import cpcompile
from cpcompile import kernels
from cpcompile.attention import heads  # noqa: F401  (registers the ops)
from tests.fixtures import attention_case


def _plan(cu, cu_p, tokens):
    """The head plan op's pieces: ``(gather_index, cu_q, k_start, k_len_causal, k_len_full)``."""
    return torch.ops.cpcompile.cp_head_plan(cu, cu_p, tokens, 1, "dual_chunk_swap", 1)[:5]


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


def test_cp_head_attention_on_one_rank_is_packed_attention_on_the_real_tokens(single_rank_group):
    """The op runs the documents' real tokens back to back: ``packed_attention`` on the unpadded pack,
    bit for bit, and zero output and gradients at the padding."""
    cu, cu_p, q, k, v, dout = attention_case([3, 9, 0, 4], padded_lengths=[4, 10, 0, 6], dtype=torch.float64)
    real = torch.cat([torch.arange(int(cu_p[d]), int(cu_p[d]) + int(n)) for d, n in enumerate(cu.diff())])
    pad = torch.ones(q.shape[0], dtype=torch.bool).index_fill_(0, real, False)
    for causal in (True, False):
        leaves = [t[real].clone().requires_grad_() for t in (q, k, v)]
        want = cpcompile.packed_attention(*leaves, cu, causal=causal)
        want_grads = torch.autograd.grad(want, leaves, dout[real])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        gather_index, cu_q, k_start, *k_lens = _plan(cu, cu_p, q.shape[0])
        plan = (gather_index, cu_q, k_start, k_lens[0 if causal else 1])
        got, lse = torch.ops.cpcompile.cp_head_attention(
            *leaves, *plan, single_rank_group.group_name, causal, None, 10, None
        )
        got_grads = torch.autograd.grad(got, leaves, dout)
        for a, b in zip([got, *got_grads], [want, *want_grads]):
            assert torch.equal(a[real], b) and not a[pad].any()
        assert bool(lse[:, pad].eq(float("-inf")).all())


def test_the_kernel_runs_whole_documents_on_disjoint_keys(single_rank_group, monkeypatch):
    """Pure head parallelism hands the kernel ``disjoint_keys=True`` pieces, forward and backward:
    each document reads the keys at its own rows (what FA4's backward needs; the GPU kernels then
    copy no key), padding included in the pack but not in the call."""
    cu, cu_p, q, k, v, dout = attention_case([3, 9, 0, 4], padded_lengths=[4, 10, 0, 6])
    seen = []

    class Recording:
        def forward(self, q, k, v, pieces, **kw):
            seen.append((q.shape[0], pieces))
            return kernels.reference.forward(q, k, v, pieces, **kw)

        def backward(self, dout, q, k, v, out, lse, pieces, **kw):
            seen.append((q.shape[0], pieces))
            return kernels.reference.backward(dout, q, k, v, out, lse, pieces, **kw)

    monkeypatch.setattr(kernels, "select", lambda *args, **kw: Recording())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    gather_index, cu_q, k_start, k_len, _ = _plan(cu, cu_p, q.shape[0])
    out, _ = torch.ops.cpcompile.cp_head_attention(
        *leaves, gather_index, cu_q, k_start, k_len, single_rank_group.group_name, True, None, 10, None
    )
    out.backward(dout)
    assert len(seen) == 2
    for rows, pieces in seen:
        assert pieces.disjoint_keys and rows == int(cu[-1])
        assert pieces.cu_q.tolist() == [0, 3, 12, 16]  # the empty document has no piece
        assert torch.equal(pieces.k_start, pieces.cu_q[:-1]) and torch.equal(pieces.k_len, pieces.cu_q.diff())

"""Tiers 1-2: packed_attention against float64 per-document attention; opcheck on both ops;
argument errors before any work."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import cpcompile
from tests.reference import attention_fp64, relative_error


def _case(lengths, hq=4, hkv=2, d=8, padded_lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_p = (
        None
        if padded_lengths is None
        else torch.tensor([0, *torch.tensor(padded_lengths).cumsum(0).tolist()], dtype=torch.int32)
    )
    n = sum(padded_lengths or lengths)
    return cu, cu_p, *(torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv, hq))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_attention_matches_fp64(causal, heads, padded):
    lengths = [1, 17, 6, 30]
    cu, cu_p, q, k, v, dout = _case(lengths, *heads, padded_lengths=[4, 20, 6, 33] if padded else None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cpcompile.packed_attention(*leaves, cu, cu_seqlens_padded=cu_p, causal=causal, scale=0.3)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_fp64(*ref_leaves, cu, causal=causal, cu_seqlens_padded=cu_p, scale=0.3)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    assert relative_error(out, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 1e-5
    if padded:  # padding rows: zero output and zero gradient
        pad = torch.ones(q.shape[0], dtype=torch.bool)
        pad[cpcompile.batch.physical_positions(cu, cu_p)] = False
        assert out[pad].abs().max() == 0 and grads[0][pad].abs().max() == 0 and grads[1][pad].abs().max() == 0


def test_opcheck_packed_attention():
    cu, cu_p, q, k, v, _ = _case([3, 9, 4], padded_lengths=[4, 10, 6])
    for causal in (True, False):
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu_p, 10, causal, None)
        opcheck(torch.ops.cpcompile.packed_attention.default, args)


def test_opcheck_cp_attention(single_rank_group):
    cu, _, q, k, v, _ = _case([3, 9, 4])
    plan = cpcompile.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    for causal in (True, False):
        args = (
            q.requires_grad_(),
            k.requires_grad_(),
            v.requires_grad_(),
            plan.gather_index,
            plan.cu_q,
            plan.k_start,
            plan.k_len(causal),
            single_rank_group.group_name,
            causal,
            None,
            9,
            9,
        )
        opcheck(torch.ops.cpcompile.cp_attention.default, args)


def test_cp_attention_on_one_rank_is_packed_attention(single_rank_group):
    cu, _, q, k, v, _ = _case([3, 9, 4])
    want = cpcompile.packed_attention(q, k, v, cu)
    got = cpcompile.cp_attention(q, k, v, cu, strategy="no_load_balance")
    assert torch.allclose(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
        (lambda a: {**a, "k": a["k"][:5]}, ValueError, "k and v must have the same shape"),
        (lambda a: {**a, "q": a["q"][0]}, ValueError, r"q must be \[tokens, heads, head_dim\]"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, ValueError, "cu_seqlens must have dtype torch.int32"),
        (
            lambda a: {**a, "cu_seqlens": torch.tensor([0, 9, 3, 16], dtype=torch.int32)},
            ValueError,
            "cu_seqlens must be non-decreasing",
        ),
        (
            lambda a: {**a, "cu_seqlens": torch.tensor([0, 3, 15], dtype=torch.int32)},
            ValueError,
            r"cu_seqlens\[-1\] = 15 must equal the number of tokens in q \(16\)",
        ),
        (lambda a: {**a, "q": a["q"].int()}, ValueError, "q must be a floating-point tensor"),
        (
            lambda a: {**a, "cu_seqlens": a["cu_seqlens"].to("meta")},
            ValueError,
            r"cu_seqlens must be on the device of q \(cpu\), got meta",
        ),
    ],
)
def test_packed_attention_rejects_bad_arguments(mutate, error, message):
    cu, _, q, k, v, _ = _case([3, 9, 4])
    args = mutate({"q": q, "k": k, "v": v, "cu_seqlens": cu})
    with pytest.raises(error, match=message):
        cpcompile.packed_attention(args["q"], args["k"], args["v"], args["cu_seqlens"])


def test_cp_attention_rejects_bad_arguments(single_rank_group):
    cu, _, q, k, v, _ = _case([3, 9, 4])
    with pytest.raises(ValueError, match="comm must be one of"):
        cpcompile.cp_attention(q, k, v, cu, comm="p2p")
    with pytest.raises(ValueError, match="strategy must be one of"):
        cpcompile.cp_attention(q, k, v, cu, strategy="zigzag")
    padded = torch.tensor([0, 4, 14, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_padded gives a document fewer tokens"):
        cpcompile.cp_attention(q, k, v, cu, cu_seqlens_padded=padded, strategy="no_load_balance")
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must be on the device of q \(cpu\), got meta"):
        cpcompile.cp_attention(q, k, v, cu, cu_seqlens_padded=padded.to("meta"), strategy="no_load_balance")


def test_kv_chunks_setting(monkeypatch):
    from cpcompile.ops.gathered import kv_chunks

    assert kv_chunks(8) == 1  # default: one gather each of K and V, one kernel call
    for want, heads, got in ((4, 8, 4), (3, 8, 2), (16, 4, 4), (2, 1, 1)):
        monkeypatch.setenv("CPCOMPILE_KV_CHUNKS", str(want))
        assert kv_chunks(heads) == got
    monkeypatch.setenv("CPCOMPILE_KV_CHUNKS", "0")
    with pytest.raises(ValueError, match="CPCOMPILE_KV_CHUNKS must be a positive int, got 0"):
        kv_chunks(8)


def test_exchange_rule():
    """The sparse exchange is used when the busiest rank's rows sent or received are at most
    EXCHANGE_AT of an all-gather's; counts[r][s]: rows rank r reads from rank s."""
    from cpcompile.ops.exchange import EXCHANGE_AT, use_exchange

    assert EXCHANGE_AT == 0.75
    assert use_exchange([[10, 7], [0, 10]], 10)  # rank 0 receives 7 of 10
    assert not use_exchange([[10, 8], [0, 10]], 10)  # 8 > 7.5
    # cp=3, all-gather brings 2 x 10 rows: rank 2 sends 8 + 8 > 15, though no rank receives more than 8
    assert not use_exchange([[10, 0, 8], [0, 10, 8], [0, 0, 10]], 10)
    assert use_exchange([[10, 0, 7], [0, 10, 8], [0, 0, 10]], 10)
    assert use_exchange([[10, 10], [10, 10]], 10, "always") and not use_exchange([[10, 0], [0, 10]], 10, "never")


def test_exchange_sums_take_own_rows_then_senders_in_rank_order():
    """Each local row's gradient parts, by layer: its own compact sum, then each sender's
    returned one in rank order (a fixed order: deterministic sums)."""
    from cpcompile.ops.exchange import _sum_layers

    # 5 local rows; the rank reads rows 0 and 3 itself (compact rows 2 and 0); 4 compact keys;
    # rank 0 returns rows 3, 4 and rank 2 returns row 3 (rank 1, this one, and rank 3 send none)
    own_rows, own_compact = torch.tensor([0, 3]), torch.tensor([2, 0])
    send_rows, send_counts = torch.tensor([3, 4, 3]), [2, 0, 1, 0]
    spare = 4 + 3
    want = torch.tensor(
        [
            [2, spare, spare, 0, spare],  # own
            [spare, spare, spare, 4, 5],  # rank 0's, returned at rows 4 and 5
            [spare, spare, spare, 6, spare],  # rank 2's, at row 6
        ]
    )
    assert torch.equal(_sum_layers(own_rows, own_compact, send_rows, send_counts, 4, 5), want)


def test_exchange_setting_is_checked(single_rank_group, monkeypatch):
    cu, _, q, k, v, _ = _case([3, 9, 4])
    monkeypatch.setenv("CPCOMPILE_KV_EXCHANGE", "sometimes")
    with pytest.raises(ValueError, match=r"CPCOMPILE_KV_EXCHANGE must be one of .* got \['\(not one of them\)'\]"):
        cpcompile.cp_attention(q, k, v, cu, strategy="no_load_balance")


def test_grad_buffers_are_zeroed_once_per_plan():
    """The backward's dK/dV buffers: zero for new pieces (plan or mask) or head grouping; for
    the same ones, what the last layer's kernel wrote stays (each layer rewrites the same rows)."""
    from cpcompile.ops.gathered import grad_buffers

    k = torch.empty(4, 2, 3)
    plan = torch.arange(8)
    cu_q, k_start, causal, full = torch.tensor([0, 4]), torch.tensor([0]), torch.tensor([4]), torch.tensor([8])
    dk, dv = grad_buffers(plan, (cu_q, k_start, causal), k, 1)
    assert dk.shape == dv.shape == (1, 8, 2, 3) and not dk.any() and not dv.any()
    dk.fill_(1)
    dv.fill_(2)
    again = grad_buffers(plan, (cu_q, k_start, causal), k, 1)
    assert (again[0] == 1).all() and (again[1] == 2).all()
    dk, dv = grad_buffers(plan, (cu_q, k_start, full), k, 1)  # the same plan, another mask
    assert not dk.any() and not dv.any()
    dk.fill_(1)
    dv.fill_(2)
    for changed in (torch.arange(8), torch.arange(12)):  # a new plan: zeroed, grown to its T
        dk, dv = grad_buffers(changed, (cu_q, k_start, full), k, 1)
        assert dk.shape == (1, changed.shape[0], 2, 3) and not dk.any() and not dv.any()
        dk.fill_(1)
    dk, _ = grad_buffers(changed[:], (cu_q, k_start, full), k, 2)  # two head groups; a view of the plan is the plan
    assert dk.shape == (2, 12, 1, 3) and not dk.any()
    dk.fill_(1)
    assert (grad_buffers(changed[:], (cu_q, k_start, full), k, 2)[0] == 1).all()
    changed.add_(0)  # changed in place: a new plan too
    dk, _ = grad_buffers(changed, (cu_q, k_start, full), k, 2)
    assert not dk.any()
    dk.fill_(1)
    cpcompile.release_grad_buffers()
    assert not grad_buffers(changed, (cu_q, k_start, full), k, 2)[0].any()

"""The split all-gather ops (``attention.split``, ``overlap_kv``) under opcheck on one rank, whose
collectives are identities, and against single-device attention there."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import cpcompile
from cpcompile.plan.window import window_keys
from tests.fixtures import attention_case

WINDOWS = [(-1, 0), (-1, -1), (3, 0), (2, 1)]


def _split_args(q, k, v, cu, window, group_name):
    """``cp_attention_split``'s arguments on one rank: the gathered K/V are K/V themselves."""
    plan = cpcompile.plan.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    k_start, k_len, q_pos = window_keys(*plan.pieces, window)
    causal = window[1] == 0
    args = (q, k, v, k.detach(), v.detach(), plan.gather_index, plan.cu_q, k_start, k_len, group_name, causal, None)
    return (*args, 9, 9, None, None if causal else q_pos, *window)


@pytest.mark.parametrize("window", WINDOWS)
def test_opcheck_split_op(single_rank_group, window):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    args = _split_args(*leaves, cu, window, single_rank_group.group_name)
    opcheck(torch.ops.cpcompile.cp_attention_split.default, args)


@pytest.mark.parametrize("frozen", ["", "k", "kv"])
@pytest.mark.parametrize("window", WINDOWS)
def test_split_on_one_rank_is_packed_attention(single_rank_group, window, frozen):
    """``frozen``: the inputs that need no gradient (LoRA on Q alone): their sums are not reduce-scattered."""
    cu, _, q, k, v, dout = attention_case([3, 9, 4], dtype=torch.float64)
    leaves = [t.clone().requires_grad_(name not in frozen) for name, t in zip("qkv", (q, k, v))]
    trained = [t for t in leaves if t.requires_grad]
    want = cpcompile.packed_attention(*leaves, cu, window_size=window, causal=window[1] == 0)
    want_grads = torch.autograd.grad(want, trained, dout)
    got = torch.ops.cpcompile.cp_attention_split(*_split_args(*leaves, cu, window, single_rank_group.group_name))[0]
    for a, b in zip((got, *torch.autograd.grad(got, trained, dout)), (want, *want_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _exchange_args(q, k, v, cu, window, group_name, kv):
    """``cp_attention_exchange``'s arguments on one rank (``kv``: ``"always"``, the exchange's reading, or
    ``"never"``, the all-gather's): what the fetch brings is K/V themselves."""
    plan = cpcompile.plan.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    k_start, k_len, q_pos = window_keys(*plan.pieces, window)
    causal = window[1] == 0
    args = (q, k, v, k.detach(), v.detach(), plan.gather_index, plan.cu_q, k_start, k_len, group_name, causal, None)
    return (*args, 9, 9, None, kv, None if causal else q_pos, *window, plan.cu_seqlens, plan.cu_seqlens_padded)


@pytest.mark.parametrize("kv", ["always", "never"])
@pytest.mark.parametrize("window", [(-1, 0), (2, 1)])
def test_opcheck_exchange_op(single_rank_group, window, kv):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    args = _exchange_args(*leaves, cu, window, single_rank_group.group_name, kv)
    opcheck(torch.ops.cpcompile.cp_attention_exchange.default, args)


@pytest.mark.parametrize("frozen", ["", "k"])
@pytest.mark.parametrize("kv", ["always", "never"])
@pytest.mark.parametrize("window", WINDOWS)
def test_exchange_op_on_one_rank_is_packed_attention(single_rank_group, window, kv, frozen):
    """The exchange's nodes (``attention.split_exchange``) called eagerly: the backward's fetch, returns
    and adds (the returns' work waited for through ``wait_tensor``) give packed attention's gradients."""
    cu, _, q, k, v, dout = attention_case([3, 9, 4], dtype=torch.float64)
    leaves = [t.clone().requires_grad_(name not in frozen) for name, t in zip("qkv", (q, k, v))]
    trained = [t for t in leaves if t.requires_grad]
    want = cpcompile.packed_attention(*leaves, cu, window_size=window, causal=window[1] == 0)
    want_grads = torch.autograd.grad(want, trained, dout)
    args = _exchange_args(*leaves, cu, window, single_rank_group.group_name, kv)
    got = torch.ops.cpcompile.cp_attention_exchange(*args)[0]
    for a, b in zip((got, *torch.autograd.grad(got, trained, dout)), (want, *want_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_overlap_kv_refuses_what_it_cannot_split():
    """The strategy in force when a CP graph is compiled (the backend checks it there) must move K and V
    in one transfer each: the all-gather or the exchange (``attention.split_exchange``), not head groups."""
    from cpcompile.compiler.backend import _check_overlap

    with pytest.raises(ValueError, match="one transfer each, but the strategy has kv_chunks=2"):
        _check_overlap(cpcompile.StrategySpec(kv_chunks=2))
    for kv in ("exchange", "auto", "all_gather", "ring"):  # the ring is left as it is
        _check_overlap(cpcompile.StrategySpec(kv=kv))
    with pytest.raises(TypeError, match="overlap_kv must be a bool, got 'yes'"):
        cpcompile.backend(overlap_kv="yes")


def test_overlap_kv_refuses_cuda_graphs(single_rank_group):
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match="overlap_kv=True is not supported with CUDA graphs"):
        cpcompile.backend(overlap_kv=True)(gm, [torch.zeros(1)], mode="reduce-overhead")


def test_the_split_fake_checks_the_gathered_values_and_devices(single_rank_group):
    """What a compiled graph's shapes and devices are checked against: the gathered V's head dim, and
    ``q_pos`` and ``sinks`` on q's device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    args = list(_split_args(q, k, v, cu, (2, 1), single_rank_group.group_name))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        op = torch.ops.cpcompile.cp_attention_split
        wide = list(fake)
        wide[4] = torch.empty(v.shape[0], v.shape[1], v.shape[2] + 4)
        with pytest.raises(RuntimeError, match=r"gathered v .* must have v's head dim \(8\)"):
            op(*wide)
        elsewhere = list(fake)
        elsewhere[15] = fake[15].to("meta")
        with pytest.raises(ValueError, match=r"q_pos must be on the device of q \(cpu\), got meta"):
            op(*elsewhere)
        with pytest.raises(ValueError, match=r"sinks must be on the device of q \(cpu\), got meta"):
            op(*fake, sinks=torch.zeros(q.shape[1], device="meta"))
        assert op(*fake, sinks=torch.zeros(q.shape[1]))[0].shape == q.shape

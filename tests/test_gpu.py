"""Tier 5 (CUDA only, skipped elsewhere): the flash kernel path in bf16 against float64.

The rule of the flash-attention tests: our error against a float64 reference must
be at most twice the error of the single-GPU kernel (torch's own varlen attention)
against the same reference, and never above 2.5e-2.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.ops.kernels import flash
from cpcompile.plan import max_piece_len
from cpcompile.strategy import resolve_strategy
from examples.packed_gpt import VARLEN_GQA
from tests.reference import attention_fp64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(lengths, hq=8, hkv=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = sum(lengths)
    return cu, *(torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq))


def _err(a, b):
    return (a.double() - b).abs().max().item()


def _reference(q, k, v, dout, cu, causal):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = attention_fp64(*leaves, cu.cpu(), causal=causal)
    return out, torch.autograd.grad(out, leaves, dout.double())


def _torch_varlen(q, k, v, dout, cu, causal):
    """The single-GPU baseline: torch's flash varlen kernel, forward and backward."""
    from torch.nn.attention.varlen import varlen_attn

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    m = int((cu[1:] - cu[:-1]).max())
    out = varlen_attn(*leaves, cu, cu, m, m, window_size=(-1, 0) if causal else (-1, -1), **VARLEN_GQA)
    return out, torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_bf16_within_twice_the_kernel_error(causal):
    cu, q, k, v, dout = _case([1, 700, 129, 2048, 64])
    ref, ref_grads = _reference(q, k, v, dout, cu, causal)
    base, base_grads = _torch_varlen(q, k, v, dout, cu, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cpcompile.packed_attention(*leaves, cu, causal=causal)
    grads = torch.autograd.grad(out, leaves, dout)
    for got, baseline, want in zip([out, *grads], [base, *base_grads], [ref, *ref_grads]):
        assert _err(got, want) <= max(2 * _err(baseline, want), 1e-3)
        assert _err(got, want) / want.abs().max().item() < 2.5e-2


@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance", "striped"])
@pytest.mark.parametrize("causal", [True, False])
def test_simulated_ranks_bf16(strategy, causal):
    """Each rank's pieces through the flash kernel, against K/V gathered by hand."""
    cp = 4
    lengths = [1, 700, 129, 2048, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded = cpcompile.pad_for_cp(cu, cp_size=cp, strategy=strategy)
    n = int(padded[-1])
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_fp64(*leaves, cu, causal=causal, cu_seqlens_padded=padded)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    base, base_grads = _torch_varlen_padded(q, k, v, dout, cu, padded, causal)

    out = torch.zeros_like(q)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    # the tight launch bound cp_attention uses: rows beyond it would be silently skipped
    bounds = {"max_seqlen_q": max_piece_len(resolve_strategy(strategy), cp, max(lengths)), "max_seqlen_k": max(lengths)}
    for rank in range(cp):
        plan = cpcompile.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=strategy)
        plan = cpcompile.AttentionPlan(*(t.cuda() for t in plan))
        idx = cpcompile.partition_indices(padded, cp_size=cp, rank=rank, strategy=strategy).cuda()
        args = (plan.cu_q, plan.k_start, plan.k_len(causal))
        o, lse = flash.forward(q[idx], k, v, *args, causal=causal, scale=128**-0.5, **bounds)
        out[idx] = o
        gq, gk, gv = flash.backward(dout[idx], q[idx], k, v, o, lse, *args, causal=causal, scale=128**-0.5, **bounds)
        dq[idx] = gq
        dk += gk
        dv += gv
    dk, dv = dk.to(k.dtype), dv.to(v.dtype)  # as cp_attention: float32 sum over ranks, one rounding
    for got, baseline, want in zip([out, dq, dk, dv], [base, *base_grads], [ref, *ref_grads]):
        assert _err(got, want) <= max(2 * _err(baseline, want), 1e-3)


def _torch_varlen_padded(q, k, v, dout, cu, padded, causal):
    """torch's kernel on the real tokens only, scattered back to the padded buffer."""
    real = cpcompile.batch.physical_positions(cu, padded).cuda()
    out, grads = _torch_varlen(q[real], k[real], v[real], dout[real], cu.cuda(), causal)
    full = [torch.zeros_like(t) for t in (q, q, k, v)]
    for f, t in zip(full, [out, *grads]):
        f[real] = t
    return full[0], full[1:]


def test_cp_attention_on_one_nccl_rank():
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cu, q, k, v, dout = _case([3, 300, 77])
        want = cpcompile.packed_attention(q, k, v, cu)
        got = cpcompile.cp_attention(q, k, v, cu, strategy="no_load_balance")
        assert torch.equal(got, want)
    finally:
        dist.destroy_process_group()

"""The GPU kernels with sliding windows, in bf16 against float64.

The rule of ``tests/kernels/test_accuracy.py``: our error against a float64 reference (dense window mask,
``tests.reference.window_mask``) at most twice that of torch's own varlen attention with the
same window on the whole pack, and never above 2.5e-2. Windows ``(w, 0)`` run on every GPU
kernel, single-device and over each rank's pieces (simulated ranks, K/V gathered by hand);
any window runs on whole documents; the rest must raise for a named kernel and fall back to
the reference kernel for the default.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import kernels
from cpcompile.kernels import Pieces, cudnn, fa4
from cpcompile.plan.window import window_keys
from cpcompile.testing import VARLEN_GQA
from tests.reference import attention_fp64

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GPU_KERNELS = [
    "flash",
    pytest.param("cudnn", marks=pytest.mark.skipif(not cudnn.available(), reason="needs cudnn-frontend")),
    pytest.param("fa4", marks=pytest.mark.skipif(not fa4.available(), reason="needs flash-attn-4")),
    pytest.param("auto", marks=pytest.mark.skipif(not cudnn.available(), reason="needs cudnn-frontend")),
]
LENGTHS = [1, 700, 129, 2048, 64]


def _inputs(n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(n, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2, 8)]


def _reference(q, k, v, dout, cu, window, padded=None):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = attention_fp64(*leaves, cu.cpu(), causal=False, window=window, cu_seqlens_padded=padded)
    return [out, *torch.autograd.grad(out, leaves, dout.double())]


def _baseline(q, k, v, dout, cu, window):
    """torch's varlen attention with the window, on the whole (unpadded) pack."""
    from torch.nn.attention.varlen import varlen_attn

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    m = int((cu[1:] - cu[:-1]).max())
    out = varlen_attn(*leaves, cu, cu, m, m, window_size=window, **VARLEN_GQA)
    return [out, *torch.autograd.grad(out, leaves, dout)]


def _check(got, base, want, label):
    for name, a, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        err, base_err = (a.double() - w).abs().max().item(), (b.double() - w).abs().max().item()
        assert err <= max(2 * base_err, 1e-3), f"{name} {label}: {err} against twice {base_err}"
        largest = w.abs().max().item()  # 0 for dQ under (0, 0): each query sees itself alone
        assert err <= 2.5e-2 * largest if largest else err <= 1e-3, f"{name} {label}"


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("window", [(256, 0), (100, 100), (0, 0)])
def test_packed_attention_windows_bf16(window, kernel):
    """Whole documents: any window (the kernels' bottom-right alignment is the document's)."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs(sum(LENGTHS))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cpcompile.packed_attention(*leaves, cu, causal=False, window_size=window, kernel=kernel)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    _check(got, _baseline(q, k, v, dout, cu, window), _reference(q, k, v, dout, cu, window), f"{kernel} {window}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance", "striped", "balanced"])
def test_simulated_ranks_sliding_window_bf16(strategy, kernel):
    """Each rank's windowed pieces (``window_keys``) through the kernel, against K/V gathered by hand."""
    window, cp = (300, 0), 4
    kern = kernels.select(torch.empty(0, device="cuda", dtype=torch.bfloat16), kernel)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=strategy)
    q, k, v, dout = _inputs(int(padded[-1]), seed=1)
    got = [torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k, dtype=torch.float32)]
    got.append(torch.zeros_like(got[-1]))
    kw = {"causal": True, "scale": 128**-0.5, "window": window}
    for rank in range(cp):
        plan = cpcompile.plan.AttentionPlan(
            *(t.cuda() for t in cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=strategy))
        )
        idx = cpcompile.layouts.partition_indices(padded, cp_size=cp, rank=rank, strategy=strategy).cuda()
        k_start, k_len, _ = window_keys(*plan.pieces, window)  # right = 0: bottom-right, no positions
        pieces = Pieces(plan.cu_q, k_start, k_len)
        o, lse = kern.forward(q[idx], k, v, pieces, **kw)
        gq, gk, gv = kern.backward(dout[idx], q[idx], k, v, o, lse, pieces, **kw)
        got[0][idx], got[1][idx] = o, gq
        got[2] += gk.float()
        got[3] += gv.float()
    phys = cpcompile.batch.physical_positions(cu, padded).cuda()
    want = [t[phys] for t in _reference(q, k, v, dout, cu, window, padded)]
    base = _baseline(*(t[phys] for t in (q, k, v, dout)), cu.cuda(), window)
    _check([t[phys] for t in got], base, want, f"{kernel} {strategy}")


def test_windows_no_gpu_kernel_runs():
    """Keys past the query on pieces of documents (or a ring step): a named GPU kernel raises, the default
    runs the reference kernel, with a warning."""
    cu = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
    padded = torch.tensor([0, 48], dtype=torch.int32, device="cuda")
    q, k, v, _ = _inputs(48)
    for kernel in ("flash", "cudnn", "fa4", "auto"):
        if kernel != "flash" and not (cudnn.available() if kernel != "fa4" else fa4.supports(q)):
            continue
        with pytest.raises(ValueError, match=r"cannot run window_size=\(2, 2\) on pieces of documents"):
            cpcompile.packed_attention(
                q, k, v, cu, cu_seqlens_padded=padded, causal=False, window_size=(2, 2),
                kernel=kernel,
            )  # fmt: skip
    with pytest.warns(UserWarning, match="the exact reference kernel runs it"):
        out = cpcompile.packed_attention(q, k, v, cu, cu_seqlens_padded=padded, causal=False, window_size=(2, 2))
    want = attention_fp64(q, k, v, cu.cpu(), causal=False, window=(2, 2), cu_seqlens_padded=padded.cpu())
    assert (out.double() - want).abs().max().item() < 2.5e-2 * want.abs().max().item()

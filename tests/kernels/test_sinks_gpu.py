"""Learnable sinks on the GPU with FA4, in bf16: the kernel's ordinary attention and the sink applied after it
(``attention.sinks``), against float64 attention whose softmax has the sink's column, and against FA4's own
``learnable_sink=`` where its forward takes one. The rule of ``tests/kernels/test_accuracy.py``: within twice
the error of the single-GPU baseline (FA4 with its native sink; FA4 without sinks for the gradients, which
its native sink does not give in every release) and never above 2.5e-2 relative.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import cpcompile
from cpcompile.kernels import fa4
from tests.reference import attention_fp64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not fa4.available(), reason="needs flash-attn-4"),
]
LENGTHS = [1, 700, 129, 2048, 64]
FA4 = {"kernel": "fa4"}


def _case(lengths, hq=8, hkv=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = sum(lengths)
    q, k, v, dout = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq))
    sinks = torch.randn(hq, device="cuda", dtype=torch.float32, generator=g) * 2
    return cu, q, k, v, dout, sinks


def _err(a, b):
    return (a.double() - b).abs().max().item()


def _reference(q, k, v, dout, cu, sinks, window):
    leaves = [t.double().requires_grad_() for t in (q, k, v, *([] if sinks is None else [sinks]))]
    out = attention_fp64(*leaves[:3], cu.cpu(), causal=False, window=window, sinks=(leaves[3:] or [None])[0])
    return [out, *torch.autograd.grad(out, leaves, dout.double())]


def _native_forward(q, k, v, cu, sinks, window):
    """FA4's own forward with ``learnable_sink`` (None where this release's forward takes none)."""
    forward = fa4._interface()._flash_attn_fwd
    if "learnable_sink" not in inspect.signature(forward).parameters:
        return None
    m = int((cu[1:] - cu[:-1]).max())
    kw = fa4._keywords(cu, cu, m, m, window[1] == 0 and window[0] < 0, q.shape[-1] ** -0.5, window, softcap=0.0)
    out, *_ = forward(q, k, v, learnable_sink=sinks, **kw)
    return out


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (256, 0)])
def test_packed_attention_with_sinks_fa4_bf16(window):
    if window[0] >= 0 and not fa4.supports_window():
        pytest.skip("this FA4 takes no window in its backward")
    cu, q, k, v, dout, sinks = _case(LENGTHS)
    want = _reference(q, k, v, dout, cu, sinks, window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    mask = {"causal": window[1] == 0, "window_size": window}
    out = cpcompile.packed_attention(*leaves[:3], cu, sinks=leaves[3], **FA4, **mask)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    base_out = cpcompile.packed_attention(*plain, cu, **FA4, **mask)
    base = [base_out, *torch.autograd.grad(base_out, plain, dout)]
    plain_want = _reference(q, k, v, dout, cu, None, window)
    native = _native_forward(q, k, v, cu, sinks, window)
    # FA4's own forward with sinks: its error bounds ours (packed_attention hands FA4 the sinks). On the
    # non-causal case of the H100 run it is 2.6 times that of the same call without sinks, so the
    # sink-free error bounds the output only where this FA4 has no sink forward to compare with.
    own = None if native is None else _err(native, want[0])
    if own is not None:
        assert _err(out, want[0]) <= max(2 * own, 1e-3), f"out against FA4's own sink, {window}"
    for name, a, b, base_a, base_b in zip(("out", "dq", "dk", "dv"), got, want, base, plain_want):
        bound = 2 * max(_err(base_a, base_b), own if name == "out" and own is not None else 0.0)
        assert _err(a, b) <= max(bound, 1e-3), f"{name} {window}"
        assert _err(a, b) <= 2.5e-2 * b.abs().max().item(), f"{name} {window}"
    assert _err(got[4], want[4]) <= 2.5e-2 * want[4].abs().max().item(), f"dsinks {window}"


def test_cp_attention_with_sinks_on_one_nccl_rank():
    """The all-gather, exchange and ring paths through NCCL (cp=1) with sinks: each equals packed_attention's."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cu, q, k, v, dout, sinks = _case([3, 300, 77])
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = cpcompile.packed_attention(*leaves[:3], cu, sinks=leaves[3], **FA4)
        want = [out, *torch.autograd.grad(out, leaves, dout)]
        for kv in ("all_gather", "exchange", "ring"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            spec = cpcompile.StrategySpec("no_load_balance", kv=kv, kernel="fa4")
            out = cpcompile.cp_attention(*leaves[:3], cu, strategy=spec, sinks=leaves[3])
            got = [out, *torch.autograd.grad(out, leaves, dout)]
            for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
                assert (g.float() - w.float()).abs().max() <= 1e-2 * w.float().abs().max(), f"{name} {kv}"
    finally:
        dist.destroy_process_group()

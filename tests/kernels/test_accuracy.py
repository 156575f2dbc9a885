"""The GPU kernels (flash, cuDNN, auto) in bf16 against float64.

The rule of the flash-attention tests: our error against a float64 reference must
be at most twice the error of the single-GPU kernel against the same reference,
and never above 2.5e-2. The single-GPU kernel is torch's own varlen attention for
``packed_attention``; for a rank's pieces it is the same backend on the whole pack
(the error CP adds must stay within twice the kernel's own).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import cpcompile
from cpcompile import kernels
from cpcompile.attention.captured import LAYERS
from cpcompile.kernels import KeyGrads, Pieces, cudnn, fa4, flash
from cpcompile.plan import exchange
from cpcompile.plan.pieces import max_piece_len
from cpcompile.spec import resolve_strategy
from cpcompile.testing import VARLEN_GQA
from tests.reference import attention_fp64

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
_needs_cudnn = pytest.mark.skipif(not cudnn.available(), reason="needs cudnn-frontend")
_needs_fa4 = pytest.mark.skipif(not fa4.available(), reason="needs flash-attn-4")
GPU_KERNELS = [
    "flash",
    pytest.param("cudnn", marks=_needs_cudnn),
    pytest.param("fa4", marks=_needs_fa4),
    pytest.param("auto", marks=_needs_cudnn),
]


def _case(lengths, hq=8, hkv=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = sum(lengths)
    return cu, *(torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq))


def _same(a, b, kernel: str) -> bool:
    """Equal where the backend's backward is reproducible; FA4's adds partial gradients with
    atomics, so its runs differ in rounding: there, within the accumulation error's bound."""
    if kernel in ("flash", "cudnn") or (kernel == "auto" and not fa4.available()):
        return torch.equal(a, b)
    return (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item()


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


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_bf16_within_twice_the_kernel_error(causal, kernel):
    cu, q, k, v, dout = _case([1, 700, 129, 2048, 64])
    ref, ref_grads = _reference(q, k, v, dout, cu, causal)
    base, base_grads = _torch_varlen(q, k, v, dout, cu, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cpcompile.packed_attention(*leaves, cu, causal=causal, kernel=kernel)
    grads = torch.autograd.grad(out, leaves, dout)
    for got, baseline, want in zip([out, *grads], [base, *base_grads], [ref, *ref_grads]):
        assert _err(got, want) <= max(2 * _err(baseline, want), 1e-3)
        assert _err(got, want) / want.abs().max().item() < 2.5e-2


# Known defect: the GPU backends return each piece's dK/dV rounded to bf16 (no
# kernel writes float32 gradients), and balanced cuts the 2048-token document of
# this case into 6 causal pieces, so dV's sum carries ~1 ulp more than one rounding:
# 0.066 against twice the kernel's own 0.030 on the H200. Only that bound is expected
# to fail, strictly (a pass says the defect is gone); every other check still holds.
# Without GQA (FA4 only), dual_chunk_swap without a mask sums each key's dK from 8
# bf16 partials (2 chunks on each of 4 ranks read every key of the document): past
# twice FA4's whole-pack error on the H200, over the key copies and in place alike.
# (strategy, causal, K/V heads)
_BF16_PARTIALS = {("balanced", True, 2), ("dual_chunk_swap", False, 8)}
LAYOUT_CASES = [(s, c) for s in ("dual_chunk_swap", "no_load_balance", "striped", "balanced") for c in (True, False)]


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize(("strategy", "causal"), LAYOUT_CASES)
def test_simulated_ranks_bf16(strategy, causal, kernel):
    """Each rank's pieces through the kernel, against K/V gathered by hand."""
    _check_simulated_ranks(strategy, causal, kernel, kv_heads=2)


@_needs_fa4
@pytest.mark.parametrize(("strategy", "causal"), LAYOUT_CASES)
def test_simulated_ranks_bf16_fa4_without_gqa(strategy, causal):
    """As above with as many K/V heads as query heads: FA4's backward then writes dK/dV without
    float32 accumulators, and two layers of pieces run in place (``varlen.IN_PLACE_LAYERS``)."""
    _check_simulated_ranks(strategy, causal, "fa4", kv_heads=8)


@_needs_fa4
@pytest.mark.parametrize(("d", "dv", "softcap"), [(192, 128, 0.0), (128, 128, 2.0), (192, 128, 2.0)])
@pytest.mark.parametrize(("strategy", "causal"), [("dual_chunk_swap", True), ("striped", True), ("balanced", False)])
def test_simulated_ranks_bf16_fa4_variants(strategy, causal, d, dv, softcap):
    """FA4 on ranks' pieces with DeepSeek's multi-head latent attention head dims (192/128, without GQA as
    DeepSeek trains it: Hopper's FA4 backward refuses GQA there) and with Gemma 2's logit soft-capping (a
    cap the scores reach), against FA4 on the whole pack with the same variant: within twice its error
    against float64."""
    _check_simulated_ranks(strategy, causal, "fa4", kv_heads=2 if d == dv else 8, d=d, dv=dv, softcap=softcap)


@_needs_fa4
def test_fa4_refuses_what_its_backward_cannot_run():
    """Hopper's FA4 backward asserts equal head dims under GQA: selecting FA4 for it is an error that says
    so, before any kernel runs; without GQA the same head dims select FA4."""
    q = torch.empty(4, 8, 192, device="cuda", dtype=torch.bfloat16)
    v_gqa, v_mha = (torch.empty(4, h, 128, device="cuda", dtype=torch.bfloat16) for h in (2, 8))
    assert kernels.select(q, "fa4", v=v_mha) is fa4
    if torch.cuda.get_device_capability()[0] == 9:
        with pytest.raises(ValueError, match=r"kernel 'fa4' cannot run this call: on Hopper .* got 2 K/V heads"):
            kernels.select(q, "fa4", v=v_gqa)


def _check_simulated_ranks(strategy, causal, kernel, kv_heads, d=128, dv=128, softcap=0.0):
    name, kernel = kernel, kernels.select(torch.empty(0, device="cuda", dtype=torch.bfloat16), kernel)
    cp = 4
    lengths = [1, 700, 129, 2048, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=strategy)
    n = int(padded[-1])
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(n, 8, e, device="cuda", dtype=torch.bfloat16, generator=g) for e in (d, dv))
    k, v = (torch.randn(n, kv_heads, e, device="cuda", dtype=torch.bfloat16, generator=g) for e in (d, dv))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_fp64(*leaves, cu, causal=causal, cu_seqlens_padded=padded, softcap=softcap or None)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    base, base_grads = _whole_pack_padded(kernel, q, k, v, dout, cu, padded, causal, softcap)

    out = torch.zeros_like(dout)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    # the tight launch bound cp_attention uses: rows beyond it would be silently skipped
    bounds = {"max_q": max_piece_len(resolve_strategy(strategy), cp, max(lengths)), "max_k": max(lengths)}
    kw = {"causal": causal, "scale": d**-0.5, "softcap": softcap}
    for rank in range(cp):
        plan = cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=strategy)
        plan = cpcompile.plan.AttentionPlan(*(t.cuda() for t in plan))
        idx = cpcompile.layouts.partition_indices(padded, cp_size=cp, rank=rank, strategy=strategy).cuda()
        pieces = Pieces(plan.cu_q, plan.k_start, plan.k_len(causal), **bounds)
        _poison_allocator()
        o, lse = kernel.forward(q[idx], k, v, pieces, **kw)
        out[idx] = o
        _poison_allocator()
        gq, gk, gv = kernel.backward(dout[idx], q[idx], k, v, o, lse, pieces, **kw)
        # the same sums, written in another order of keys (the all-gather's, in cp_attention),
        # also into given buffers (0 where no piece reads a key, as cp_attention keeps them)
        order = torch.randperm(n, device="cuda", generator=g)
        _, ok, ov = kernel.backward(dout[idx], q[idx], k, v, o, lse, pieces, grads=KeyGrads(order), **kw)
        assert _same(ok, gk[order], name) and _same(ov, gv[order], name)
        into = KeyGrads(order, torch.zeros_like(gk), torch.zeros_like(gv))
        _, ok, ov = kernel.backward(dout[idx], q[idx], k, v, o, lse, pieces, grads=into, **kw)
        assert ok is into.dk and _same(ok, gk[order], name) and _same(ov, gv[order], name)
        layers = LAYERS.get(resolve_strategy(strategy).strategy)
        if name == "fa4" and layers is not None:  # the captured backward (ops.captured): per layer, in place
            lq, lk, lv = kernel.backward(
                dout[idx], q[idx], k, v, o, lse, pieces, grads=KeyGrads(order), layers=layers, **kw
            )
            assert _same(lk, gk[order], name) and _same(lv, gv[order], name)
            assert _err(lq, gq) <= 1e-2 * gq.abs().max().item()
        # the sparse exchange's call: the same pieces over only the keys they read
        read = exchange.reads(plan.gather_index, plan.k_start, plan.k_len(causal), cp)
        k_read, v_read = k[read.rows], v[read.rows]
        compact = Pieces(plan.cu_q, read.k_start, plan.k_len(causal), **bounds)
        oc, lc = kernel.forward(q[idx], k_read, v_read, compact, **kw)
        assert torch.equal(oc, o) and torch.equal(lc, lse)
        cq, ck, cv = kernel.backward(dout[idx], q[idx], k_read, v_read, o, lse, compact, pack_keys=n, **kw)
        assert _same(ck, gk[read.rows], name) and _same(cv, gv[read.rows], name)
        unread = torch.ones(n, dtype=torch.bool, device="cuda")
        unread[read.rows] = False
        assert not gk[unread].any() and not gv[unread].any()
        assert _err(cq, gq) <= 1e-2 * gq.abs().max().item()  # dQ's accumulation order may differ
        dq[idx] = gq
        dk += gk
        dv += gv
    dk, dv = dk.to(k.dtype), dv.to(v.dtype)  # as cp_attention: float32 sum over ranks, one rounding
    beyond = []  # the tensors past twice the whole-pack kernel's error
    for name, got, baseline, want in zip(
        ("out", "dq", "dk", "dv"), [out, dq, dk, dv], [base, *base_grads], [ref, *ref_grads]
    ):
        if _err(got, want) > max(2 * _err(baseline, want), 1e-3):
            beyond.append(name)
        # the baseline shares the kernel's code (scratch, add-back): TransformerEngine's bound as well
        assert _err(got, want) / want.abs().max().item() < 2.5e-2, name
    if (strategy, causal, kv_heads) in _BF16_PARTIALS and (beyond or name in ("flash", "cudnn")):
        assert beyond, "the known bf16 partial dK/dV defect no longer shows: drop _BF16_PARTIALS"
        pytest.xfail(f"bf16 partial dK/dV per piece (see _BF16_PARTIALS): {beyond} past twice the kernel's error")
    assert not beyond, f"{beyond} past twice the whole-pack kernel's error"


@_needs_cudnn
def test_cudnn_backward_in_row_chunks_within_twice_the_kernel_error(monkeypatch):
    """cuDNN's backward runs long causal pieces as row chunks (made small here), also
    for whole documents on one device: its gradients stay within twice the
    whole-document kernel's error against float64."""
    from cpcompile.kernels.metadata import chunks

    monkeypatch.setattr(chunks, "ROWS", 256)
    cu, q, k, v, dout = _case([2500, 1000, 40])
    _, ref_grads = _reference(q, k, v, dout, cu, True)
    n = cu[1:] - cu[:-1]
    bounds, kw = {"max_q": 2500, "max_k": 2500, "disjoint_keys": True}, {"causal": True, "scale": 128**-0.5}
    pieces = Pieces(cu, cu[:-1], n, **bounds)
    out, lse = cudnn.forward(q, k, v, pieces, **kw)
    monkeypatch.setattr(chunks, "MAX_CHUNKS", 1)  # whole documents
    whole = cudnn.backward(dout, q, k, v, out, lse, pieces, **kw)
    monkeypatch.setattr(chunks, "MAX_CHUNKS", 8)
    args = (cu.clone(), cu[:-1].clone(), n.clone())  # another plan: its chunks are made anew
    _poison_allocator()
    chunked = cudnn.backward(dout, q, k, v, out, lse, Pieces(*args, **bounds), **kw)
    _, scratch = cudnn.backward_pieces(*args, q.shape[0], k.shape[0], True)
    assert scratch.live.numel() == 8 + 4 + 1  # the chunks the backward ran
    for got, baseline, want in zip(chunked, whole, ref_grads):
        assert _err(got, want) <= max(2 * _err(baseline, want), 1e-3)
        assert _err(got, want) / want.abs().max().item() < 2.5e-2  # the baseline shares the add-back


@_needs_cudnn
def test_cudnn_backward_zeroes_dq_rows_no_chunk_writes():
    """A causal piece may read fewer keys than it has rows (the kernel contract, ``reference``):
    its first rows see none. Cut into row chunks, the first chunk then sees no key and is no
    entry of cuDNN's call; its dQ rows must still come back 0, not as the buffer held them."""
    cu, q, k, v, dout = _case([3000])
    cu_q, k_start, k_len = cu, cu[:1], torch.tensor([600], dtype=torch.int32, device="cuda")
    pieces, kw = Pieces(cu_q, k_start, k_len, max_q=3000, max_k=600), {"causal": True, "scale": 128**-0.5}
    out, lse = cudnn.forward(q, k, v, pieces, **kw)
    (chunk_cu, _, chunk_k_len), _ = cudnn.backward_pieces(cu_q, k_start, k_len, 3000, 3000, True)
    assert chunk_cu[:3].tolist() == [0, 1500, 3000] and chunk_k_len[:2].tolist() == [0, 600]
    _poison_allocator()
    dq, _, _ = cudnn.backward(dout, q, k, v, out, lse, pieces, **kw)
    assert (dq[:1500] == 0).all()


def _poison_allocator():
    """Leave NaN in the caching allocator's free memory, so that rows a kernel fails
    to write (padding pieces' outputs and gradients) show as NaN, not as lucky zeros."""
    torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed at once
    # buffers of at most 1 MiB come from the allocator's small pool: poison it too
    [torch.full((256 << 10,), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(128)]


def _whole_pack(kernel, q, k, v, dout, cu, causal, softcap=0.0):
    """``kernel`` on one device: the documents are the pieces (torch's varlen_attn for flash)."""
    if kernel is flash:
        return _torch_varlen(q, k, v, dout, cu, causal)
    n = cu[1:] - cu[:-1]
    pieces = Pieces(cu, cu[:-1], n, max_q=int(n.max()), max_k=int(n.max()), disjoint_keys=True)
    kw = {"causal": causal, "scale": q.shape[-1] ** -0.5, "softcap": softcap}
    out, lse = kernel.forward(q, k, v, pieces, **kw)
    return out, kernel.backward(dout, q, k, v, out, lse, pieces, **kw)


def _whole_pack_padded(kernel, q, k, v, dout, cu, padded, causal, softcap=0.0):
    """The whole-pack kernel on the real tokens only, scattered back to the padded buffer."""
    real = cpcompile.batch.physical_positions(cu, padded).cuda()
    out, grads = _whole_pack(kernel, q[real], k[real], v[real], dout[real], cu.cuda(), causal, softcap)
    full = [torch.zeros_like(t) for t in (dout, q, k, v)]
    for f, t in zip(full, [out, *grads]):
        f[real] = t.to(f.dtype)
    return full[0], full[1:]


@pytest.mark.parametrize("kv", ["all_gather", "exchange"])
def test_cp_attention_on_one_nccl_rank(kv):
    """Both K/V paths through NCCL (at cp=1: an all-gather, or an all-to-all of no rows)."""
    import torch.distributed as dist

    spec = cpcompile.StrategySpec("no_load_balance", kv=kv)

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cu, q, k, v, dout = _case([3, 300, 77])
        want = cpcompile.packed_attention(q, k, v, cu)
        got = cpcompile.cp_attention(q, k, v, cu, strategy=spec)
        assert torch.equal(got, want)
        # the backward (the all-gather path's through its kept dK/dV buffers), for two plans in turn
        for lengths in ([3, 300, 77], [150, 2, 200, 28]):
            cu, q, k, v, dout = _case(lengths, seed=len(lengths))
            k = k.transpose(0, 1).contiguous().transpose(0, 1)  # dense, not contiguous: the sums handle it
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            want = torch.autograd.grad(cpcompile.packed_attention(*leaves, cu), leaves, dout)
            got = cpcompile.cp_attention(*leaves, cu, strategy=spec)
            got = torch.autograd.grad(got, leaves, dout)
            for g, w in zip(got, want):
                assert (g.float() - w.float()).abs().max() <= 1e-2 * w.float().abs().max()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize(
    ("padded_lengths", "layout"), [([4, 302, 0, 80, 2], "dual_chunk_swap"), ([3, 300, 0, 77, 6], "no_load_balance")]
)
def test_head_parallel_rank_call_is_packed_attention(kernel, padded_lengths, layout):
    """Pure head parallelism's call between the all-to-alls (on one NCCL rank they are identities):
    whole documents on disjoint keys, so every kernel (FA4's backward included) runs it as exactly as it
    runs ``packed_attention`` on the real tokens (float64's error at most twice that; not bit for bit:
    the launch bound is the padded documents' longest, and kernels may tile by it), and the padding gets
    nothing. Padded per document (the real tokens gathered) and after them (read in place)."""
    import torch.distributed as dist

    from cpcompile.attention import heads  # registers the ops

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        lengths = [3, 300, 0, 77, 1]
        cu, *_ = _case(lengths)
        cu_p = torch.tensor([0, *torch.tensor(padded_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        _, q, k, v, dout = _case(padded_lengths, seed=1)
        real = cpcompile.batch.physical_positions(cu, cu_p)
        for causal in (True, False):
            ref, ref_grads = _reference(*(t[real] for t in (q, k, v, dout)), cu, causal)
            leaves = [t[real].clone().requires_grad_() for t in (q, k, v)]
            want = cpcompile.packed_attention(*leaves, cu, causal=causal, kernel=kernel)
            want_grads = torch.autograd.grad(want, leaves, dout[real])
            gather_index, cu_q, k_start, *k_lens = torch.ops.cpcompile.cp_head_plan(cu, cu_p, q.shape[0], 1, layout, 1)
            in_place = heads.documents(gather_index, k_start, k_lens[0]).in_place
            assert in_place == (layout == "no_load_balance")  # real tokens first: read where they are
            plan = (gather_index, cu_q, k_start, k_lens[0 if causal else 1])
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            got, _ = torch.ops.cpcompile.cp_head_attention(
                *leaves, *plan, dist.group.WORLD.group_name, causal, None, max(padded_lengths), kernel
            )
            got_grads = torch.autograd.grad(got, leaves, dout)
            for name, a, b, r in zip(
                ("out", "dq", "dk", "dv"), [got, *got_grads], [want, *want_grads], [ref, *ref_grads]
            ):
                assert _err(a[real], r) <= max(2 * _err(b, r), 1e-3), f"{name} {kernel} causal={causal}"
            pad = torch.ones(q.shape[0], dtype=torch.bool, device="cuda").index_fill_(0, real, False)
            assert not any(t[pad].any() for t in (got, *got_grads))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not cudnn.available(), reason="needs cudnn-frontend")
def test_cudnn_graphs_are_reused_across_pack_sizes():
    """Packs whose piece count and longest piece fall into the same buckets share one cached graph."""
    before = cudnn._forward_graph.cache_info().misses
    for lengths in ([300, 200, 100], [290, 250, 60], [5, 310, 285]):  # 3 pieces, longest in (288, 320]
        cu, q, k, v, _ = _case(lengths)
        n = cu[1:] - cu[:-1]
        pieces = Pieces(cu, cu[:-1], n, max_q=max(lengths), max_k=max(lengths))
        out, _ = cudnn.forward(q, k, v, pieces, causal=True, scale=0.1)
        want, _ = kernels.reference.forward(q, k, v, Pieces(cu, cu[:-1], n), causal=True, scale=0.1)
        assert (out.float() - want.float()).abs().max() < 2e-2
    assert cudnn._forward_graph.cache_info().misses - before == 1


@pytest.mark.skipif(not cudnn.available(), reason="needs cudnn-frontend")
def test_cudnn_reads_kv_halves_in_place():
    """K and V as halves of one ``[T, 2 Hkv, D]`` buffer (the ring's layout) give what contiguous ones give."""
    cu, q, k, v, dout = _case([300, 5, 700])
    kv = torch.cat([k, v], dim=1)
    k_view, v_view = kv.split(k.shape[1], dim=1)
    assert not k_view.is_contiguous()
    n = cu[1:] - cu[:-1]
    # overlapping, out-of-order key ranges: the scratch backward
    pieces = Pieces(cu, cu[:-1].flip(0), n.flip(0), max_q=700, max_k=700)
    kw = {"causal": True, "scale": 0.1}
    want_out, want_lse = cudnn.forward(q, k, v, pieces, **kw)
    got_out, got_lse = cudnn.forward(q, k_view, v_view, pieces, **kw)
    assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    (dq, dk, dv), (want_dq, want_dk, want_dv) = (
        cudnn.backward(dout, q, key, value, want_out, want_lse, pieces, **kw)
        for key, value in ((k_view, v_view), (k, v))
    )
    assert torch.equal(dk, want_dk) and torch.equal(dv, want_dv)
    # dQ is added atomically, so runs differ by summation order (views against contiguous K/V:
    # 1.9e-4 of the largest on the H200); TransformerEngine's bf16 bound catches a wrong stride
    err = (dq.float() - want_dq.float()).abs().max() / want_dq.float().abs().max()
    assert err < 2.5e-2


@pytest.mark.parametrize(("one_device", "causal"), [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_kernels_wait_for_the_gpu_once_per_plan(kernel, one_device, causal):
    """No host sync in the forward; in the backward one per plan (the scratch size), not per layer.

    A sync drains the stream, and the GPU then idles while the host queues the next
    work: per layer, that cost 0.6 ms of a 2.4 ms forward and 1.9 ms of an 11 ms
    backward per rank on the H200 at cp=8.
    """
    name, kernel = kernel, kernels.select(torch.empty(0, device="cuda", dtype=torch.bfloat16), kernel)
    cu, q, k, v, dout = _case([300, 5, 3000])
    n = cu[1:] - cu[:-1]
    if one_device:  # documents as pieces (causal: the longest cut into row chunks)
        args = (cu, cu[:-1].clone(), n)
    else:  # a fresh plan, with pieces in another order
        args = (cu, cu[:-1].flip(0), n.flip(0))
    bounds, kw = {"max_q": 3000, "max_k": 3000, "disjoint_keys": one_device}, {"causal": causal, "scale": 0.1}
    pieces = Pieces(*args, **bounds)
    warm = Pieces(*(a.clone() for a in args), **bounds)  # another plan: kernels that compile on first use do it here
    kernel.backward(dout, q, k, v, *kernel.forward(q, k, v, warm, **kw), warm, **kw)
    torch.cuda.synchronize()
    with _no_sync():
        out, lse = kernel.forward(q, k, v, pieces, **kw)
    first = kernel.backward(dout, q, k, v, out, lse, pieces, **kw)  # the plan's sync
    with _no_sync():  # the next layer
        out, lse = kernel.forward(q, k, v, pieces, **kw)
        again = kernel.backward(dout, q, k, v, out, lse, pieces, **kw)
    for a, b in zip(first[1:], again[1:]):  # reused metadata, same dK/dV
        assert _same(a, b, name)


@contextlib.contextmanager
def _no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("kv", ["all_gather", "exchange"])
@pytest.mark.parametrize("strategy", ["balanced", "dual_chunk_swap"])
def test_a_compiled_step_from_the_loader_never_waits_for_the_gpu(strategy, kv):
    """``shard_batch(device=...)`` uploads the pack with its host copy and makes the plan, so a
    compiled CP step (two layers, forward and backward, the kernels' scratch and the sparse
    exchange's plan included) makes no host sync. Rank 1 of 4 on the fake group, whose
    collectives return garbage (it fills an all-to-all's output with its input: these packs
    give rank 1 rows to send and to receive)."""
    import itertools

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cp, rank = 4, 1

    def two_layers(q, k, v, cu):
        out = cpcompile.packed_attention(q, k, v, cu)
        return cpcompile.packed_attention(out, k, v, cu)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        backend = cpcompile.backend()
        compiled = torch.compile(two_layers, backend=backend, dynamic=True)
        packs = ([3000, 5, 1200, 700], [1500, 1500, 1, 2000, 64], [4100, 7, 900])
        for i, lengths in enumerate(packs):
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            gen = torch.Generator().manual_seed(i)
            qkv = {name: torch.randn(int(cu[-1]), h, 128, generator=gen) for name, h in (("q", 8), ("k", 2), ("v", 2))}
            batch = cpcompile.shard_batch(
                qkv, cu, cp_size=cp, rank=rank, strategy=cpcompile.StrategySpec(strategy, kv=kv), device="cuda"
            )
            q, k, v = (batch.tensors[n].to(torch.bfloat16).requires_grad_() for n in "qkv")
            torch.cuda.synchronize()
            with _no_sync() if i == len(packs) - 1 else contextlib.nullcontext(), cpcompile.strategy(batch):
                compiled(q, k, v, batch.cu_seqlens).sum().backward()
            assert all(t.grad is not None for t in (q, k, v))  # the fake group's garbage: no values to compare
    finally:
        dist.destroy_process_group()

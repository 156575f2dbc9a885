"""Ring plans against brute force, and every rank's ring computed in one process
(K/V blocks passed by hand, partial results merged) against the float64 single-device result."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpcompile
from cpcompile.attention.ring import merge
from cpcompile.kernels import Pieces, reference
from cpcompile.plan.ring import make_ring_plan
from tests.fixtures import LAYOUT_SPECS as SPECS
from tests.fixtures import cu_seqlens, pack_lengths_st
from tests.reference import attention_fp64, relative_error


def _visible_brute_force(layout: list[list[int]], rank: int, src: int, starts, real_lengths, causal: bool):
    """For each local query row of ``rank``: the rows of block ``src`` it attends to, from the definition."""

    def where(p):
        d = max(i for i, s in enumerate(starts[:-1]) if s <= p < starts[i + 1])
        return d, p - starts[d]

    rows = []
    for x in layout[rank]:
        dq, xq = where(x)
        seen = set()
        if xq < real_lengths[dq]:  # padding queries see nothing
            for j, y in enumerate(layout[src]):
                dk, yk = where(y)
                if dk == dq and yk < real_lengths[dk] and (not causal or yk <= xq):
                    seen.add(j)
        rows.append(seen)
    return rows


def _visible_from_plan(plan, src: int, rank: int, causal: bool):
    """The rows each query row reads under the kernel contract (bottom-right causal in the own block)."""
    cu_q = plan.cu_q.tolist()
    rows = []
    for p in range(len(cu_q) - 1):
        n = cu_q[p + 1] - cu_q[p]
        start, length = int(plan.k_start[src, p]), int(plan.k_len(causal)[src, p])
        for i in range(n):
            count = max(length - n + 1 + i, 0) if causal and src == rank and length > 0 else length
            rows.append(set(range(start, start + count)))
    return rows


@settings(max_examples=40, deadline=None)
@given(lengths=pack_lengths_st, cp=st.sampled_from([1, 2, 3, 4]), spec=st.sampled_from(SPECS), causal=st.booleans())
def test_ring_plan_key_ranges_match_brute_force(lengths, cp, spec, causal):
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec).tolist()
    starts = padded.tolist()
    for rank in range(cp):
        plan = make_ring_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
        assert plan.k_start.shape == plan.k_len_causal.shape == (cp, plan.cu_q.shape[0] - 1)
        for src in range(cp):
            got = _visible_from_plan(plan, src, rank, causal)
            assert got == _visible_brute_force(layout, rank, src, starts, lengths, causal), (rank, src)


def _simulate_ring(q, k, v, dout, cu, padded, spec, cp, causal):
    """Every rank's ring forward and backward in one process: outputs and q/k/v gradients in physical order."""
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec)
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    scale = q.shape[-1] ** -0.5
    for rank in range(cp):
        plan = make_ring_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
        mine = layout[rank]
        steps = [(src, Pieces(plan.cu_q, plan.k_start[src], plan.k_len(causal)[src])) for src in range(cp)]
        o = lse = None
        for src, pieces in steps:
            part = reference.forward(
                q[mine], k[layout[src]], v[layout[src]], pieces, causal=causal and src == rank, scale=scale
            )
            o, lse = (part[0].float(), part[1]) if o is None else merge(o, lse, *part)
        out[mine] = o
        for src, pieces in steps:  # backward with the merged out and lse
            g = reference.backward(
                dout[mine], q[mine], k[layout[src]], v[layout[src]], o, lse, pieces,
                causal=causal and src == rank, scale=scale,
            )  # fmt: skip
            dq[mine] += g[0]
            dk[layout[src]] += g[1]
            dv[layout[src]] += g[2]
    return out, dq, dk, dv


@settings(max_examples=25, deadline=None)
@given(lengths=pack_lengths_st, cp=st.sampled_from([1, 2, 3, 4]), spec=st.sampled_from(SPECS), causal=st.booleans())
def test_simulated_ring_matches_fp64(lengths, cp, spec, causal):
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    g = torch.Generator().manual_seed(sum(lengths))
    t = int(padded[-1])
    q, k, v, dout = (torch.randn(t, h, 8, generator=g) for h in (4, 2, 2, 4))
    got = _simulate_ring(q, k, v, dout, cu, padded, spec, cp, causal)
    full = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention_fp64(*full, cu, causal=causal, cu_seqlens_padded=padded)
    want = [ref, *torch.autograd.grad(ref, full, dout.double())]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(a, b) < 1e-5, name


def test_merge_is_attention_over_the_union_of_keys():
    """Two halves of a key set merged equal one call over all keys; rows with no keys stay 0 / -inf."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 4, generator=g) for h in (2, 1, 1))
    cu_q = torch.tensor([0, 4, 6], dtype=torch.int32)  # piece 1 sees no keys at all
    start, none = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    kw = dict(causal=False, scale=0.5)
    whole = reference.forward(q, k, v, Pieces(cu_q, start, torch.tensor([6, 0], dtype=torch.int32)), **kw)
    first = reference.forward(q, k, v, Pieces(cu_q, start, torch.tensor([2, 0], dtype=torch.int32)), **kw)
    rest = reference.forward(q, k, v, Pieces(cu_q, start + 2, torch.tensor([4, 0], dtype=torch.int32)), **kw)
    empty = reference.forward(q, k, v, Pieces(cu_q, start, none), **kw)
    out, lse = merge(*merge(empty[0].float(), empty[1], *first), *rest)
    assert relative_error(out, whole[0]) < 1e-6 and relative_error(lse[:, :4], whole[1][:, :4]) < 1e-6
    assert out[4:].abs().max() == 0 and bool((lse[:, 4:] == float("-inf")).all())

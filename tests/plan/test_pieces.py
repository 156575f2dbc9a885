"""Attention plans against brute force, and each rank's local
computation (K/V gathered by hand) against the single-device float64 result."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpcompile
from cpcompile.batch import _to_documents
from cpcompile.kernels import Pieces, reference
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import padding_multiple
from cpcompile.layouts.reads import keys_read, read_lengths, read_ranges
from cpcompile.plan.pieces import layout_of, pack_of, step_plan
from cpcompile.plan.window import window_keys
from tests.fixtures import LAYOUT_CASE, cu_seqlens, pack_lengths_st
from tests.fixtures import LAYOUT_SPECS as SPECS
from tests.reference import attention_fp64, relative_error


def _pieces_brute_force(idx: list[int], real_lengths: list[int], padded: list[int]):
    """(q_start, q_len, k_start, k_len_causal, k_len_full) per maximal run, by walking tokens."""
    starts = [sum(padded[:d]) for d in range(len(padded))]

    def where(p):
        d = max(i for i, s in enumerate(starts) if s <= p and padded[i] > 0)
        return d, p - starts[d] < real_lengths[d]

    pieces = []
    for j, p in enumerate(idx):
        d, real = where(p)
        if pieces and idx[j - 1] + 1 == p and where(idx[j - 1]) == (d, real):
            pieces[-1][1] += 1
        else:
            pieces.append([j, 1, d, real, p])
    out = []
    for q_start, q_len, d, real, first in pieces:
        causal = first + q_len - starts[d] if real else 0
        out.append((q_start, q_len, starts[d], causal, real_lengths[d] if real else 0))
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=pack_lengths_st, cp=st.sampled_from([1, 2, 3, 4, 8]), spec=st.sampled_from(SPECS))
def test_plan_pieces_match_brute_force(lengths, cp, spec):
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec)
    for rank in range(cp):
        plan = cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
        cu_q = plan.cu_q.tolist()
        got = [
            (cu_q[p], cu_q[p + 1] - cu_q[p], int(plan.k_start[p]), int(plan.k_len_causal[p]), int(plan.k_len_full[p]))
            for p in range(len(cu_q) - 1)
        ]
        want = _pieces_brute_force(layout[rank].tolist(), lengths, padded.diff().tolist())
        assert got[: len(want)] == want
        assert all(q_len == 0 and kc == 0 and kf == 0 for _, q_len, _, kc, kf in got[len(want) :])
        assert cu_q[-1] == layout.shape[1]
        # gathered row of every physical position
        assert torch.equal(layout.flatten()[plan.gather_index], torch.arange(int(padded[-1])))


def test_dual_chunk_swap_piece_slots_are_static():
    # Piece slots depend on shapes only (3 per document for dual_chunk_swap), never on values.
    cu = cu_seqlens([100, 3, 17])
    plan = cpcompile.plan.make_plan(cu, cp_size=4, rank=1, strategy="dual_chunk_swap")
    assert plan.cu_q.shape == (3 * 3 + 1,)


@settings(max_examples=40, deadline=None)
@given(**LAYOUT_CASE, spare=st.sampled_from([None, (0, 0), (0, 3), (2, 1)]))
def test_simulated_ranks_match_single_device(lengths, cp, spec, causal, spare):
    """Each rank: its pieces against K/V in physical order; outputs and dK/dV summed over ranks
    (padding rows: none). ``spare``: the pack padded to a capacity bucket (``StrategySpec.capacity``)
    of that many more padding multiples and documents than it needs, as ``shard_batch`` pads it."""
    cu = cu_seqlens(lengths)
    if spare is not None:
        least = int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)[-1])
        multiple, _ = padding_multiple(spec, cp)
        capacity = (least + spare[0] * multiple, len(lengths) + spare[1])
        spec = dataclasses.replace(spec, capacity=capacity)
        cu = _to_documents(cu, spec.capacity)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    n = int(padded[-1])
    g = torch.Generator().manual_seed(sum(lengths) + cp)
    q, dout = torch.randn(n, 4, 8, generator=g), torch.randn(n, 4, 8, generator=g)
    k, v = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = attention_fp64(q64, k64, v64, cu, causal=causal, cu_seqlens_padded=padded)
    dq64, dk64, dv64 = torch.autograd.grad(want, (q64, k64, v64), dout.double())

    dk_sum, dv_sum = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        plan = cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
        idx = cpcompile.layouts.partition_indices(padded, cp_size=cp, rank=rank, strategy=spec, cu_seqlens=cu)
        pieces = Pieces(plan.cu_q, plan.k_start, plan.k_len(causal))
        out, lse = reference.forward(q[idx], k, v, pieces, causal=causal, scale=8**-0.5)
        assert relative_error(out, want[idx]) < 1e-5
        dq, dk, dv = reference.backward(dout[idx], q[idx], k, v, out, lse, pieces, causal=causal, scale=8**-0.5)
        assert relative_error(dq, dq64[idx]) < 1e-5
        dk_sum += dk
        dv_sum += dv
    assert relative_error(dk_sum, dk64) < 1e-5
    assert relative_error(dv_sum, dv64) < 1e-5


def test_opcheck_cp_plan():
    """The plan as the compiler inserts it: fake sizes match the real ones for every layout."""
    from torch.library import opcheck

    cu = cu_seqlens([5, 1, 30, 7])
    for spec in SPECS:
        for cp in (2, 3):
            tokens = int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)[-1])
            args = (cu, None, tokens, cp, cp - 1, spec.strategy.value, spec.stripe_size)
            opcheck(torch.ops.cpcompile.cp_plan.default, args)
            plan = torch.ops.cpcompile.cp_plan.default(*args)
            want = cpcompile.plan.make_plan(cu, cp_size=cp, rank=cp - 1, strategy=spec)
            assert all(torch.equal(a, b) for a, b in zip(plan, want))


@settings(max_examples=60, deadline=None)
@given(lengths=pack_lengths_st, cp=st.sampled_from([1, 2, 3, 4, 8]), spec=st.sampled_from(SPECS))
def test_every_ranks_reads_follow_from_the_pack(lengths, cp, spec):
    """The keys each rank's pieces read, from the pack alone (``read_lengths``), are those its own
    plan's pieces read; every plan carries the pack it was made from (its offsets, and its layout
    as ``gather_index``)."""
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    plans = [cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=r, strategy=spec) for r in range(cp)]
    total = plans[0].gather_index.shape[0]
    pack = _pack(plans[0], cp)
    assert torch.equal(pack.layout, pack_of(cu, padded, cp, spec, None)[1].layout)
    for plan in plans:
        assert torch.equal(plan.cu_seqlens, cu) and torch.equal(plan.cu_seqlens_padded, padded)
    for causal in (True, False):
        read_len = read_lengths(pack, causal)  # [cp, B]
        for rank, plan in enumerate(plans):
            want = keys_read(plan.k_start, plan.k_len(causal), total)
            got = torch.zeros(total, dtype=torch.bool)
            for d, n in enumerate(read_len[rank].tolist()):
                got[int(padded[d]) : int(padded[d]) + n] = True
            assert torch.equal(got, want), f"rank {rank} causal={causal}"


@settings(max_examples=40, deadline=None)
@given(
    lengths=pack_lengths_st,
    cp=st.sampled_from([1, 2, 3, 4]),
    spec=st.sampled_from(SPECS),
    window=st.tuples(st.integers(-1, 12), st.integers(-1, 12)),
)
def test_every_ranks_windowed_reads_follow_from_the_pack(lengths, cp, spec, window):
    """Under a window, the runs of keys each rank reads, from the pack alone (``read_ranges``), are
    ascending and disjoint and cover exactly the keys its windowed pieces read."""
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    plans = [cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=r, strategy=spec) for r in range(cp)]
    total = plans[0].gather_index.shape[0]
    reader, lo, hi = read_ranges(_pack(plans[0], cp), window)
    for rank, plan in enumerate(plans):
        k_start, k_len, _ = window_keys(*plan.pieces, window)
        mine = reader == rank
        assert bool((lo[mine][1:] >= hi[mine][:-1]).all()), "runs not disjoint and ascending"  # may touch
        got = torch.zeros(total, dtype=torch.bool)
        for a, b in zip(lo[mine].tolist(), hi[mine].tolist()):
            got[a:b] = True
        assert torch.equal(got, keys_read(k_start, k_len, total)), f"rank {rank} window={window}"


def _pack(plan, cp: int) -> Pack:
    """The pack a plan carries: its layout (the inverse of ``gather_index``) and offsets."""
    return Pack(layout_of(plan.gather_index, cp), plan.cu_seqlens, plan.cu_seqlens_padded)


def test_a_step_plan_carries_its_pack_without_keeping_the_step_alive():
    """The offsets a step's plan carries are copies: the step's ``cu_seqlens``, when dropped, still
    frees its plan (the plan cache keys on it)."""
    cu = cu_seqlens([5, 1, 30, 7])
    plan = step_plan(cu, None, 44, 4, 2, "balanced", 1)
    assert torch.equal(plan.cu_seqlens, cu) and plan.cu_seqlens.untyped_storage()._cdata != cu.untyped_storage()._cdata
    assert plan.cu_seqlens_padded[-1] == 44 and layout_of(plan.gather_index, 4).shape == (4, 11)
    freed = weakref.ref(cu)
    plan_freed = weakref.ref(plan.k_len_causal)
    del cu, plan
    gc.collect()
    assert freed() is None and plan_freed() is None

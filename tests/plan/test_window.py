"""The window argument, each piece's windowed keys against brute force, the balanced
layout under windows, and single-device windowed attention against float64 with a dense mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.cost.model import CostModel, auto_candidates, choose_strategy, predict_rank_costs, resolve_auto
from cpcompile.plan.pieces import plan_extras, step_plan
from cpcompile.plan.window import check_window, resolve_window, window_keys
from tests.fixtures import LAYOUT_SPECS, attention_case, cu_seqlens, pack_lengths_st
from tests.reference import attention_fp64, relative_error, window_mask

SIDES = st.integers(min_value=-1, max_value=12)


@pytest.mark.parametrize(
    ("window", "error", "message"),
    [
        ((-2, 0), ValueError, r"window_size left must be -1 \(unbounded\) or >= 0, got \(-2, 0\)"),
        ((0, -5), ValueError, r"window_size right must be -1 \(unbounded\) or >= 0, got \(0, -5\)"),
        (3, TypeError, r"window_size must be a \(left, right\) pair of ints, got 3"),
        ((1, 2, 3), TypeError, r"pair of ints, got \(1, 2, 3\)"),
        ((True, 0), TypeError, r"got left = True"),
    ],
)
def test_bad_windows_name_the_argument(window, error, message):
    with pytest.raises(error, match=message):
        check_window(window)


def test_causal_and_window_agree():
    assert resolve_window(True, None) == (-1, 0) and resolve_window(False, None) == (-1, -1)
    assert resolve_window(True, (4, 0)) == (4, 0) and resolve_window(False, [2, 3]) == (2, 3)
    with pytest.raises(ValueError, match=r"causal=True needs window_size with right = 0, got \(2, 3\)"):
        resolve_window(True, (2, 3))
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        resolve_window(1, None)


@settings(max_examples=40, deadline=None)
@given(
    lengths=pack_lengths_st, cp=st.sampled_from([1, 2, 3]), spec=st.sampled_from(LAYOUT_SPECS), left=SIDES, right=SIDES
)
def test_window_keys_are_the_union_of_the_rows_windows(lengths, cp, spec, left, right):
    """A piece's windowed keys are exactly the keys its rows' windows reach (physical positions), and
    ``q_pos`` is its first row's position."""
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    starts, real = padded[:-1].tolist(), cu.diff().tolist()
    for rank in range(cp):
        plan = cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
        idx = cpcompile.layouts.partition_indices(padded, cp_size=cp, rank=rank, strategy=spec).tolist()
        k_start, k_len, q_pos = window_keys(*plan.pieces, (left, right))
        for p, (a, b) in enumerate(zip(plan.cu_q[:-1].tolist(), plan.cu_q[1:].tolist())):
            if a == b:
                continue
            d = max(i for i, s in enumerate(starts) if s <= idx[a] and (padded[i + 1] > s))
            pos = [x - starts[d] for x in idx[a:b]]
            keys = set()
            for x in pos:
                if x < real[d]:
                    lo, hi = x - left if left >= 0 else 0, x + right if right >= 0 else real[d] - 1
                    keys |= {starts[d] + j for j in range(max(lo, 0), min(hi, real[d] - 1) + 1)}
            got = set(range(int(k_start[p]), int(k_start[p] + k_len[p])))
            assert got == keys, (rank, p, left, right)
            if keys and q_pos is not None:  # causal and full attention: the plan's own keys, no positions
                assert int(q_pos[p]) == idx[a]


def test_windows_go_with_balanced_and_auto_alone():
    assert StrategySpec("balanced", windows=[4, -1]).windows == (4, -1)
    assert StrategySpec("auto", windows=(4,)).windows == (4,)
    with pytest.raises(ValueError, match=r"windows=\(4,\) only applies to strategies 'balanced' and 'auto'"):
        StrategySpec("no_load_balance", windows=(4,))
    with pytest.raises(ValueError, match=r"with head_parallel=1, not 'auto' with head_parallel=2"):
        StrategySpec("auto", windows=(4,), kv="heads", head_parallel=2)
    with pytest.raises(ValueError, match=r"windows must be a tuple of ints >= -1 \(-1: a global layer\), got \(-3,\)"):
        StrategySpec("balanced", windows=(-3,))


@settings(max_examples=30, deadline=None)
@given(lengths=pack_lengths_st, cp=st.sampled_from([1, 2, 3, 4]), windows=st.lists(SIDES, min_size=1, max_size=3))
def test_windowed_balanced_layout_holds_every_position_once(lengths, cp, windows):
    spec = StrategySpec(Strategy.BALANCED, windows=tuple(windows))
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=spec)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec)
    assert sorted(layout.reshape(-1).tolist()) == list(range(int(padded[-1])))
    assert bool((layout.diff(dim=1) > 0).all())  # each rank's positions ascending


@settings(max_examples=25, deadline=None)
@given(lengths=pack_lengths_st, cp=st.sampled_from([2, 3, 4]), windows=st.lists(SIDES, min_size=1, max_size=3))
@example(lengths=[29, 20, 3, 5, 20], cp=4, windows=[0, 10])  # the windows change the pick
def test_auto_weighs_the_layers_windows(lengths, cp, windows):
    """``auto`` told the layers' windows picks the candidate whose sum over the layers of each layer's
    slowest rank (under its window) is least (brute force over the candidates, balanced told the
    windows), keeps the windows where it picks balanced, and the plan ops resolve it alike."""
    windows = tuple(windows)
    cu = cu_seqlens(lengths)
    candidates = [
        StrategySpec(c.strategy, c.stripe_size, windows=windows if c.strategy is Strategy.BALANCED else ())
        for c in auto_candidates()
    ]

    def step(spec):
        return sum(predict_rank_costs(cu, cp_size=cp, strategy=spec, model=CostModel(window=w)).step for w in windows)

    steps = [step(c) for c in candidates]
    want = candidates[steps.index(min(steps))]
    spec = StrategySpec("auto", windows=windows)
    got = resolve_auto(spec, cu, cp_size=cp)
    assert got == want and got.windows == (windows if got.strategy is Strategy.BALANCED else ())
    assert choose_strategy(cu, cp_size=cp, windows=windows) == want
    if (lengths, cp, windows) == ([29, 20, 3, 5, 20], 4, (0, 10)):
        assert want.strategy is Strategy.BALANCED and choose_strategy(cu, cp_size=cp).strategy is not Strategy.BALANCED
    # the plan ops resolve it alike (as the cp_plan op calls them): the same pieces, then the empty
    # slots auto's piece count leaves
    tokens = int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=want)[-1])
    resolved = step_plan(cu, None, tokens, cp, cp - 1, "auto", 1, *plan_extras(spec))
    direct = cpcompile.plan.make_plan(cu, cp_size=cp, rank=cp - 1, strategy=want)
    p = direct.k_start.shape[0]
    assert torch.equal(resolved.gather_index, direct.gather_index) and torch.equal(resolved.cu_q[: p + 1], direct.cu_q)
    for a, b in zip(resolved.pieces[1:], direct.pieces[1:], strict=True):
        assert torch.equal(a[:p], b)
    assert torch.equal(resolved.cu_seqlens_padded, direct.cu_seqlens_padded)
    assert not resolved.k_len_causal[p:].any() and not resolved.k_len_full[p:].any()
    assert bool((resolved.cu_q[p:] == direct.cu_q[-1]).all())


def test_balanced_evens_windowed_work():
    """Balanced for causal work leaves a windowed model's ranks uneven; balanced for its window evens them."""
    cu = cu_seqlens([12000, 3000, 500, 500])
    model = CostModel(window=256)
    spread = {}
    for windows in ((), (256,)):
        pairs = predict_rank_costs(cu, cp_size=4, strategy=StrategySpec("balanced", windows=windows), model=model).pairs
        spread[windows] = float(pairs.max() / pairs.double().mean())
    assert spread[(256,)] < 1.005 and spread[()] > 1.02, spread


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (3, 2), (-1, 4), (5, -1), (40, 40)])
def test_packed_attention_windows_match_a_dense_mask(window):
    """Single device, unpadded and padded, against float64 with a dense window mask."""
    lengths = [1, 9, 0, 17, 4]
    cu, _, q, k, v, dout = attention_case(lengths, 4, 2, 8, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cpcompile.packed_attention(*leaves, cu, causal=False, window_size=window)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_fp64(*ref_leaves, cu, causal=False, window=window)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, ref_leaves, dout)):
        assert relative_error(a, b) < 1e-12
    assert relative_error(out, ref) < 1e-12
    assert window_mask(3, (0, 0)).tolist() == torch.eye(3, dtype=torch.bool).tolist()  # the mask itself

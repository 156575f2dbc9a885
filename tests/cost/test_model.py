"""The cost model (``cpcompile.cost.model``) against brute force, auto's rule and how its pick reaches
plans and batches, and argument errors (tests/attention/test_cp_attention.py runs auto on gloo ranks)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.cost.model import CostModel, auto_candidates, choose_strategy, predict_rank_costs
from cpcompile.plan.pieces import max_pieces
from tests.fixtures import cu_seqlens

BALANCED = StrategySpec(Strategy.BALANCED)


def _costs_brute_force(cu: torch.Tensor, padded: torch.Tensor, layout: torch.Tensor, model: CostModel):
    """Per rank (pairs, tiles, pieces, short cuts, key rows, keys read), walking tokens and kernel blocks
    one by one."""
    real_len, bounds = cu.diff().tolist(), padded.tolist()
    out = []
    for idx in layout.tolist():
        pieces = []  # [doc, first position in doc, rows, real]
        for p in idx:
            d = max(i for i in range(len(real_len)) if bounds[i] <= p < bounds[i + 1])
            pos, real = p - bounds[d], p - bounds[d] < real_len[d]
            last = pieces[-1] if pieces else None
            if last and last[0] == d and last[3] == real and last[1] + last[2] == pos:
                last[2] += 1
            else:
                pieces.append([d, pos, 1, real])
        pairs = tiles = short = key_rows = 0
        read = set()  # (document, key)
        held = set(idx)  # physical positions this rank holds
        for d, o, n, real in pieces:
            if not real:
                continue
            w = model.window if model.window >= 0 else real_len[d]  # a window caps each row's keys
            first = [max(0, o + i - w) if model.causal else 0 for i in range(n)]  # each row's keys [first, end)
            end = [o + i + 1 if model.causal else real_len[d] for i in range(n)]
            pairs += sum(end) - sum(first)
            blocks = range(0, n, model.block_q)  # a query block reads key tiles from its first row's to its last's
            last_rows = [min(b + model.block_q, n) - 1 for b in blocks]
            tiles += sum(
                math.ceil(end[r] / model.block_k) - first[b] // model.block_k for b, r in zip(blocks, last_rows)
            )
            short += n < model.block_q and n < real_len[d]
            key_rows += end[-1] - first[0]  # the piece's key range
            read |= {(d, key) for i in range(n) for key in range(first[i], end[i])}
        remote = sum(bounds[d] + key not in held for d, key in read)
        out.append((pairs, tiles, len(pieces), short, key_rows, len(read), remote))
    return out


SPECS = [
    StrategySpec(Strategy.DUAL_CHUNK_SWAP),
    StrategySpec(Strategy.NO_LOAD_BALANCE),
    StrategySpec(Strategy.STRIPED, stripe_size=3),
    BALANCED,
]


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6).filter(lambda x: sum(x) > 0),
    cp=st.sampled_from([1, 2, 3, 4]),
    spec=st.sampled_from(SPECS),
    causal=st.booleans(),
    blocks=st.sampled_from([(4, 2), (4, 4), (8, 2)]),
    window=st.sampled_from([-1, -1, 0, 1, 3, 9]),
)
def test_predicted_costs_match_brute_force(lengths, cp, spec, causal, blocks, window):
    window = window if causal else -1  # a window counts causal sliding windows
    model = CostModel(block_q=blocks[0], block_k=blocks[1], token_cost=5, key_cost=3, causal=causal, window=window)
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    costs = predict_rank_costs(cu, cp_size=cp, strategy=spec, model=model)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec)
    want = _costs_brute_force(cu, padded, layout, model)
    assert costs.pairs.tolist() == [w[0] for w in want]
    assert costs.tiles.tolist() == [w[1] for w in want]
    assert costs.pieces.tolist() == [w[2] for w in want]
    assert costs.short_cuts.tolist() == [w[3] for w in want]
    assert costs.key_rows.tolist() == [w[4] for w in want]
    assert costs.keys_read.tolist() == [w[5] for w in want]
    assert costs.keys_remote.tolist() == [w[6] for w in want]
    assert costs.tokens.tolist() == [layout.shape[1]] * cp
    assert costs.cost.tolist() == [w[1] * blocks[0] * blocks[1] + 5 * layout.shape[1] + 3 * w[4] for w in want]
    assert costs.step == max(costs.cost.tolist())


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6).filter(lambda x: sum(x) > 0),
    cp_u=st.sampled_from([(2, 2), (4, 2), (4, 4), (6, 3), (6, 2)]),
    spec=st.sampled_from(SPECS),
    causal=st.booleans(),
)
def test_head_parallel_costs_are_their_groups_split_over_heads(lengths, cp_u, spec, causal):
    """A rank of ``head_parallel = u`` runs 1/u of the heads over its group's rows: the hybrid's group
    layouts one after the other, pure head parallelism's whole pack in physical order (its backward
    reads keys in place: no key rows copied)."""
    cp, u = cp_u
    spec = dataclasses.replace(spec, kv="heads", head_parallel=u)
    model = CostModel(block_q=4, block_k=2, token_cost=5, key_cost=3, causal=causal)
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    costs = predict_rank_costs(cu, cp_size=cp, strategy=spec, model=model)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec)
    groups = torch.arange(int(padded[-1]))[None] if u == cp else layout.reshape(cp // u, -1)
    want = _costs_brute_force(cu, padded, groups, model)
    for r in range(cp):
        pairs, tiles, pieces, short, key_rows, read, remote = want[r // u]
        key_rows = 0 if u == cp else key_rows
        assert costs.pairs[r] == math.ceil(pairs / u) and costs.tiles[r] == math.ceil(tiles / u)
        assert costs.key_rows[r] == math.ceil(key_rows / u)
        assert (costs.pieces[r], costs.short_cuts[r], costs.keys_read[r], costs.keys_remote[r]) == (
            pieces,
            short,
            read,
            remote,
        )
        assert costs.tokens[r] == layout.shape[1]
        assert costs.cost[r] == math.ceil(tiles / u) * 8 + 5 * layout.shape[1] + 3 * math.ceil(key_rows / u)


def test_head_parallel_costs_are_even_and_auto_keeps_head_parallel():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260])
    pure = predict_rank_costs(
        cu, cp_size=4, strategy=StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=4)
    )
    assert len(set(pure.cost.tolist())) == 1  # every rank runs every document for its heads
    auto = StrategySpec(Strategy.AUTO, kv="heads", head_parallel=2)
    picked = cpcompile.shard_batch({"x": torch.arange(int(cu[-1]))}, cu, cp_size=4, rank=0, strategy=auto).spec
    assert picked == dataclasses.replace(choose_strategy(cu, cp_size=4), kv="heads", head_parallel=2)
    with pytest.raises(ValueError, match="head_parallel=3 must divide the CP size 4"):
        predict_rank_costs(cu, cp_size=4, strategy=StrategySpec(kv="heads", head_parallel=3))


def test_auto_takes_the_cheapest_and_the_first_on_ties():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260])
    steps = {c: predict_rank_costs(cu, cp_size=4, strategy=c).step for c in auto_candidates()}
    assert choose_strategy(cu, cp_size=4) == min(auto_candidates(), key=steps.__getitem__)
    # one rank: no_load_balance and balanced hold the same tokens in the same pieces
    nlb, bal = StrategySpec(Strategy.NO_LOAD_BALANCE), BALANCED
    assert choose_strategy(cu, cp_size=1, candidates=(nlb, bal)) == nlb
    assert choose_strategy(cu, cp_size=1, candidates=(bal, nlb)) == bal


def test_auto_avoids_the_imbalance_of_one_long_document():
    # One document: no_load_balance leaves rank 3 seven times rank 0's work; balanced splits it
    # head-tail without dual_chunk_swap's padding (5 tokens here, against 1).
    cu = cu_seqlens([4 * 8192 - 5])
    costs = {c.strategy: predict_rank_costs(cu, cp_size=4, strategy=c) for c in auto_candidates()}
    assert costs[Strategy.NO_LOAD_BALANCE].pairs.tolist()[3] > 6 * costs[Strategy.NO_LOAD_BALANCE].pairs.tolist()[0]
    assert choose_strategy(cu, cp_size=4) == BALANCED


def test_auto_through_make_plan_and_shard_batch():
    cu = cu_seqlens([5000, 3, 300, 70, 1200])
    chosen = choose_strategy(cu, cp_size=3)
    ids = torch.arange(int(cu[-1]))
    for rank in range(3):
        batch = cpcompile.shard_batch({"ids": ids}, cu, cp_size=3, rank=rank, strategy="auto")
        assert batch.spec == chosen  # the loader records what attention must use
        assert torch.equal(
            batch.indices, cpcompile.shard_batch({"ids": ids}, cu, cp_size=3, rank=rank, strategy=chosen).indices
        )
        auto = cpcompile.plan.make_plan(cu, cp_size=3, rank=rank, strategy="auto")
        plan = cpcompile.plan.make_plan(cu, cp_size=3, rank=rank, strategy=chosen)
        # auto's piece slots cover any strategy it may pick; the live pieces are the chosen one's
        assert auto.cu_q.shape[0] == max_pieces(StrategySpec(Strategy.AUTO), 5, batch.indices.shape[0]) + 1
        live = plan.cu_q.shape[0] - 1
        assert torch.equal(auto.gather_index, plan.gather_index)
        assert torch.equal(auto.cu_q[: live + 1], plan.cu_q)
        for name in ("k_start", "k_len_causal", "k_len_full"):
            assert torch.equal(getattr(auto, name)[:live], getattr(plan, name))
        assert (auto.k_len_causal[live:] == 0).all()


@pytest.mark.parametrize("strategy", ["balanced", "auto"])
def test_compiled_plan_sizes_match_the_traced_ones(strategy):
    # The compiler traces cpcompile::cp_plan with its fake and runs the real one per batch:
    # their sizes must agree whatever auto picks.
    from cpcompile.attention import plan_op  # noqa: F401  (registers the op)

    cu, cp = cu_seqlens([5000, 3, 300, 70, 1200]), 3
    spec = choose_strategy(cu, cp_size=cp) if strategy == "auto" else BALANCED
    tokens = int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)[-1])
    real = torch.ops.cpcompile.cp_plan(cu, None, tokens, cp, 1, strategy, 1)
    with FakeTensorMode():
        fake = torch.ops.cpcompile.cp_plan(torch.empty(6, dtype=torch.int32), None, tokens, cp, 1, strategy, 1)
    assert [t.shape for t in real] == [t.shape for t in fake]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: CostModel(block_q=100, block_k=64),
            ValueError,
            r"block_q \(100\) must be a multiple of block_k \(64\)",
        ),
        (lambda: CostModel(token_cost=-1), ValueError, "token_cost must be an int >= 0, got -1"),
        (
            lambda: choose_strategy(cu_seqlens([8]), cp_size=2, candidates=(StrategySpec(Strategy.AUTO),)),
            ValueError,
            "candidates must be a non-empty sequence of concrete StrategySpecs",
        ),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_auto_needs_values_not_tracing():
    with FakeTensorMode(), pytest.raises(ValueError, match="not available while tracing"):
        choose_strategy(torch.empty(4, dtype=torch.int32), cp_size=2)


def test_auto_keeps_the_requested_kv():
    """auto picks a layout; how K/V travel (ring or all-gather) stays the caller's choice."""
    cu = torch.tensor([0, 5, 300, 310, 900], dtype=torch.int32)
    with cpcompile.strategy("auto", kv="ring", kernel="reference"):
        batch = cpcompile.shard_batch({"x": torch.arange(900)}, cu, cp_size=2, rank=0)
    assert batch.spec.strategy is not Strategy.AUTO
    assert (batch.spec.kv, batch.spec.kernel) == ("ring", "reference")

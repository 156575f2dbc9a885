"""Tier 1: the balanced layout and the cost model against brute force, the auto rule,
and argument errors (the gloo tier runs balanced and auto in test_cp_attention_gloo)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import cpcompile
from cpcompile import Strategy, StrategySpec, balanced
from cpcompile.cost import CostModel, auto_candidates, choose_strategy, predict_rank_costs
from cpcompile.partition import piece_marks
from cpcompile.plan import max_pieces
from tests.reference import balanced_brute_force

BALANCED = StrategySpec(Strategy.BALANCED)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _work(cu_padded: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """Per rank: the sum over its tokens of the keys they see (causal, every token real)."""
    cu = cu_padded.long()
    doc = torch.searchsorted(cu, layout, right=True) - 1
    return (layout - cu[doc] + 1).sum(-1)


# Short documents (1-token ones included) are dealt whole; long ones are cut head-tail.
lengths_st = st.lists(
    st.one_of(st.integers(min_value=0, max_value=6), st.integers(min_value=100, max_value=1500)),
    min_size=1,
    max_size=10,
).filter(lambda x: sum(x) > 0)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([2, 3, 4, 8]))
def test_balanced_matches_brute_force(lengths, cp):
    padded = cpcompile.pad_for_cp(_cu(lengths), cp_size=cp, strategy=BALANCED)
    assert padded.diff().tolist() == lengths[:-1] + [lengths[-1] + (-sum(lengths)) % cp]  # < cp tokens, at the end
    layout = cpcompile.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    assert layout.tolist() == balanced_brute_force(padded.diff().tolist(), cp)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))  # every token once


def _mixes() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    short = torch.randint(1, 1000, (12,), generator=g).tolist()
    return {
        "single document": [8191],
        "1 long + N short": [3 * sum(short) // 2, *short],
        "log-normal": (torch.empty(40).log_normal_(5.5, 1.0, generator=g).long() + 1).tolist(),
    }


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("mix", list(_mixes()))
def test_balanced_work_is_even(mix, cp):
    # Ranks of fewer than SNAP_MIN_TOKENS tokens: the layout counts attention pairs, and each
    # cut is off the exact share by at most one token's step plus half of the two documents
    # it falls in: 1.5 x the longest document, however long the pack.
    lengths = _mixes()[mix]
    assert sum(lengths) // cp < balanced.SNAP_MIN_TOKENS
    padded = cpcompile.pad_for_cp(_cu(lengths), cp_size=cp, strategy=BALANCED)
    work = _work(padded, cpcompile.all_partition_indices(padded, cp_size=cp, strategy=BALANCED))
    total = int(work.sum())
    held = work.cumsum(0)[:-1]  # ranks 0..r-1
    share = torch.arange(1, cp) * total / cp
    assert (held - share).abs().max() <= 1.5 * max(padded.diff().tolist())


def _rank_tiles(padded: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """Per rank: the kernel tiles (TILE x TILE) its pieces visit, as the cost model counts them."""
    doc, pos, _, start = piece_marks(layout, padded, padded)
    rank, row = start.nonzero(as_tuple=True)
    first = rank * layout.shape[1] + row
    rows = torch.diff(first, append=first.new_full((1,), layout.numel()))
    tiles = balanced.causal_tiles(rows, pos.reshape(-1)[first])
    return torch.zeros(layout.shape[0], dtype=torch.long).index_add_(0, rank, tiles)


# Log-normal packs (seed, cp, documents) with at least SNAP_MIN_TOKENS per rank: the layout counts
# kernel tiles. In step 4 a cut's nearest tries would cross the split before it (1: it takes its 2nd,
# 5: its 10th, 28: its 4th, a split without a tail) or the unmoved one after it (168); 0 is plain.
TILE_PACKS = [(1, 8, 400), (5, 8, 400), (0, 4, 400), (28, 8, 400), (168, 8, 200)]


@pytest.mark.parametrize("seed,cp,docs", TILE_PACKS)
def test_balanced_counts_kernel_tiles(seed, cp, docs):
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(docs).log_normal_(5.5, 1.2, generator=g).long() + 1).tolist()
    padded = cpcompile.pad_for_cp(_cu(lengths), cp_size=cp, strategy=BALANCED)
    assert int(padded[-1]) // cp >= balanced.SNAP_MIN_TOKENS
    layout = cpcompile.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))
    assert layout.tolist() == balanced_brute_force(padded.diff().tolist(), cp)
    # The busiest rank's tiles: 1.002-1.010 of the mean on these packs (at most 1.013 on 600 such
    # packs); counting pairs, without step 4, 1.009-1.039.
    tiles = _rank_tiles(padded, layout)
    pairs_only = _rank_tiles(padded, torch.tensor(balanced_brute_force(padded.diff().tolist(), cp, min_tokens=10**9)))
    assert tiles.max() <= 1.0125 * tiles.double().mean()
    assert tiles.max() / tiles.double().mean() < pairs_only.max() / pairs_only.double().mean()


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_front_cuts_move_to_tiles(seed, cp):
    # 30 documents of 1000-8000 tokens (at least SNAP_MIN_TOKENS per rank), none dealt: step 4 moves
    # front cuts, checked token by token against the brute force, and fewer pieces start off a tile.
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1000, 8000, (30,), generator=g).tolist()
    assert sum(lengths) // cp >= balanced.SNAP_MIN_TOKENS
    padded = cpcompile.pad_for_cp(_cu(lengths), cp_size=cp, strategy=BALANCED)
    layout = cpcompile.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))
    assert layout.tolist() == balanced_brute_force(padded.diff().tolist(), cp)

    def off_tile(layout):  # pieces whose first token is not on a tile of its document
        cu = padded.long()
        doc = torch.searchsorted(cu, layout, right=True) - 1
        first = torch.ones_like(layout, dtype=torch.bool)
        first[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (layout[:, 1:] != layout[:, :-1] + 1)
        return int(((layout - cu[doc]) % balanced.TILE != 0)[first].sum())

    unmoved = balanced_brute_force(padded.diff().tolist(), cp, slack=10**12)  # only exact moves
    assert off_tile(layout) < off_tile(torch.tensor(unmoved))


def test_balanced_moved_cut_at_a_document_end():
    # A cut moved to take its whole document ends where the next document starts: that one's
    # pieces must not take the moved cut's split (a review found tokens lost, others held twice).
    lengths = [7097, 4221, 7936, 3267, 6465, 6839, 3530, 1095, 4911, 6688, 5171, 3867, 3090, 2955, 7272]
    lengths += [5696, 3780, 7304, 5358, 4090, 1211, 5262, 5700, 7450, 6543, 6705, 4225, 5032, 5141, 2905]
    padded = cpcompile.pad_for_cp(_cu(lengths), cp_size=4, strategy=BALANCED)
    layout = cpcompile.all_partition_indices(padded, cp_size=4, strategy=BALANCED)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))
    assert layout.tolist() == balanced_brute_force(padded.diff().tolist(), 4)


@settings(max_examples=400, deadline=None)
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 127), st.integers(128, 9000), st.integers(20000, 120000)), min_size=1, max_size=40
    ),
    cp=st.integers(2, 8),
)
def test_balanced_covers_every_token_once_on_large_packs(lengths, cp):
    # Packs with enough tokens per rank for step 4, one dominant document included: the layout
    # alone (no brute force, so many packs) holds every token once.
    lengths = [*lengths, max(0, balanced.SNAP_MIN_TOKENS * cp - sum(lengths))]
    padded = cpcompile.pad_for_cp(_cu(lengths), cp_size=cp, strategy=BALANCED)
    layout = cpcompile.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))


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
            keys = [o + i + 1 if model.causal else real_len[d] for i in range(n)]
            pairs += sum(keys)
            last_rows = [min(b + model.block_q, n) - 1 for b in range(0, n, model.block_q)]  # one per query block
            tiles += sum(math.ceil(keys[row] / model.block_k) for row in last_rows)
            short += n < model.block_q and n < real_len[d]
            key_rows += keys[-1]  # the piece's key range
            read |= {(d, key) for key in range(keys[-1])}
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
)
def test_predicted_costs_match_brute_force(lengths, cp, spec, causal, blocks):
    model = CostModel(block_q=blocks[0], block_k=blocks[1], token_cost=5, key_cost=3, causal=causal)
    cu = _cu(lengths)
    padded = cpcompile.pad_for_cp(cu, cp_size=cp, strategy=spec)
    costs = predict_rank_costs(cu, cp_size=cp, strategy=spec, model=model)
    layout = cpcompile.all_partition_indices(padded, cp_size=cp, strategy=spec)
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


def test_auto_takes_the_cheapest_and_the_first_on_ties():
    cu = _cu([3000, 40, 7, 900, 1, 260])
    steps = {c: predict_rank_costs(cu, cp_size=4, strategy=c).step for c in auto_candidates()}
    assert choose_strategy(cu, cp_size=4) == min(auto_candidates(), key=steps.__getitem__)
    # one rank: no_load_balance and balanced hold the same tokens in the same pieces
    nlb, bal = StrategySpec(Strategy.NO_LOAD_BALANCE), BALANCED
    assert choose_strategy(cu, cp_size=1, candidates=(nlb, bal)) == nlb
    assert choose_strategy(cu, cp_size=1, candidates=(bal, nlb)) == bal


def test_auto_avoids_the_imbalance_of_one_long_document():
    # One document: no_load_balance leaves rank 3 seven times rank 0's work; balanced splits it
    # head-tail without dual_chunk_swap's padding (5 tokens here, against 1).
    cu = _cu([4 * 8192 - 5])
    costs = {c.strategy: predict_rank_costs(cu, cp_size=4, strategy=c) for c in auto_candidates()}
    assert costs[Strategy.NO_LOAD_BALANCE].pairs.tolist()[3] > 6 * costs[Strategy.NO_LOAD_BALANCE].pairs.tolist()[0]
    assert choose_strategy(cu, cp_size=4) == BALANCED


def test_auto_through_make_plan_and_shard_batch():
    cu = _cu([5000, 3, 300, 70, 1200])
    chosen = choose_strategy(cu, cp_size=3)
    ids = torch.arange(int(cu[-1]))
    for rank in range(3):
        batch = cpcompile.shard_batch({"ids": ids}, cu, cp_size=3, rank=rank, strategy="auto")
        assert batch.spec == chosen  # the loader records what attention must use
        assert torch.equal(
            batch.indices, cpcompile.shard_batch({"ids": ids}, cu, cp_size=3, rank=rank, strategy=chosen).indices
        )
        auto = cpcompile.make_plan(cu, cp_size=3, rank=rank, strategy="auto")
        plan = cpcompile.make_plan(cu, cp_size=3, rank=rank, strategy=chosen)
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
    from cpcompile.ops import cp_plan  # noqa: F401  (registers the op)

    cu, cp = _cu([5000, 3, 300, 70, 1200]), 3
    spec = choose_strategy(cu, cp_size=cp) if strategy == "auto" else BALANCED
    tokens = int(cpcompile.pad_for_cp(cu, cp_size=cp, strategy=spec)[-1])
    real = torch.ops.cpcompile.cp_plan(cu, None, tokens, cp, 1, strategy, 1)
    with FakeTensorMode():
        fake = torch.ops.cpcompile.cp_plan(torch.empty(6, dtype=torch.int32), None, tokens, cp, 1, strategy, 1)
    assert [t.shape for t in real] == [t.shape for t in fake]


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([2, 3, 4, 8]), per_document=st.booleans())
def test_balanced_piece_bound(lengths, cp, per_document):
    # Padding inside every document (a dual_chunk_swap offset table) cuts pieces too.
    cu = _cu(lengths)
    padded = cpcompile.pad_for_cp(cu, cp_size=cp, strategy="dual_chunk_swap" if per_document else BALANCED)
    layout = cpcompile.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    pieces = cpcompile.partition.piece_marks(layout, cu, padded)[3].sum(1)
    assert int(pieces.max()) <= max_pieces(BALANCED, len(lengths), layout.shape[1])


def test_balanced_layout_op():
    cu = _cu([700, 5, 1, 300, 8])
    opcheck(torch.ops.cpcompile.balanced_layout.default, (cu, 3, 1014))
    with FakeTensorMode():  # shapes come from the token count, values are never read
        fake = torch.ops.cpcompile.balanced_layout(torch.empty(6, dtype=torch.int32), 3, 1014)
    assert fake.shape == (3, 338) and fake.dtype == torch.int64


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: cpcompile.partition_indices(_cu([8]), cp_size=2, rank=0, strategy="auto"),
            ValueError,
            "strategy 'auto' has no layout of its own",
        ),
        (
            lambda: cpcompile.pad_for_cp(_cu([8]), cp_size=2, strategy="auto"),
            ValueError,
            "strategy 'auto' has no layout of its own",
        ),
        (
            lambda: cpcompile.partition_indices(_cu([7]), cp_size=2, rank=0, strategy="balanced"),
            ValueError,
            "balanced with cp_size=2: the total 7 must be a multiple of 2",
        ),
        (
            lambda: CostModel(block_q=100, block_k=64),
            ValueError,
            r"block_q \(100\) must be a multiple of block_k \(64\)",
        ),
        (lambda: CostModel(token_cost=-1), ValueError, "token_cost must be an int >= 0, got -1"),
        (
            lambda: choose_strategy(_cu([8]), cp_size=2, candidates=(StrategySpec(Strategy.AUTO),)),
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


def test_auto_keeps_the_requested_comm():
    """auto picks a layout; how K/V travel (ring or all-gather) stays the caller's choice."""
    cu = torch.tensor([0, 5, 300, 310, 900], dtype=torch.int32)
    with cpcompile.strategy("auto", comm="ring"):
        batch = cpcompile.shard_batch({"x": torch.arange(900)}, cu, cp_size=2, rank=0)
    assert batch.spec.strategy is not Strategy.AUTO
    assert batch.spec.comm == "ring"

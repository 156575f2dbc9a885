"""What the cost model and ``auto``'s decision count from a layout's runs, and what ``decide`` leaves out
under ``prune``, against the token-by-token counts they replace: the same costs, reads, bytes and choice
on random packs (1-token and empty documents, one document, a pack of ``cp`` tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpcompile import Strategy, StrategySpec
from cpcompile.cost.comm import Heads, exchange_floor, exchange_matrix, layout_key, peer_bytes
from cpcompile.cost.model import CostModel, RankCosts, _tiles, rank_costs
from cpcompile.cost.timing import TOPOLOGIES, decide
from cpcompile.layouts.balanced import _least, window_pairs
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import layout_runs, padded_offsets, piece_marks, run_pieces, spec_runs
from cpcompile.layouts.reads import read_lengths, read_ranges, with_idle
from cpcompile.plan import make_plan
from cpcompile.plan.pieces import layout_of

LAYOUTS = (
    StrategySpec(Strategy.NO_LOAD_BALANCE),
    StrategySpec(Strategy.DUAL_CHUNK_SWAP),
    StrategySpec(Strategy.STRIPED, stripe_size=4),
    StrategySpec(Strategy.BALANCED),
)
MODELS = (CostModel(), CostModel(causal=False), CostModel(window=5), CostModel(window=0, block_q=256))


def packs(seed: int = 0, per_cp: int = 4):
    """``(cp, cu_seqlens)``: random packs at several CP sizes, with the edge cases."""
    g = torch.Generator().manual_seed(seed)
    for cp in (1, 2, 3, 4, 8):
        yield cp, torch.tensor([0, cp], dtype=torch.int32)  # padded size equals cp
        yield cp, torch.tensor([0, 0, 1, 1, 2 * cp + 1], dtype=torch.int32)  # empty and 1-token documents
        yield cp, torch.tensor([0, 300], dtype=torch.int32)  # one document
        for i in range(per_cp):
            n = int(torch.randint(1, 12, (1,), generator=g))
            lengths = torch.randint(0, (3, 40, 700)[i % 3], (n,), generator=g)
            lengths[0] = max(int(lengths[0]), 1)
            yield cp, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def token_costs(cu: torch.Tensor, spec: StrategySpec, cp: int, model: CostModel) -> RankCosts:
    """``rank_costs`` as it was counted, token by token: each token's document and piece
    (``piece_marks``), a head group's positions sorted for its reads."""
    u = spec.head_parallel
    pack = Pack.build(cu, None, spec=layout_key(spec), cp_size=cp)
    layout, padded = pack.layout, pack.cu_seqlens_padded
    tokens = torch.full((cp,), layout.shape[1], dtype=torch.long)
    whole = u == cp > 1
    layout = torch.arange(layout.numel()).unsqueeze(0) if whole else layout.reshape(cp // u, -1)
    groups, t_group = layout.shape
    doc, pos, real, start = piece_marks(layout, cu, padded)
    rank, row = start.nonzero(as_tuple=True)
    first = rank * t_group + row
    q_len = torch.diff(first, append=first.new_full((1,), groups * t_group))
    live, offset = real.reshape(-1)[first], pos.reshape(-1)[first]
    doc_len = (cu[1:] - cu[:-1]).long()[doc.reshape(-1)[first]]
    w, m = model.window, model.block_q
    pairs = window_pairs(offset + q_len, w) - window_pairs(offset, w) if model.causal else q_len * doc_len
    keys = (offset if w < 0 else offset.clamp(max=w)) + q_len if model.causal else doc_len
    tiles = _tiles(q_len, offset, doc_len, model)

    def per(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(groups, dtype=torch.long).index_add_(0, rank, x.long())

    held = layout if u == 1 else layout.sort(dim=1).values
    reader, lo, hi = read_ranges(Pack(held, cu, padded), (w, 0) if model.causal else (-1, -1))
    span = int(padded[-1]) + 1
    flat = (held + torch.arange(groups)[:, None] * span).reshape(-1)

    def below(x: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(flat, x + reader * span) - reader * t_group

    keys_read = torch.zeros(groups, dtype=torch.long).index_add(0, reader, hi - lo)
    own = torch.zeros(groups, dtype=torch.long).index_add(0, reader, below(hi) - below(lo))
    key_rows = torch.zeros(groups, dtype=torch.long) if whole else per(torch.where(live, keys, 0))

    def spread(x: torch.Tensor, share: int = 1) -> torch.Tensor:
        return ((x + share - 1) // share).repeat_interleave(u)

    tiles_r, key_rows = spread(per(torch.where(live, tiles, 0)), u), spread(key_rows, u)
    return RankCosts(
        tokens=tokens,
        pieces=spread(per(torch.ones_like(rank))),
        short_cuts=spread(per(live & (q_len < m) & (q_len < doc_len))),
        pairs=spread(per(torch.where(live, pairs, 0)), u),
        tiles=tiles_r,
        key_rows=key_rows,
        keys_read=spread(keys_read),
        keys_remote=spread(keys_read - own),
        cost=tiles_r * (m * model.block_k) + model.token_cost * tokens + model.key_cost * key_rows,
    )


def token_reads(pack: Pack, causal: bool) -> tuple[torch.Tensor, ...]:
    """``read_ranges``' document prefixes as they were found: each document's padding start bisected in
    every rank's positions (``[cp, B]``)."""
    layout = pack.layout
    start, real_len = pack.cu_seqlens_padded[:-1].long(), pack.cu_seqlens.diff().long()
    ends = (start + real_len).expand(layout.shape[0], -1).contiguous()
    last = torch.searchsorted(layout, ends) - 1  # [cp, B] each rank's last position before a document's padding
    position = layout.gather(1, last.clamp(min=0))
    reach = torch.where((last >= 0) & (position >= start), position - start + 1, 0)
    reach = reach if causal else torch.where(reach > 0, real_len, 0)
    reader, doc = reach.nonzero(as_tuple=True)
    return reader, start[doc], start[doc] + reach[reader, doc]


def token_matrix(pack: Pack, causal: bool) -> list[list[int]]:
    """The exchange's count matrix as it was counted: every read bisected in every rank's positions."""
    layout = pack.layout
    cp = layout.shape[0]
    reader, lo, hi = with_idle(pack.cu_seqlens_padded, token_reads(pack, causal), cp)
    first = torch.searchsorted(layout, lo.expand(cp, -1).contiguous())
    n = torch.searchsorted(layout, hi.expand(cp, -1).contiguous()) - first
    return n.new_zeros((cp, cp)).index_add_(0, reader, n.T).tolist()


def test_rank_costs_from_runs_are_the_token_counts():
    for cp, cu in packs(per_cp=2):
        for layout in LAYOUTS:
            for u in [v for v in (1, 2, cp) if cp % v == 0 and (v == 1 or v > 1 and cp > 1)]:
                spec = dataclasses.replace(layout, kv="heads", head_parallel=u) if u > 1 else layout
                for model in MODELS:
                    got, want = rank_costs(cu, cp, spec, None, model), token_costs(cu, spec, cp, model)
                    for name, a, b in zip(RankCosts._fields, got, want, strict=True):
                        assert torch.equal(a, b), (cp, cu.tolist(), spec, model, name, a.tolist(), b.tolist())


def test_runs_pieces_and_the_exchange_matrix_are_the_layouts():
    for cp, cu in packs(seed=1):
        for spec in LAYOUTS:
            pack = Pack.build(cu, None, spec=spec, cp_size=cp)
            runs = layout_runs(pack.layout)
            padded = padded_offsets(cu, spec, cp)
            for got, want in zip(spec_runs(cu, padded, spec, cp), runs, strict=True):  # balanced's from its cuts
                assert torch.equal(got, want), (cp, cu.tolist(), spec)
            row, first, length, doc, pos, real = run_pieces(*runs, cu, padded)
            d, p, r, start = piece_marks(pack.layout, cu, padded)
            at = start.nonzero(as_tuple=True)
            assert torch.equal(row, at[0]) and torch.equal(first, pack.layout[at])
            assert torch.equal(doc, d[at]) and torch.equal(pos, p[at]) and torch.equal(real, r[at])
            assert int(length.sum()) == pack.layout.numel()
            for causal in (True, False):
                want = token_matrix(pack, causal)
                assert exchange_matrix(cu, padded, runs, causal) == want, (cp, cu.tolist(), spec, causal)
                reads, want = read_ranges(pack, (-1, 0) if causal else (-1, -1)), token_reads(pack, causal)
                assert all(torch.equal(a, b) for a, b in zip(reads, want, strict=True)), (cp, cu.tolist(), spec)
                table = torch.zeros(cp, cu.shape[0] - 1, dtype=torch.long)
                doc = torch.searchsorted(padded[:-1].long(), want[1], right=True) - 1
                assert torch.equal(read_lengths(pack, causal), table.index_put_((want[0], doc), want[2] - want[1]))
                if cp > 1:  # decide's floor of the exchange: the ranks' rows of its K/V phases
                    kw = {"cp_size": cp, "strategy": dataclasses.replace(spec, kv="exchange"), "heads": Heads(4, 2)}
                    layer = peer_bytes(cu, causal=causal, **kw)
                    floor = exchange_floor(cu, causal=causal, ranks=tuple(range(cp)), _memo={}, **kw)
                    assert [p.recv for p in floor] == [p.recv for p in layer.phases[:2]], (cp, cu.tolist(), spec)


@pytest.mark.parametrize("heads", [Heads(32, 8), Heads(4, 2, 64, 4)])
def test_pruned_decisions_are_the_full_ones(heads):
    for cp, cu in packs(seed=2, per_cp=1):
        for topology, causal in ((TOPOLOGIES["h200"], True), (TOPOLOGIES["h200-4"], False)):
            full = decide(cu, cp_size=cp, heads=heads, topology=topology, causal=causal)
            pruned = decide(cu, cp_size=cp, heads=heads, topology=topology, causal=causal, prune=True)
            assert (pruned.spec, pruned.time) == (full.spec, full.time), (cp, cu.tolist(), topology, causal)
            assert all(p is None or p == f for p, f in zip(pruned.times, full.times, strict=True))


def test_least_is_the_stable_sorts_first():
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        rows, n, m = (int(torch.randint(1, k, (1,), generator=g)) for k in (5, 70, 40))
        x = torch.randint(0, (3, 50, 1 << 40)[trial % 3], (rows, n), generator=g)
        x[:, :: 1 + trial % 4] = torch.iinfo(torch.long).max  # masked candidates, as balanced's
        assert torch.equal(_least(x, m), torch.argsort(x, dim=1, stable=True)[:, :m])


def test_a_plans_layout_is_kept_for_its_exchange():
    cu = torch.tensor([0, 5, 300, 301, 900], dtype=torch.int32)
    plan = make_plan(cu, cp_size=4, rank=1, strategy=StrategySpec(Strategy.BALANCED))
    kept = layout_of(plan.gather_index, 4)  # the layout the plan was made from, not made again
    assert torch.equal(kept, Pack.build(cu, None, spec=StrategySpec(Strategy.BALANCED), cp_size=4).layout)
    other = plan.gather_index.clone()  # another tensor of the same values: inverted
    assert layout_of(other, 4) is not kept and torch.equal(layout_of(other, 4), kept)

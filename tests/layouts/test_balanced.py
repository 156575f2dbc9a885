"""The balanced layout (``cpcompile.layouts.balanced``) against brute force: every token once, work and
kernel tiles even over ranks, the piece bound, and its op (tests/attention/test_cp_attention.py runs balanced on
gloo ranks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.batch import _to_documents
from cpcompile.layouts import balanced
from cpcompile.layouts.partition import pad_for_cp, piece_marks
from cpcompile.plan.pieces import max_pieces
from tests.fixtures import cu_seqlens
from tests.reference import balanced_brute_force

BALANCED = StrategySpec(Strategy.BALANCED)


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
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=BALANCED)
    assert padded.diff().tolist() == lengths[:-1] + [lengths[-1] + (-sum(lengths)) % cp]  # < cp tokens, at the end
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
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
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=BALANCED)
    work = _work(padded, cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED))
    total = int(work.sum())
    held = work.cumsum(0)[:-1]  # ranks 0..r-1
    share = torch.arange(1, cp) * total / cp
    assert (held - share).abs().max() <= 1.5 * max(padded.diff().tolist())


def _covers(padded: torch.Tensor, layout: torch.Tensor) -> bool:
    """Whether ``layout`` holds every position of the pack once."""
    return torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))


def _rank_tiles(padded: torch.Tensor, layout: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
    """Per rank: the kernel tiles (TILE x TILE) its real pieces visit, as the cost model counts them (``cu``:
    the real offsets; ``None``: every token real)."""
    doc, pos, real, start = piece_marks(layout, padded if cu is None else cu, padded)
    rank, row = start.nonzero(as_tuple=True)
    first = rank * layout.shape[1] + row
    rows = torch.diff(first, append=first.new_full((1,), layout.numel()))
    tiles = balanced.causal_tiles(rows, pos.reshape(-1)[first]) * real.reshape(-1)[first]
    return torch.zeros(layout.shape[0], dtype=torch.long).index_add_(0, rank, tiles)


# Log-normal packs (seed, cp, documents) with at least SNAP_MIN_TOKENS per rank: the layout counts
# kernel tiles. In step 4 a cut's nearest tries would cross the split before it (1: it takes its 2nd,
# 5: its 10th, 28: its 4th, a split without a tail) or the unmoved one after it (168); 0 is plain.
TILE_PACKS = [(1, 8, 400), (5, 8, 400), (0, 4, 400), (28, 8, 400), (168, 8, 200)]


@pytest.mark.parametrize("seed,cp,docs", TILE_PACKS)
def test_balanced_counts_kernel_tiles(seed, cp, docs):
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(docs).log_normal_(5.5, 1.2, generator=g).long() + 1).tolist()
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=BALANCED)
    assert int(padded[-1]) // cp >= balanced.SNAP_MIN_TOKENS
    assert _covers(padded, cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED))
    layout = balanced.balanced_layout(padded, cp, backward=False)  # steps 0-4, as the brute force lays them out
    assert layout.tolist() == balanced_brute_force(padded.diff().tolist(), cp)
    # The busiest rank's tiles: 1.002-1.010 of the mean on these packs (at most 1.013 on 600 such
    # packs); counting pairs, without step 4, 1.009-1.039.
    tiles = _rank_tiles(padded, layout)
    pairs_only = _rank_tiles(padded, torch.tensor(balanced_brute_force(padded.diff().tolist(), cp, min_tokens=10**9)))
    assert tiles.max() <= 1.0125 * tiles.double().mean()
    assert tiles.max() / tiles.double().mean() < pairs_only.max() / pairs_only.double().mean()


@pytest.mark.parametrize("seed,cp,docs", TILE_PACKS[:3])
def test_balanced_counts_kernel_tiles_under_a_capacity(seed, cp, docs):
    """Twice the pack's tokens: the real tiles as even as without a capacity, laid out as the brute force."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(docs).log_normal_(5.5, 1.2, generator=g).long() + 1).tolist()
    cu, padded, layout = _under_capacity(lengths, cp, sum(lengths) // cp, 3, backward=False)
    phys, free = balanced.free_padding(padded.long(), cu.long())
    assert layout.tolist() == balanced_brute_force(phys.diff().tolist(), cp, free=free.tolist())
    tiles = _rank_tiles(padded, layout, cu)
    assert tiles.max() <= 1.0125 * tiles.double().mean()


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_front_cuts_move_to_tiles(seed, cp):
    # 30 documents of 1000-8000 tokens (at least SNAP_MIN_TOKENS per rank), none dealt: step 4 moves
    # front cuts, checked token by token against the brute force, and fewer pieces start off a tile.
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1000, 8000, (30,), generator=g).tolist()
    assert sum(lengths) // cp >= balanced.SNAP_MIN_TOKENS
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=BALANCED)
    assert _covers(padded, cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED))
    layout = balanced.balanced_layout(padded, cp, backward=False)
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
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=4, strategy=BALANCED)
    assert _covers(padded, cpcompile.layouts.all_partition_indices(padded, cp_size=4, strategy=BALANCED))
    layout = balanced.balanced_layout(padded, 4, backward=False)
    assert _covers(padded, layout)
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
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=BALANCED)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([2, 3, 4, 8]), per_document=st.booleans())
def test_balanced_piece_bound(lengths, cp, per_document):
    # Padding inside every document (a dual_chunk_swap offset table) cuts pieces too.
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy="dual_chunk_swap" if per_document else BALANCED)
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    pieces = cpcompile.layouts.partition.piece_marks(layout, cu, padded)[3].sum(1)
    assert int(pieces.max()) <= max_pieces(BALANCED, len(lengths), layout.shape[1])


def _under_capacity(lengths: list[int], cp: int, spare: int, documents: int, backward: bool = True):
    """``(cu, padded, layout)`` of the pack padded to a capacity of ``spare`` more padding multiples (and
    ``documents`` more documents) than it needs, as ``shard_batch`` pads it (``backward=False``: steps 0-4
    alone, as the brute force lays them out)."""
    cu = cu_seqlens(lengths)
    least = int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=BALANCED)[-1])
    spec = StrategySpec(Strategy.BALANCED, capacity=(least + spare * cp, len(lengths) + documents))
    cu = _to_documents(cu, spec.capacity)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    if not backward:
        return cu, padded, balanced.balanced_layout(padded, cp, cu_seqlens=cu, backward=False)
    return cu, padded, cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec, cu_seqlens=cu)


@settings(max_examples=40, deadline=None)
@given(
    lengths=lengths_st,
    cp=st.sampled_from([2, 3, 4, 8]),
    spare=st.sampled_from([0, 1, 50, 400, 3000]),
    documents=st.sampled_from([0, 2]),
)
def test_balanced_under_a_capacity_matches_brute_force(lengths, cp, spare, documents):
    """Under a capacity the padding is a document of its own that costs nothing (``free_padding``)."""
    cu, padded, layout = _under_capacity(lengths, cp, spare, documents)
    assert torch.equal(layout.flatten().sort().values, torch.arange(int(padded[-1])))
    phys, free = balanced.free_padding(padded.long(), cu.long())
    want = balanced_brute_force(phys.diff().tolist(), cp, free=free.tolist())
    assert layout.tolist() == want


@pytest.mark.parametrize("spare", [0, 1, 3])  # capacity = the least padding + spare x the pack's tokens
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("mix", list(_mixes()))
def test_balanced_real_work_is_even_under_a_capacity(mix, cp, spare):
    """The capacity's padding costs no work: the ranks' real work is as even as without a capacity (the
    bound of :func:`test_balanced_work_is_even`); counted as the last document's, it was up to 1.9 x the mean."""
    lengths = _mixes()[mix]
    cu, padded, layout = _under_capacity(lengths, cp, spare * sum(lengths) // cp, 0)
    real = balanced.free_padding(padded.long(), cu.long())  # pairs of real tokens only
    doc, pos, is_real, _ = piece_marks(layout, cu, padded)
    work = torch.where(is_real, pos + 1, 0).sum(-1)
    total = int(work.sum())
    assert total == sum(n * (n + 1) // 2 for n in lengths) and real[1].any() == (int(padded[-1]) > sum(lengths))
    held = work.cumsum(0)[:-1]
    share = torch.arange(1, cp) * total / cp
    assert (held - share).abs().max() <= 1.5 * max(lengths)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([2, 3, 4, 8]), spare=st.sampled_from([0, 1, 50, 400]))
def test_balanced_piece_bound_under_a_capacity(lengths, cp, spare):
    cu, padded, layout = _under_capacity(lengths, cp, spare, 0)
    pieces = cpcompile.layouts.partition.piece_marks(layout, cu, padded)[3].sum(1)
    assert int(pieces.max()) <= max_pieces(BALANCED, len(lengths), layout.shape[1])


def test_balanced_under_a_capacity_needs_the_real_offsets():
    cu, padded, _ = _under_capacity([300, 5], 2, 100, 0)
    spec = StrategySpec(Strategy.BALANCED, capacity=(int(padded[-1]), 2))
    with pytest.raises(ValueError, match=r"balanced under capacity=\(506, 2\) lays the capacity's padding out .*"):
        cpcompile.layouts.all_partition_indices(padded, cp_size=2, strategy=spec)


def test_balanced_layout_op():
    cu = cu_seqlens([700, 5, 1, 300, 8])
    opcheck(torch.ops.cpcompile.balanced_layout.default, (cu, 3, 1014))
    padded = cu.clone()
    padded[-1] = 1200
    opcheck(torch.ops.cpcompile.balanced_layout.default, (padded, 3, 1200, None, cu))
    with FakeTensorMode():  # shapes come from the token count, values are never read
        fake = torch.ops.cpcompile.balanced_layout(torch.empty(6, dtype=torch.int32), 3, 1014)
    assert fake.shape == (3, 338) and fake.dtype == torch.int64


def test_import_cpcompile_registers_every_op():
    """Every ``cpcompile::`` op exists once ``cpcompile`` is imported, in a fresh process: a graph that
    calls one (a cached or saved one, say) must not depend on which of cpcompile's modules ran first.
    ``balanced_layout`` was registered only when a balanced plan was first made."""
    package = Path(cpcompile.__file__).parent
    names = sorted(
        {n for f in package.rglob("*.py") for n in re.findall(r'custom_op\("cpcompile::(\w+)"', f.read_text())}
    )
    assert "balanced_layout" in names and len(names) > 10, names
    probe = f"import cpcompile, torch; [getattr(torch.ops.cpcompile, n) for n in {names!r}]"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_backward_overhead_by_hand():
    # 200 rows from a document's start: 3 forward tiles (128 x 128), 6 backward ones (64 x 128: 1, 1, 2, 2 key
    # tiles) of the same area, 2 key blocks; 100 rows 900 tokens in: 8 and 2 x 8 tiles, 8 key blocks
    fwd, over = balanced.backward_overhead(torch.tensor([0, 900, 5]), torch.tensor([200, 100, 0]))
    assert fwd.tolist() == [3 * 128 * 128, 8 * 128 * 128, 0]
    block = balanced.KEY_BLOCK * 64 * 128  # a key block, in pairs of the backward's tiles
    assert over.tolist() == [5 * 2 * block // 2, 5 * 8 * block // 2, 0]  # an empty run reads nothing


def _forward_backward(padded: torch.Tensor, layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank, counted token by token from its pieces: its forward tiles' area, and twice its forward +
    backward work (``BACKWARD_PER_PAIR_HALVES`` / 2 = 5/2 per pair of the backward's 64 x 128 tiles, and ``KEY_BLOCK``
    backward tiles per key block a piece reads from its document's start)."""
    doc, pos, _, start = piece_marks(layout, padded, padded)
    fwd, both = [], []
    for r in range(layout.shape[0]):
        firsts = start[r].nonzero().squeeze(1).tolist() + [layout.shape[1]]
        f = b = blocks = 0
        for a, e in zip(firsts[:-1], firsts[1:]):
            offset, rows = int(pos[r, a]), e - a
            for q in range(0, rows, 128):  # forward: a query tile reads key tiles up to its last row's
                f += -(-(offset + min(q + 128, rows)) // 128)
            for q in range(0, rows, 64):
                b += -(-(offset + min(q + 64, rows)) // 128)
            blocks += -(-(offset + rows) // 128)
        fwd.append(f * 128 * 128)
        both.append(2 * f * 128 * 128 + 5 * b * 64 * 128 + 5 * balanced.KEY_BLOCK * 64 * 128 * blocks)
    return torch.tensor(fwd), torch.tensor(both)


@pytest.mark.parametrize("seed,cp,docs", [*TILE_PACKS, (7, 8, 0), (9, 4, 0)])
def test_balanced_evens_forward_and_backward(seed, cp, docs):
    """Step 5 on packs of at least SNAP_MIN_TOKENS per rank: the busiest rank's forward + backward work is
    no more than with the forward's tiles even (steps 0-4), and less on most packs; its forward at most
    1 / FORWARD_SLACK more. ``docs`` 0: one long document and many short ones."""
    g = torch.Generator().manual_seed(seed)
    if docs:
        lengths = (torch.empty(docs).log_normal_(5.5, 1.2, generator=g).long() + 1).tolist()
    else:
        short = torch.randint(1, 3000, (40,), generator=g).tolist()
        lengths = [30000, *short[:20], 20000, *short[20:]]
    padded = cpcompile.layouts.pad_for_cp(cu_seqlens(lengths), cp_size=cp, strategy=BALANCED)
    assert int(padded[-1]) // cp >= balanced.SNAP_MIN_TOKENS
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=BALANCED)
    assert _covers(padded, layout)
    forward_only = balanced.balanced_layout(padded, cp, backward=False)
    fwd, both = _forward_backward(padded, layout)
    fwd_before, both_before = _forward_backward(padded, forward_only)
    pieces = int(piece_marks(layout, padded, padded)[3].sum())  # rounding: under one pair per piece
    assert int(both.max()) <= int(both_before.max()) + pieces
    assert int(fwd.max()) <= int(fwd_before.max()) * (balanced.FORWARD_SLACK + 1) // balanced.FORWARD_SLACK
    assert int(piece_marks(layout, padded, padded)[3].sum(1).max()) <= max_pieces(
        BALANCED, len(lengths), layout.shape[1]
    )
    if not torch.equal(layout, forward_only):  # moved: for less forward + backward work on the busiest rank
        assert int(both.max()) < int(both_before.max())
        assert both.max() / both.double().mean() < both_before.max() / both_before.double().mean()


def test_the_cut_search_grid_changes_no_layout(monkeypatch):
    """Step 3 searches 8 front cuts a round where the work of the ranks before a cut never falls (no
    windows): any grid finds the same cut, so the layouts equal those of a 64-way search on random packs
    (1-token and empty documents, padded sizes equal to cp). Windowed packs, where the work can fall as a
    cut moves on, search on the 64-way grid their layouts were measured with."""

    def layouts(ways, cases):
        monkeypatch.setattr(balanced, "_SEARCH_WAYS", ways)
        balanced._runs.clear()
        return [balanced.balanced_layout(padded, cp, windows) for padded, cp, windows in cases]

    g = torch.Generator().manual_seed(3)
    cases = []
    for i in range(40):
        cp = (2, 3, 4, 8)[i % 4]
        lengths = torch.randint(0, 3, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        lengths = lengths * torch.randint(0, 900, lengths.shape, generator=g) + (lengths == 1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
        if cu[-1] > 0:
            cases.append((pad_for_cp(cu, cp_size=cp, strategy="balanced"), cp, ()))
    assert all(torch.equal(a, b) for a, b in zip(layouts(8, cases), layouts(64, cases), strict=True))
    windowed = [(torch.tensor([0, 16], dtype=torch.int32), 16, (3,))]
    assert layouts(8, windowed)[0][13:].flatten().tolist() == [14, 13, 12]  # the 64-way grid's cut
    balanced._runs.clear()

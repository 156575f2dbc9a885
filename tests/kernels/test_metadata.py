"""What the GPU backwards derive from a plan.

The scratch rows and their sums, the row chunks and the forward's longest-first entries,
against loops over the pieces; the chunks and the entries also against the reference kernel
on the whole pieces (float64).
"""

from __future__ import annotations

import pytest
import torch

from cpcompile.kernels import KeyGrads, Pieces, reference, varlen
from cpcompile.kernels.contract import KeyPartials
from cpcompile.kernels.metadata import chunks, order, scratch
from tests.emulated import forward_call, in_place_backward_call

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")


def _prefix_pieces(seed: int):
    """Random pieces as plans make them: each reads a prefix of one document's keys (some none),
    with 0-40 query rows. Returns ``cu_q, k_start, k_len, num_keys``."""
    g = torch.Generator().manual_seed(seed)
    doc_len = torch.randint(1, 60, (8,), generator=g)
    doc_start = torch.cat([doc_len.new_zeros(1), doc_len.cumsum(0)[:-1]])
    doc = torch.randint(0, 8, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
    k_len = (torch.rand(doc.shape[0], generator=g) * (doc_len[doc] + 1)).long().clamp(max=doc_len[doc])
    q_len = torch.randint(0, 40, doc.shape, generator=g)
    cu_q = torch.cat([q_len.new_zeros(1), q_len.cumsum(0)]).to(torch.int32)
    return cu_q, doc_start[doc].to(torch.int32), k_len.to(torch.int32), int(doc_len.sum())


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_scratch_rows_give_each_piece_its_keys_and_add_back_sums_them(seed, device):
    """Document prefixes and windowed bands (odd seeds). On CPU torch's gathers add back, on CUDA
    the ``sum_rows`` kernel."""
    pieces = (_band_pieces if seed % 2 else _prefix_pieces)(seed)
    cu_q, k_start, k_len, num_keys = (t.to(device) if torch.is_tensor(t) else t for t in pieces)
    s = scratch.scratch_rows(cu_q, k_start, k_len, num_keys)
    q_len = (cu_q[1:] - cu_q[:-1]).tolist()
    rows = [n if m else 0 for m, n in zip(q_len, k_len.tolist())]  # pieces without query rows: no gradient
    want = [r for start, n in zip(k_start.tolist(), rows) for r in range(start, start + n)]
    assert s.src.tolist() == [*want, 0] and s.rows == len(want)
    live = [p for p, n in enumerate(rows) if n]
    assert s.live.tolist() == live
    assert (s.max_q, s.max_k) == (max((q_len[p] for p in live), default=0), max(rows))
    live_q = [q_len[p] for p in live]
    assert s.piece_rows == sum(n * n for n in live_q) // max(sum(live_q), 1)  # the rows' mean piece
    assert s.cu.tolist() == [0, *torch.tensor(rows).cumsum(0).tolist()] and s.cu.dtype == torch.int32
    partial = torch.randn(s.rows + 1, 2, 3, dtype=torch.float64).to(torch.bfloat16)
    partial[s.rows] = float("nan")  # the spare row holds no gradient: it must not count
    summed = torch.zeros(num_keys, 2, 3, dtype=torch.float32)
    for row, key in enumerate(want):
        summed[key] += partial[row].float()
    got = scratch.add_back(partial.to(device), s)
    assert torch.equal(got.cpu(), summed)  # a few bf16 terms per key: exact in float32
    order = torch.randperm(num_keys, generator=torch.Generator().manual_seed(seed))
    got = scratch.add_back(partial.to(device), s, order.to(device))  # each key's sum at its place in ``order``
    assert torch.equal(got.cpu(), summed[order])
    read = torch.zeros(num_keys, dtype=torch.bool)  # every piece's keys, also those without query rows (0)
    read[[r for start, n in zip(k_start.tolist(), k_len.tolist()) for r in range(start, start + n)]] = True
    assert torch.equal(s.read.cpu(), read) and s.num_read == int(read.sum())
    # into a buffer: only the rows of keys that pieces read are written, the others kept
    out = torch.full((num_keys, 2, 3), 7.0, device=device)
    got = scratch.add_back(partial.to(device), s, order.to(device), out)
    assert got is out and torch.equal(got.cpu()[read[order]], summed[order][read[order]])
    assert (got.cpu()[~read[order]] == 7).all()
    # a whole dK (kernels without scratch) the same way
    dense = torch.randn(num_keys, 2, 3, dtype=torch.float64).to(torch.bfloat16).to(device)
    assert torch.equal(scratch.place(dense, k_start, k_len).cpu(), dense.float().cpu())
    out = torch.full((num_keys, 2, 3), 7.0, device=device)
    got = scratch.place(dense, k_start, k_len, order.to(device), out).cpu()
    assert torch.equal(got[read[order]], dense.float().cpu()[order][read[order]]) and (got[~read[order]] == 7).all()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_sum_layers_adds_a_second_source_after_the_first_leaving_out_spare_rows(seed, device):
    """Two sources of rows (bf16 and float32, as the exchange's own parts and returned sums), each
    with its own index and ``spare`` (a row of its own, or past its last): every key's rows added in
    order, spare rows never read (NaN there would show); against a float64 loop."""
    g = torch.Generator().manual_seed(seed)
    keys = int(torch.randint(0, 40, (1,), generator=g))
    a = torch.randn(30, 2, 3, generator=g).to(torch.bfloat16)
    b = torch.randn(12, 2, 3, generator=g)
    a[29], index_a = float("nan"), torch.randint(0, 30, (2, keys), generator=g)  # 29: a's spare, a row of it
    index_b = torch.randint(0, 13, (3, keys), generator=g)  # 12: b's spare, past its last row
    want = torch.zeros(keys, 2, 3, dtype=torch.float64)
    for key in range(keys):
        for rows, index, spare in ((a, index_a, 29), (b, index_b, 12)):
            for row in index[:, key].tolist():
                want[key] += 0 if row == spare else rows[row].double()
    more = KeyPartials(b.to(device), index_b.to(device), 12)
    got = scratch.sum_layers(a.to(device), index_a.to(device), 29, more=more)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-6)
    out = torch.full((keys, 2, 3), 7.0, dtype=torch.bfloat16, device=device)  # rounded once, some rows only
    rows = torch.arange(0, keys, 2, device=device)
    scratch.sum_layers(a.to(device), index_a.to(device), 29, out, rows, more)
    torch.testing.assert_close(out.cpu()[::2].double(), want[::2].to(torch.bfloat16).double(), rtol=0, atol=0)
    assert (out.cpu()[1::2] == 7).all()
    # a second source of no rows and no layers (no rank returns any: cp=1) adds nothing
    alone = scratch.sum_layers(a.to(device), index_a.to(device), 29)
    none = KeyPartials(b[:0].to(device), index_b[:0].to(device), 0)
    assert torch.equal(scratch.sum_layers(a.to(device), index_a.to(device), 29, more=none), alone)


def test_key_grads_partial_takes_no_order_or_buffers():
    with pytest.raises(ValueError, match="partial=True"):
        KeyGrads(torch.arange(3), partial=True)
    with pytest.raises(ValueError, match="partial=True"):
        KeyGrads(dk=torch.zeros(3), dv=torch.zeros(3), partial=True)


@pytest.mark.parametrize("seed", range(6))
def test_reference_parts_are_each_keys_gradient_and_none_for_keys_no_piece_reads(seed):
    """A backend without scratch rows (``reference``, as cuDNN and flash on whole documents) gives
    its whole dK/dV as one layer of parts; keys no piece reads have no part, whatever their rows hold."""
    cu_q, k_start, k_len, num_keys = (_band_pieces if seed % 2 else _prefix_pieces)(seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(cu_q[-1]), 2, 4, dtype=torch.float64, generator=g)
    k, v = (torch.randn(num_keys, 1, 4, dtype=torch.float64, generator=g) for _ in range(2))
    p, kw = Pieces(cu_q, k_start, k_len), {"causal": True, "scale": 0.5}
    out, lse = reference.forward(q, k, v, p, **kw)
    dout = torch.randn_like(q)
    want = reference.backward(dout, q, k, v, out, lse, p, **kw)
    got = reference.backward(dout, q, k, v, out, lse, p, grads=KeyGrads(partial=True), **kw)
    read = scratch.keys_read(k_start, k_len, num_keys)
    for parts, whole in zip(got[1:], want[1:]):
        assert parts.index.shape == (1, num_keys) and torch.equal(parts.index[0] == parts.spare, ~read)
        parts.rows[~read] = float("nan")
        torch.testing.assert_close(scratch.sum_partials(parts), whole, rtol=0, atol=0)


def _band_pieces(seed: int):
    """Random pieces as windowed plans make them: a few of each document's consecutive query runs
    ``[a, b)``, in any order, each reading keys ``[a - left, b)`` of its document (``left``
    random, -1: the whole prefix). Returns ``cu_q, k_start, k_len, num_keys``."""
    g = torch.Generator().manual_seed(seed)
    starts, lens, rows, doc_start = [], [], [], 0
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        n = int(torch.randint(1, 80, (1,), generator=g))
        left = int(torch.randint(-1, 30, (1,), generator=g))
        cuts = sorted({0, n, *torch.randint(0, n, (6,), generator=g).tolist()})
        for a, b in zip(cuts, cuts[1:]):
            if torch.rand(1, generator=g) < 0.7:
                lo = 0 if left < 0 else max(0, a - left)
                starts.append(doc_start + lo)
                lens.append(b - lo)
                rows.append(b - a)
        doc_start += n
    order = torch.randperm(len(starts), generator=g)
    q_len = torch.tensor(rows)[order]
    cu_q = torch.cat([q_len.new_zeros(1), q_len.cumsum(0)]).to(torch.int32)
    k_start, k_len = (torch.tensor(t, dtype=torch.int32)[order] for t in (starts, lens))
    return cu_q, k_start, k_len, doc_start


@pytest.mark.parametrize("seed", range(12))
def test_layers_give_overlapping_ranges_different_layers_and_no_more_than_a_key_needs(seed):
    """Document prefixes and windowed bands: one layer's ranges are disjoint, and there are as many
    layers as the most ranges over one key."""
    k_start, k_len = (_prefix_pieces if seed % 2 else _band_pieces)(seed)[1:3]
    got, proper = scratch.layers(k_start, k_len)
    assert bool(proper)
    ranges = [range(a, a + n) for a, n in zip(k_start.tolist(), k_len.tolist())]
    for p, (r, layer) in enumerate(zip(ranges, got.tolist())):
        assert layer == 0 or r, p  # pieces that read nothing: layer 0
        clash = [q for q in range(p) if got[q] == layer and set(ranges[q]) & set(r)]
        assert not clash, (p, clash)
    depth = max((sum(key in r for r in ranges) for key in {k for r in ranges for k in r}), default=1)
    assert max(got.tolist(), default=0) + 1 == depth


def test_scratch_of_no_pieces_is_empty():
    none = torch.zeros(0, dtype=torch.int32)
    s = scratch.scratch_rows(torch.zeros(1, dtype=torch.int32), none, none, 5)
    assert (s.rows, s.max_q, s.max_k, s.num_read, s.live.numel()) == (0, 0, 0, 0, 0)
    assert torch.equal(scratch.add_back(torch.zeros(1, 2, 3), s), torch.zeros(5, 2, 3))


def test_longest_first_of_no_pieces_has_one_empty_entry():
    """No chunks: one entry without rows or keys (a kernel's grid of no entries would be empty)."""
    none = torch.zeros(0, dtype=torch.int32)
    got = order.longest_first(torch.zeros(1, dtype=torch.int32), none, none, 2 * order.ROWS, 5, True)
    assert got.used_q.tolist() == got.used_k.tolist() == [0]
    assert got.cu_q.tolist() == [0, 2 * order.ROWS] and got.cu_k.tolist() == [0, 5]


def test_scratch_refuses_ranges_whose_ends_are_not_in_order():
    """A range nested in a longer one of the same start order (no plan's) is refused, not summed wrong."""
    k_start, k_len = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([10, 3], dtype=torch.int32)
    assert not bool(scratch.layers(k_start, k_len)[1])
    cu_q = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing ends"):
        scratch.scratch_rows(cu_q, k_start, k_len, 12)


def _chunks_case(seed: int):
    cu_q, k_start, k_len, num_keys = _prefix_pieces(seed)
    # a key range at least as long as the rows, as in causal plans (some shorter: rows without keys)
    k_len = torch.maximum(k_len, (cu_q[1:] - cu_q[:-1]) - seed).clamp(max=num_keys - k_start).to(torch.int32)
    num_rows = int(cu_q[-1])
    return cu_q, k_start, k_len, num_keys, num_rows, chunks.row_chunks(cu_q, k_start, k_len, num_rows)


@pytest.mark.parametrize("seed", range(4))
def test_row_chunks_cut_each_piece_into_even_chunks_of_at_most_rows(seed, monkeypatch):
    monkeypatch.setattr(chunks, "ROWS", 8)
    monkeypatch.setattr(chunks, "MAX_CHUNKS", 3)
    cu_q, k_start, k_len, _, num_rows, (chunk_cu, chunk_start, chunk_len) = _chunks_case(seed)
    p = k_len.shape[0]
    assert chunk_cu.shape == (p + num_rows // 8 + 1,) and chunk_cu.dtype == cu_q.dtype
    want_cu, want_start, want_len = [], [], []
    for a, b, start, n in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), k_start.tolist(), k_len.tolist()):
        m = min(max(1, -(-(b - a) // 8)), 3) if n < 2 * (b - a) else 1  # mostly triangle: cut
        for i in range(m):
            lo, hi = (b - a) * i // m, (b - a) * (i + 1) // m
            want_cu.append(a + lo)
            want_start.append(start)
            want_len.append(max(n - (b - a) + hi, 0) if hi > lo else 0)
    extra = chunk_len.shape[0] - len(want_len)
    assert chunk_cu.tolist() == want_cu + [int(cu_q[-1])] * (extra + 1)
    assert chunk_len.tolist() == want_len + [0] * extra
    assert chunk_start.tolist()[: len(want_start)] == want_start


@pytest.mark.parametrize("seed", range(4))
def test_row_chunks_attend_as_their_pieces_do(seed, monkeypatch):
    """Causal attention and its gradients over the chunks equal those over the pieces (float64)."""
    monkeypatch.setattr(chunks, "ROWS", 8)
    cu_q, k_start, k_len, num_keys, num_rows, chunked = _chunks_case(seed)
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(num_rows, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(num_keys, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    kw = {"causal": True, "scale": 0.25}
    results = []
    for plan in (Pieces(cu_q, k_start, k_len), Pieces(*chunked)):
        out, lse = reference.forward(q, k, v, plan, **kw)
        results.append((out, *reference.backward(dout, q, k, v, out, lse, plan, **kw)))
    for whole, by_chunks in zip(*results):
        torch.testing.assert_close(by_chunks, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_place_layers", [1, 16])
@pytest.mark.parametrize("seed", range(16))
def test_in_place_backward_runs_a_call_per_layer_and_equals_the_reference(seed, in_place_layers, monkeypatch):
    """A kernel whose backward takes used rows (FA4's) runs one call per layer of pieces over the keys in
    place, and sums to the reference's gradients (float64), into new tensors or into ``KeyGrads``; rows
    it leaves unwritten hold NaN (torch's fill of uninitialized memory), so reading one would show.
    Pieces out of key order (shuffled), in more layers than ``IN_PLACE_LAYERS``, or leaving more keys
    unread than they copy take the copies. Cases: in key order or shuffled, one layer or several, all
    the keys or only those read (as the exchange brings them)."""
    for name in ("IN_PLACE_LAYERS", "IN_PLACE_LAYERS_GQA"):  # K/V heads 2 or 4 (seed), of 4 query heads
        monkeypatch.setattr(varlen, name, in_place_layers)
    cu_q, k_start, k_len, num_keys = (_band_pieces if seed % 2 else _prefix_pieces)(seed)
    if seed % 4 < 2:  # in key order, as plans make them
        by_key = torch.sort(k_start, stable=True).indices
        q_len = (cu_q[1:] - cu_q[:-1])[by_key]
        cu_q, k_start, k_len = torch.cat([q_len.new_zeros(1), q_len.cumsum(0)]).int(), k_start[by_key], k_len[by_key]
    if seed % 8 >= 4:  # one layer: the pieces of the first read their keys, the others none
        k_len = torch.where(scratch.layers(k_start, k_len)[0] == 0, k_len, 0)
    if seed % 3 == 0:  # only the keys that pieces read, as the sparse exchange brings them
        read = scratch.keys_read(k_start, k_len, num_keys)
        k_start = (read.cumsum(0) - 1).clamp(min=0)[k_start.long().clamp(max=num_keys - 1)].int()
        num_keys = int(read.sum())
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(cu_q[-1]), 4, 8, dtype=torch.float64, generator=g)
    kv_heads = 4 if seed % 5 == 0 else 2
    k, v = (torch.randn(num_keys, kv_heads, 8, dtype=torch.float64, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    p, kw = Pieces(cu_q, k_start, k_len), {"causal": True, "scale": 0.3}
    out, lse = reference.forward(q, k, v, p, **kw)
    want = reference.backward(dout, q, k, v, out, lse, p, **kw)
    s = scratch.scratch_rows(cu_q, k_start, k_len, num_keys)
    assert s.ordered or seed % 4 >= 2
    few_unread = num_keys - s.live_read <= s.rows
    in_place = s.ordered and s.num_layers <= in_place_layers and few_unread
    calls: list = []
    kernel = varlen.VarlenKernel("test", None, in_place_backward_call(calls), in_place_backward=True)
    order = torch.randperm(num_keys, generator=g)
    buffers = [torch.zeros(num_keys, kv_heads, 8, dtype=torch.float64) for _ in range(2)]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # with this, torch.empty fills with NaN
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    try:
        cases = ((None, slice(None)), (KeyGrads(order, *buffers), order), (KeyGrads(partial=True), slice(None)))
        for grads, at in cases:
            calls.clear()
            got = kernel.backward(dout, q, k, v, out, lse, p, grads=grads, **kw)
            if grads is not None and grads.partial:  # the parts (the layers' rows, or the copies'), summed here
                assert all(isinstance(t, KeyPartials) and t.index.shape[1] == num_keys for t in got[1:])
                got = (got[0], *(scratch.sum_partials(t) for t in got[1:]))
            # a call per layer over the keys, or one over the copies; the live pieces alone as entries
            live = s.live.shape[0]
            assert len(calls) == (s.num_layers if in_place else 1) * (live > 0)
            assert all(keys == (num_keys if in_place else s.rows + 1) for _, keys in calls)
            assert sum(rows["seqused_q"].shape[0] for rows, _ in calls) == live
            assert all(bool((rows["seqused_q"] > 0).all()) for rows, _ in calls)
            # the kernel's own dK (a view of its layers' buffer) only where one layer reads every key
            kept = in_place and s.num_layers == 1 and grads is None and s.live_read == num_keys
            assert (got[1]._base is not None) == kept or (grads is not None and grads.partial)
            for name, a, b in zip(("dq", "dk", "dv"), got, (want[0], want[1][at], want[2][at]), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    finally:
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("in_place_layers", [0, 2])
def test_backward_without_live_pieces_launches_nothing_and_gives_zeros(in_place_layers, monkeypatch):
    """A rank whose pieces all lack keys or query rows (padding): no call has entries, so none is
    launched, in place or over the copies; dQ and the dK/dV sums are 0."""
    monkeypatch.setattr(varlen, "IN_PLACE_LAYERS_GQA", in_place_layers)
    cu_q = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    k_start, k_len = torch.tensor([0, 0, 4], dtype=torch.int32), torch.tensor([0, 4, 0], dtype=torch.int32)
    q, dout = torch.randn(5, 2, 4, dtype=torch.float64), torch.randn(5, 2, 4, dtype=torch.float64)
    k, v = torch.randn(6, 1, 4, dtype=torch.float64), torch.randn(6, 1, 4, dtype=torch.float64)
    p, kw = Pieces(cu_q, k_start, k_len), {"causal": True, "scale": 0.3}
    out, lse = reference.forward(q, k, v, p, **kw)
    calls: list = []
    kernel = varlen.VarlenKernel("test", None, in_place_backward_call(calls), in_place_backward=True)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, p, **kw)
    assert calls == []
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert t.abs().sum() == 0, name


@pytest.mark.parametrize("seed", range(8))
def test_longest_first_cuts_live_pieces_into_tile_aligned_chunks_most_keys_first(seed, monkeypatch):
    """Each piece with rows and keys, in chunks of ``ROWS`` rows from its first row, each reading the
    keys up to its last row (all of them when not causal), ordered by those keys (capped at the
    window), most first, ties in row order; as many entries as chunks (one, empty, where there are none)
    where the plan has host twins (CPU tensors are their own), else empty entries up to ``P + Tq // ROWS``."""
    monkeypatch.setattr(order, "ROWS", 8)
    cu_q, k_start, k_len, num_keys = (_band_pieces if seed % 2 else _prefix_pieces)(seed)
    k_len = torch.where(k_len >= cu_q[1:] - cu_q[:-1], k_len, 0)  # a causal piece reads none or a key per row
    causal, left = seed % 4 != 3, (-1 if seed % 3 else 5)
    num_rows = int(cu_q[-1])
    capture = seed % 4 == 1  # no twins (a GPU plan not uploaded, a capture): entries up to the bound
    if capture:
        monkeypatch.setattr(order, "twin", lambda t: None)
    got = order.longest_first(cu_q, k_start, k_len, num_rows, num_keys, causal, left)
    want = []  # (cost, first row, rows, first key, keys), in row order
    for a, b, start, n in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), k_start.tolist(), k_len.tolist()):
        for lo in range(0, b - a if n else 0, 8):
            hi = min(lo + 8, b - a)
            keys = n - (b - a) + hi if causal else n
            want.append((keys if left < 0 else min(keys, left + 1), a + lo, hi - lo, start, keys))
    want.sort(key=lambda e: -e[0])  # stable: ties stay in row order
    e = k_len.shape[0] + num_rows // 8 if capture else max(1, len(want))
    assert got.cu_q.shape == got.cu_k.shape == (e + 1,) and got.used_q.shape == got.used_k.shape == (e,)
    assert all(t.dtype == torch.int32 for t in got)
    empty = e - len(want)
    assert got.used_q.tolist() == [w[2] for w in want] + [0] * empty
    assert got.used_k.tolist() == [w[4] for w in want] + [0] * empty
    assert got.cu_q.tolist()[: len(want)] == [w[1] for w in want] and got.cu_q.tolist()[-1] == num_rows
    assert got.cu_k.tolist()[: len(want)] == [w[3] for w in want] and got.cu_k.tolist()[-1] == num_keys


@pytest.mark.parametrize("seed", range(12))
def test_in_place_forward_runs_chunks_longest_first_and_equals_the_reference(seed, monkeypatch):
    """A kernel that takes used query rows (FA4's) attends over its chunks, longest first, as the
    reference does over the pieces (float64): causal or not, under a window, pieces that read no
    keys or have no rows; rows that no chunk holds (the kernel leaves them unwritten) are 0, lse -inf."""
    monkeypatch.setattr(order, "ROWS", 8)
    cu_q, k_start, k_len, num_keys = (_band_pieces if seed % 2 else _prefix_pieces)(seed)
    k_len = torch.where(k_len >= cu_q[1:] - cu_q[:-1], k_len, 0)  # a causal piece reads none or a key per row
    causal = seed % 4 != 3
    window = (3, 0) if causal and seed % 3 == 0 else (-1, -1)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(cu_q[-1]), 4, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(num_keys, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    p, kw = Pieces(cu_q, k_start, k_len, max_q=int((cu_q[1:] - cu_q[:-1]).max())), {"causal": causal, "scale": 0.3}
    want = reference.forward(q, k, v, p, window=window, **kw)
    kernel = varlen.VarlenKernel("test", forward_call, None, in_place_backward=True)
    got = kernel.forward(q, k, v, p, window=window, **kw)
    for name, a, b in zip(("out", "lse"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)

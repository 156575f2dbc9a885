"""Tier 1: kernel selection and the cuDNN backend's host-side metadata (no GPU needed).

The cuDNN kernel itself runs in tests/test_gpu.py; here its ragged offsets, lengths
and padded statistics are checked against loops over the pieces.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import kernels
from cpcompile.kernels import cudnn, reference
from cpcompile.kernels.triton import dead_rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")


def _pieces(seed: int):
    """Random pieces: lengths (some 0), key starts anywhere in ``num_keys`` rows, overlaps allowed."""
    g = torch.Generator().manual_seed(seed)
    p = int(torch.randint(1, 20, (1,), generator=g))
    q_len = torch.randint(0, 50, (p,), generator=g)
    cu_q = torch.cat([q_len.new_zeros(1), q_len.cumsum(0)]).to(torch.int32)
    num_keys = 300
    k_len = torch.randint(0, 80, (p,), generator=g).to(torch.int32)
    k_start = (torch.rand(p, generator=g) * (num_keys - k_len)).to(torch.int32)
    return cu_q, k_start, k_len, num_keys


@pytest.mark.parametrize("seed", range(5))
def test_ragged_entries_match_the_pieces(seed):
    cu_q, k_start, k_len, num_keys = _pieces(seed)
    p = k_len.shape[0]
    dk_start = torch.cat([k_len.new_zeros(1), k_len.cumsum(0)[:-1]])
    meta = cudnn.ragged(cu_q, k_start, k_len, num_keys, dk_start, int(k_len.sum()))
    b = meta.seq_q.shape[0]
    assert b == cudnn.bucket(p, floor=1) and b >= p and meta.q_rows.shape == (b + 1,)
    for i in range(b):
        if i < p:
            rows = int(cu_q[i + 1] - cu_q[i]) if k_len[i] > 0 else 0  # a piece that sees no key: no entry rows
            want = (rows, int(k_len[i]), int(cu_q[i]), int(k_start[i]), int(dk_start[i]))
        else:  # empty entries: no rows, offsets in bounds
            want = (0, 0, int(cu_q[-1]), 0, 0)
        got = (int(meta.seq_q[i]), int(meta.seq_kv[i]), int(meta.q_rows[i]), int(meta.k_rows[i]), int(meta.dk_rows[i]))
        assert got == want, i
    assert (int(meta.q_rows[b]), int(meta.k_rows[b]), int(meta.dk_rows[b])) == (int(cu_q[-1]), num_keys, k_len.sum())
    assert meta.seq_q.dtype == meta.seq_kv.dtype == torch.int32 and meta.q_rows.dtype == torch.int64
    chosen = torch.arange(p).flip(0)[: (p + 1) // 2]  # some pieces, in another order: the entries
    some = cudnn.ragged(cu_q, k_start, k_len, num_keys, dk_start, int(k_len.sum()), chosen)
    n = chosen.shape[0]
    assert some.seq_q.shape[0] == cudnn.bucket(n, floor=1)
    for i, piece in enumerate(chosen.tolist()):
        fields = ("seq_q", "seq_kv", "q_rows", "k_rows", "dk_rows")
        assert [int(getattr(some, f)[i]) for f in fields] == [int(getattr(meta, f)[piece]) for f in fields]


@pytest.mark.parametrize("seed", range(3))
def test_plan_entries_go_longest_key_range_first(seed):
    """Without a scratch, a plan's entries are its pieces by key range, longest first; pieces
    without rows or keys last, each group in plan order."""
    cu_q, k_start, k_len, num_keys = _pieces(seed)
    meta = cudnn._plan_ragged(cu_q, k_start, k_len, num_keys)
    q_len = (cu_q[1:] - cu_q[:-1]).tolist()
    live = sorted((-int(k_len[i]), i) for i in range(len(q_len)) if q_len[i] and k_len[i])
    order = [i for _, i in live] + [i for i in range(len(q_len)) if not (q_len[i] and k_len[i])]
    plain = cudnn.ragged(cu_q, k_start, k_len, num_keys)
    fields = ("seq_q", "seq_kv", "q_rows", "k_rows")
    for entry, piece in enumerate(order):
        assert [int(getattr(meta, f)[entry]) for f in fields] == [int(getattr(plain, f)[piece]) for f in fields]
    assert meta.seq_q.shape == plain.seq_q.shape  # the same grid: empty entries after the pieces
    assert int(meta.q_rows[-1]) == int(cu_q[-1]) and int(meta.k_rows[-1]) == num_keys


@pytest.mark.parametrize("seed", range(3))
def test_padded_lse_places_each_row(seed):
    cu_q, k_start, k_len, _ = _pieces(seed)
    tq, hq = int(cu_q[-1]), 3
    lse = torch.randn(hq, tq)
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    b, s_q = cudnn.bucket(q_len.shape[0], floor=1), cudnn.bucket(int(q_len.max()))
    got = cudnn.padded_lse(lse, cu_q[:-1], q_len, b, s_q)
    want = torch.zeros(b, hq, s_q, 1)
    for i, n in enumerate(q_len.tolist()):
        want[i, :, :n, 0] = lse[:, int(cu_q[i]) : int(cu_q[i]) + n]
    assert torch.equal(got, want)


def test_bucket_rounds_up_by_less_than_an_eighth():
    assert [cudnn.bucket(n) for n in (1, 64, 65, 128, 1000, 17410)] == [64, 64, 72, 128, 1024, 18432]
    assert [cudnn.bucket(n, floor=1) for n in (3, 17)] == [3, 18]
    sizes = range(1, 5000)
    assert all(n <= cudnn.bucket(n, 1) < n * 1.125 + 1 for n in sizes)
    assert len({cudnn.bucket(n, 1) for n in range(1025, 2049)}) == 8  # graphs per doubling


def test_live_rows_marks_rows_that_see_a_key():
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    k_len = torch.tensor([0, 4, 1], dtype=torch.int32)
    assert dead_rows.live_rows(cu_q, k_len, 5).tolist() == [False, False, True, True, True]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("shape", [(100, 3), (70, 12, 128)])  # 1536 columns: a store of 1024, then 512
def test_dead_rows_zero_sets_those_rows_alone(device, shape):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(shape, generator=g).to(torch.bfloat16)
    live = torch.rand(shape[0], generator=g) < 0.7
    live[:40] = True  # a program of 32 rows with none dead: it must store nothing
    got = dead_rows.zero(t.to(device), live.to(device)).cpu()
    assert torch.equal(got[live], t[live]) and (got[~live] == 0).all()
    assert torch.equal(dead_rows.zero(t.to(device)[:, :2], live.to(device)).cpu(), got[:, :2])  # strided


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize(("rows", "heads"), [(100, 3), (130, 16)])  # programs of 64 rows, the last one partial
def test_dead_rows_finish_transposes_statistics_and_clears_dead_rows(device, rows, heads):
    g = torch.Generator().manual_seed(2)
    out = torch.randn(rows, heads, 8, generator=g).to(torch.bfloat16)
    stats = torch.randn(rows, heads, generator=g)
    live = torch.rand(rows, generator=g) < 0.7
    live[:64] = True  # a program with no dead row: it must store no output row
    stats[~live] = float("nan")  # rows no entry wrote hold whatever the buffer held
    got = out.to(device)
    lse = dead_rows.finish(got, stats.to(device), live.to(device)).cpu()
    expected = [[stats[r, h].item() if live[r] else float("-inf") for r in range(rows)] for h in range(heads)]
    assert lse.is_contiguous() and lse.tolist() == expected
    got = got.cpu()
    assert torch.equal(got[live], out[live]) and (got[~live] == 0).all()


def test_select_names_the_kernel_and_what_is_accepted(monkeypatch):
    q = torch.zeros(4, 2, 8)
    assert kernels.select(q) is reference and kernels.select(q, "reference") is reference
    accepted = r"\('reference', 'flash', 'cudnn', 'auto'\)"
    with pytest.raises(ValueError, match=rf"kernel must be one of {accepted}, got 'fast'"):
        kernels.select(q, "fast")
    with pytest.raises(ValueError, match="kernel 'cudnn' needs CUDA fp16/bf16 tensors, got torch.float32 on cpu"):
        kernels.select(q, "cudnn")
    monkeypatch.setenv("CPCOMPILE_KERNEL", "cudnn")
    assert kernels.select(q) is reference  # the name comes from the caller, not the environment


def test_auto_takes_cudnns_backward_where_pieces_read_many_keys_per_row_within_memory():
    from cpcompile.kernels import auto

    t = 131072
    assert auto.use_cudnn_backward(int(1.06 * t), t)  # dual_chunk_swap at cp=8
    assert auto.use_cudnn_backward(int(0.31 * t), t)  # balanced at cp=8
    assert auto.use_cudnn_backward(2 * t, t)
    assert not auto.use_cudnn_backward(int(3.9 * t), t)  # 128-token stripes: cuDNN's scratch too big


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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_scratch_rows_give_each_piece_its_keys_and_add_back_sums_them(seed, device):
    """On CPU torch's gathers add back, on CUDA the ``sum_rows`` kernel."""
    from cpcompile.kernels.metadata import scratch

    cu_q, k_start, k_len, num_keys = (t.to(device) if torch.is_tensor(t) else t for t in _prefix_pieces(seed))
    s = scratch.scratch_rows(cu_q, k_start, k_len, num_keys)
    q_len = (cu_q[1:] - cu_q[:-1]).tolist()
    rows = [n if m else 0 for m, n in zip(q_len, k_len.tolist())]  # pieces without query rows: no gradient
    want = [r for start, n in zip(k_start.tolist(), rows) for r in range(start, start + n)]
    assert s.src.tolist() == [*want, 0] and s.rows == len(want)
    live = [p for p, n in enumerate(rows) if n]
    assert s.live.tolist() == live
    assert (s.max_q, s.max_k) == (max((q_len[p] for p in live), default=0), max(rows))
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


@CUDA
def test_sum_rows_kernel_adds_each_keys_rows_over_layers_and_column_blocks():
    from cpcompile.kernels.triton import sum_rows

    g = torch.Generator().manual_seed(0)
    rows, num_layers, keys = 300, 5, 97
    partial = torch.randn(rows + 1, 12, 128, generator=g).to(torch.bfloat16)  # 1536 columns: 1024 + 512
    partial[rows] = float("nan")  # the spare row: "no row in this layer", never read
    index = torch.randint(0, rows + 1, (num_layers, keys), generator=g)
    want = torch.zeros(keys, 12, 128)
    for layer in range(num_layers):
        for key in range(keys):
            if index[layer, key] != rows:
                want[key] += partial[index[layer, key]].float()
    assert torch.equal(sum_rows.sum_rows(partial.cuda(), index.cuda(), rows).cpu(), want)  # same order: exact
    some = torch.tensor([0, 5, 96, 40])  # only these keys, into a given tensor
    out = torch.full((keys, 12, 128), 7.0, device="cuda")
    assert sum_rows.sum_rows(partial.cuda(), index.cuda(), rows, out, some.cuda()) is out
    rest = torch.ones(keys, dtype=torch.bool)
    rest[some] = False
    assert torch.equal(out.cpu()[some], want[some]) and (out.cpu()[rest] == 7).all()
    rounded = torch.empty(keys, 12, 128, dtype=torch.bfloat16, device="cuda")  # float32 sums, rounded once
    assert torch.equal(sum_rows.sum_rows(partial.cuda(), index.cuda(), rows, rounded).cpu(), want.bfloat16())


def test_auto_backward_picks_cudnn_where_its_scratch_fits(monkeypatch):
    from cpcompile.kernels import auto, cudnn, flash

    picked = []
    monkeypatch.setattr(cudnn, "backward", lambda *args, **kw: picked.append("cudnn"))
    monkeypatch.setattr(flash, "backward", lambda *args, **kw: picked.append("flash"))

    def pick(q_len, k_start, k_len, num_keys, causal=True, disjoint_keys=True):
        cu_q = torch.tensor([0, *torch.tensor(q_len).cumsum(0).tolist()], dtype=torch.int32)
        q, k = torch.empty(int(cu_q[-1]), 1, 8), torch.empty(num_keys, 1, 8)
        as_int32 = (torch.tensor(x, dtype=torch.int32) for x in (k_start, k_len))
        auto.backward(q, q, k, k, q, None, cu_q, *as_int32, causal=causal, scale=1.0, disjoint_keys=disjoint_keys)
        return picked.pop()

    assert pick([16384], [0], [16384], 16384, causal=False) == "cudnn"  # in place, no scratch
    assert pick([16384], [0], [16384], 16384) == "flash"  # 4 row chunks: 2.5 scratch rows per key
    assert pick([5000], [0], [5000], 5000) == "cudnn"  # 3 row chunks: 9999 rows for 5000 keys
    starts = [i * 1000 for i in range(16)]
    assert pick([1000] * 16, starts, [1000] * 16, 16000) == "cudnn"  # short documents: one row per key
    assert pick([10] * 40, [0] * 40, [1000] * 40, 1000, disjoint_keys=False) == "flash"  # stripes: 40 per key


@pytest.mark.parametrize("seed", range(4))
def test_layers_number_the_pieces_that_share_a_start(seed):
    from cpcompile.kernels.metadata import scratch

    _, k_start, k_len, _ = _prefix_pieces(seed)
    got = scratch.layers(k_start, k_len).tolist()
    seen: dict[int, int] = {}
    for p, (start, n) in enumerate(zip(k_start.tolist(), k_len.tolist())):
        assert got[p] == (seen.get(start, 0) if n else 0), p
        if n:
            seen[start] = seen.get(start, 0) + 1


def test_every_plan_reads_disjoint_or_same_start_key_ranges():
    """The contract the scratch layers rely on, for every strategy, all-gather and ring."""
    from cpcompile.ring_plan import make_ring_plan

    cu = torch.tensor([0, 1, 700, 829, 2877, 2941], dtype=torch.int32)
    specs = [
        "dual_chunk_swap",
        "no_load_balance",
        "balanced",
        cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, stripe_size=16),
    ]
    for spec, cp, causal in ((s, cp, c) for s in specs for cp in (2, 4) for c in (True, False)):
        padded = cpcompile.pad_for_cp(cu, cp_size=cp, strategy=spec)
        for rank in range(cp):
            plan = cpcompile.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
            ring = make_ring_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
            blocks = [(plan.k_start, plan.k_len(causal)), *zip(ring.k_start, ring.k_len(causal))]
            for k_start, k_len in blocks:
                ranges = [(a, a + n) for a, n in zip(k_start.tolist(), k_len.tolist()) if n > 0]
                for a0, a1 in ranges:
                    assert all(b0 == a0 or a1 <= b0 or b1 <= a0 for b0, b1 in ranges), (spec, cp, rank)


def _chunks_case(seed: int):
    from cpcompile.kernels.metadata import chunks

    cu_q, k_start, k_len, num_keys = _prefix_pieces(seed)
    # a key range at least as long as the rows, as in causal plans (some shorter: rows without keys)
    k_len = torch.maximum(k_len, (cu_q[1:] - cu_q[:-1]) - seed).clamp(max=num_keys - k_start).to(torch.int32)
    num_rows = int(cu_q[-1])
    return cu_q, k_start, k_len, num_keys, num_rows, chunks.row_chunks(cu_q, k_start, k_len, num_rows)


@pytest.mark.parametrize("seed", range(4))
def test_row_chunks_cut_each_piece_into_even_chunks_of_at_most_rows(seed, monkeypatch):
    from cpcompile.kernels.metadata import chunks

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
    from cpcompile.kernels.metadata import chunks

    monkeypatch.setattr(chunks, "ROWS", 8)
    cu_q, k_start, k_len, num_keys, num_rows, pieces = _chunks_case(seed)
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(num_rows, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(num_keys, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    kw = {"causal": True, "scale": 0.25}
    results = []
    for plan in ((cu_q, k_start, k_len), pieces):
        out, lse = reference.forward(q, k, v, *plan, **kw)
        results.append((out, *reference.backward(dout, q, k, v, out, lse, *plan, **kw)))
    for whole, chunked in zip(*results):
        torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)

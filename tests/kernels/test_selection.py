"""Kernel selection, ``auto``'s choice and the cuDNN backend's host-side metadata (no GPU needed).

The cuDNN kernel itself runs in tests/kernels/test_accuracy.py; here its ragged offsets, lengths
and padded statistics are checked against loops over the pieces.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import kernels
from cpcompile.kernels import auto, cudnn, flash, reference


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


def test_select_names_the_kernel_and_what_is_accepted(monkeypatch):
    q = torch.zeros(4, 2, 8)
    assert kernels.select(q) is reference and kernels.select(q, "reference") is reference
    accepted = r"\('reference', 'flash', 'cudnn', 'fa4', 'auto'\)"
    with pytest.raises(ValueError, match=rf"kernel must be one of {accepted}, got 'fast'"):
        kernels.select(q, "fast")
    with pytest.raises(ValueError, match="kernel 'cudnn' needs CUDA fp16/bf16 tensors, got torch.float32 on cpu"):
        kernels.select(q, "cudnn")
    monkeypatch.setenv("CPCOMPILE_KERNEL", "cudnn")
    assert kernels.select(q) is reference  # the name comes from the caller, not the environment
    # ... from the caller's kernel argument, all the way through an op
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="kernel 'cudnn' needs CUDA fp16/bf16 tensors"):
        cpcompile.packed_attention(q, q, q, cu, kernel="cudnn")


def test_auto_takes_fa4s_backward_on_long_pieces():
    # Scratch.piece_rows of the ranks' pieces on ProLong packs of 128K tokens, against which layouts' backward
    # FA4 won on the H200 (docs/attention-kernels.md, "FlashAttention-4")
    for rows in (3777, 6458, 2941, 3320, 3701, 6585):  # balanced and no_load_balance, cp 2 and 8: FA4's
        assert auto.use_fa4_backward(rows)
    assert auto.use_fa4_backward(1486) and auto.use_fa4_backward(2857)  # dual_chunk_swap at cp=2: FA4's
    assert not auto.use_fa4_backward(279) and not auto.use_fa4_backward(536)  # dual_chunk_swap at cp=8: cuDNN's
    assert not auto.use_fa4_backward(126)  # stripes of 128: cuDNN's


def test_auto_takes_cudnns_backward_where_pieces_read_many_keys_per_row_within_memory():
    t = 131072
    assert auto.use_cudnn_backward(int(1.06 * t), t)  # dual_chunk_swap at cp=8
    assert auto.use_cudnn_backward(int(0.31 * t), t)  # balanced at cp=8
    assert auto.use_cudnn_backward(2 * t, t)
    assert not auto.use_cudnn_backward(int(3.9 * t), t)  # 128-token stripes: cuDNN's scratch too big


def test_auto_backward_picks_cudnn_where_its_scratch_fits(monkeypatch):
    picked = []
    monkeypatch.setattr(cudnn, "backward", lambda *args, **kw: picked.append("cudnn"))
    monkeypatch.setattr(flash, "backward", lambda *args, **kw: picked.append("flash"))

    def pick(q_len, k_start, k_len, num_keys, causal=True, disjoint_keys=True):
        cu_q = torch.tensor([0, *torch.tensor(q_len).cumsum(0).tolist()], dtype=torch.int32)
        q, k = torch.empty(int(cu_q[-1]), 1, 8), torch.empty(num_keys, 1, 8)
        as_int32 = (torch.tensor(x, dtype=torch.int32) for x in (k_start, k_len))
        pieces = kernels.Pieces(cu_q, *as_int32, disjoint_keys=disjoint_keys)
        auto.backward(q, q, k, k, q, None, pieces, causal=causal, scale=1.0)
        return picked.pop()

    assert pick([16384], [0], [16384], 16384, causal=False) == "cudnn"  # in place, no scratch
    assert pick([16384], [0], [16384], 16384) == "flash"  # 4 row chunks: 2.5 scratch rows per key
    assert pick([5000], [0], [5000], 5000) == "cudnn"  # 3 row chunks: 9999 rows for 5000 keys
    starts = [i * 1000 for i in range(16)]
    assert pick([1000] * 16, starts, [1000] * 16, 16000) == "cudnn"  # short documents: one row per key
    assert pick([10] * 40, [0] * 40, [1000] * 40, 1000, disjoint_keys=False) == "flash"  # stripes: 40 per key


def test_flash_and_cudnn_refuse_what_only_fa4_and_the_reference_run():
    """Values of their own head dim and soft-capping: the kernels without them raise, naming the variant,
    before touching a GPU (``kernels.select`` passes them over: FA4 or the reference runs such calls)."""
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q, v = torch.randn(4, 2, 8), torch.randn(4, 2, 4)
    pieces, kw = kernels.Pieces(cu, cu[:-1], cu[1:] - cu[:-1]), {"causal": True, "scale": 0.5}
    for kernel in (flash, cudnn):
        name = kernel.__name__.rsplit(".", 1)[1]
        with pytest.raises(ValueError, match=rf"kernel '{name}' cannot run a value head dim \(4\) other than"):
            kernel.forward(q, q, v, pieces, **kw)
        with pytest.raises(ValueError, match=rf"kernel '{name}' cannot run logit soft-capping \(softcap=2.0\)"):
            kernel.backward(q, q, q, q, q, q[:, :, 0].t(), pieces, softcap=2.0, **kw)
    assert reference.forward(q, q, v, pieces, softcap=2.0, **kw)[0].shape == (4, 2, 4)

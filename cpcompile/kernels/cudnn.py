"""cuDNN's fused attention (cudnn-frontend graph API) behind the kernel contract (``contract``).

Each piece is one entry of cuDNN's ragged (THD) batch: it reads its query rows
at ``cu_q[p]`` and its keys at ``k_start[p]`` through per-entry ragged offsets,
with ``seq_len_q = q_len`` and ``seq_len_kv = k_len``, and the causal band is
aligned bottom-right per entry, which is exactly the contract's mask. So
the forward is one call that copies nothing, even where pieces' key ranges
overlap (they are only read).

The entries go longest key range first. The forward (on Hopper) is one persistent
CTA per SM, each taking the next query tile (of an entry and head), about in entry
order, as it finishes one; a tile's time grows with the keys it reads, so a long one
placed late runs on alone at the end. A rank's pieces are few and their key ranges
differ most (a document's last piece reads all of it), so the order counts more
there than on one device (docs/attention-kernels.md, "cuDNN's forward").

A piece that sees no keys (padding) is an empty entry: cuDNN would write NaN
rows for it, so its rows are left alone, and then set to 0, its lse to -inf, in
the kernel that transposes the statistics (``triton.dead_rows.finish``). Every other
row's statistics are cuDNN's: plans never make a causal piece with keys but
fewer than its rows (whose first rows would see none).

The backward writes dK/dV at their own ragged offsets. Where pieces are not causal
and their key ranges are consecutive (``disjoint_keys``) those are the keys' rows.
Causal pieces run as row chunks (``metadata.chunks``: cuDNN is slow on whole causal
documents), even where their keys are read once, as on one device: there too the
chunks are faster than whole documents and than flash.
Each chunk, and each piece sharing keys, writes into its own rows of a scratch
buffer (``metadata.scratch``: ``sum(k_len)`` rows, reading that size is this
module's one host sync) whose sums go back to the keys.
Unlike the flash backend, K and V themselves are never copied. cuDNN writes dK/dV
in the input dtype only (its planner declines float32 gradients), so, as with
flash, each piece's partial sum is rounded once before the float32 sums.

A cuDNN graph is fixed to its dimensions and takes a while to build, so graphs
are cached, and the dimensions that change from pack to pack are rounded up
(:func:`bucket`): the number of pieces (extra entries have length 0), the longest
piece's query and key rows, and the token totals the backward's dQ accumulator is
sized by. A few graphs then serve every pack. The rounding is fine-grained (at most
1/8 over, not to the next power of two) because the grids are sized by these bounds,
and loose ones make the kernels measurably slower (docs/attention-kernels.md).
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from cpcompile.cache import per_plan, readable
from cpcompile.kernels.contract import Pieces, check_options, gpu_window, refuse_variant
from cpcompile.kernels.metadata.chunks import row_chunks
from cpcompile.kernels.metadata.scratch import add_back_grads, place_grads, scratch_rows
from cpcompile.kernels.sinks import joined
from cpcompile.kernels.triton import dead_rows

_DTYPES = (torch.float16, torch.bfloat16)
_tls = threading.local()  # cuDNN handles must not be shared between threads


def bucket(n: int, floor: int = 64) -> int:
    """``max(n, floor)`` rounded up to a multiple of 1/8 of its power of two (at most 1/8 more).

    A graph dimension that varies per pack: 8 values per doubling.
    """
    n = max(int(n), floor)
    step = 1 << max(n.bit_length() - 4, 0)  # n in [8 step, 16 step)
    return -(-n // step) * step


class Ragged(NamedTuple):
    """Per-entry metadata of one call: ``n`` pieces, then empty entries up to ``B = bucket(n)``.

    ``seq_q``/``seq_kv`` ``[B, 1, 1, 1]`` int32 (0 rows for pieces that see no
    keys); ``q_rows``/``k_rows``/``dk_rows`` ``[B + 1]`` int64 first row of each
    entry (last: the buffer's end) in Q/O, K/V and dK/dV; ``q_len`` ``[n]`` int64.
    """

    seq_q: torch.Tensor
    seq_kv: torch.Tensor
    q_rows: torch.Tensor
    k_rows: torch.Tensor
    dk_rows: torch.Tensor
    q_len: torch.Tensor


def ragged(cu_q, k_start, k_len, num_keys: int, dk_start=None, num_dk: int | None = None, pieces=None) -> Ragged:
    """:class:`Ragged` for pieces ``cu_q [P + 1]``, ``k_start``/``k_len [P]`` over ``num_keys`` key rows.

    ``dk_start [P]``: first dK/dV row of each piece in a buffer of ``num_dk`` rows;
    default: the keys' own rows. ``pieces [n]``: the pieces that become entries, in
    order (default: all); fewer entries make smaller grids.
    """
    q_start, q_len = cu_q[:-1].long(), (cu_q[1:] - cu_q[:-1]).long()
    if pieces is not None:
        q_start, q_len, k_start, k_len = q_start[pieces], q_len[pieces], k_start[pieces], k_len[pieces]
        dk_start = None if dk_start is None else dk_start[pieces]
    p = k_len.shape[0]
    b = bucket(p, floor=1)

    def entries(values: torch.Tensor, end: int) -> torch.Tensor:
        # built with device fills only: writing a Python int into a CUDA tensor is a
        # host-to-device copy that waits for the stream, once per call and layer
        fill = values.new_zeros(b - p, dtype=torch.int64)
        return torch.cat([values.long(), fill, fill.new_full((1,), end)])

    seq_q = entries(q_len.masked_fill(k_len == 0, 0), 0)[:b].to(torch.int32).view(b, 1, 1, 1)
    seq_kv = entries(k_len, 0)[:b].to(torch.int32).view(b, 1, 1, 1)
    # empty entries point at the end of Q: no row is read, every offset stays in bounds
    q_rows = torch.cat([q_start, cu_q[-1:].long().expand(b + 1 - p)])
    k_rows = entries(k_start, num_keys)
    dk_rows = k_rows if dk_start is None else entries(dk_start, num_dk)
    return Ragged(seq_q, seq_kv, q_rows, k_rows, dk_rows, q_len)


@per_plan
def _plan_ragged(cu_q, k_start, k_len, num_keys: int, scratch_cu=None, scratch_size: int = 0, live=None) -> Ragged:
    """:func:`ragged` of a plan, built once for all layers; with a scratch (its ``cu``, ``rows``
    and ``live``), dK/dV in its rows and only the pieces that see keys as entries.

    Without one (the forward, and the backward in place) the entries go longest key
    range first: the CTAs that run longest start first (see the module docstring).
    """
    if scratch_cu is None:
        key_range = k_len.masked_fill(cu_q[1:] == cu_q[:-1], 0)  # pieces without rows or keys: last
        return ragged(cu_q, k_start, k_len, num_keys, pieces=torch.argsort(key_range, descending=True, stable=True))
    return ragged(cu_q, k_start, k_len, num_keys, scratch_cu[:-1], scratch_size + 1, live)  # and the spare row


def padded_lse(lse: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, b: int, s_q: int) -> torch.Tensor:
    """``lse [Hq, Tq]`` -> ``[B, Hq, S_q, 1]`` (entry, head, row of the piece): the backward's layout.

    Entry ``p`` is rows ``[q_start[p], q_start[p] + q_len[p])`` (``[P]`` each). Rows past
    a piece's end (and empty entries) hold 0; the kernel never reads them.
    """
    index, valid = _lse_rows(q_start, q_len, s_q, lse.shape[1])
    picked = lse[:, index].masked_fill(~valid, 0)  # [Hq, P, S_q]
    out = lse.new_zeros(b, lse.shape[0], s_q)
    out[: q_len.shape[0]] = picked.permute(1, 0, 2)
    return out.unsqueeze(-1)


@per_plan
def _lse_rows(q_start, q_len, s_q: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's part of :func:`padded_lse`, built once for all layers: ``[P, S_q]`` the
    ``lse`` column of each (entry, row), kept in bounds, and whether the row is the piece's."""
    rows = torch.arange(s_q, device=q_len.device)
    index = q_start[: q_len.shape[0]].long()[:, None] + rows
    return index.clamp(max=max(num_rows - 1, 0)), rows < q_len[:, None]


def available() -> bool:
    """Whether cudnn-frontend imports (the ``gpu`` extra)."""
    try:
        import cudnn  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def _handle(device: torch.device):
    import cudnn

    handles = _tls.__dict__.setdefault("handles", {})
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device]


# tensor uids of both graphs
_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
_SEQ_Q, _SEQ_KV, _OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_STATS, _OFF_DQ, _OFF_DK, _OFF_DV = range(20, 30)


class _Shape(NamedTuple):
    dtype: torch.dtype
    b: int
    hq: int
    hkv: int
    d: int
    s_q: int
    s_kv: int
    causal: bool
    window: tuple[int, int]  # ``contract.gpu_window``'s: (-1, -1) none
    scale: float
    device: torch.device
    kv_stride: tuple[int, int]  # (token, head) strides of K and V


def _graph(shape: _Shape):
    """An empty graph, and a ``rows(name, uid, heads, s, offset_uid[, stride])`` maker of ragged row tensors."""
    import cudnn

    io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[shape.dtype]
    g = cudnn.pygraph(
        handle=_handle(shape.device),
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    offsets = {}

    def rows(name, uid, heads, s, offset_uid, stride=None):
        # [B, H, S, D] over [T, H, D] rows (token and head strides: ``stride``, default
        # packed), each entry's first row from its ragged offset (in elements), so the
        # batch stride is unused
        token, head = stride or (heads * shape.d, shape.d)
        dim = [shape.b, heads, s, shape.d]
        t = g.tensor(name=name, dim=dim, stride=[s * token, head, token, 1], data_type=io, uid=uid)
        if offset_uid not in offsets:
            offsets[offset_uid] = _column(g, offset_uid, shape.b + 1, cudnn.data_type.INT64)
        t.set_ragged_offset(offsets[offset_uid])
        return t

    return g, rows


def _stride(heads: int, s: int, d: int) -> list[int]:
    return [s * heads * d, d, heads * d, 1]


def _column(g, uid: int, length: int, dtype):
    return g.tensor(name=f"column_{uid}", dim=[length, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype, uid=uid)


def _sdpa_args(g, shape: _Shape) -> dict:
    """Lengths, padding mask and the bottom-right causal band: shared by both graphs."""
    import cudnn

    args = {
        "attn_scale": shape.scale,
        "use_padding_mask": True,
        "seq_len_q": _column(g, _SEQ_Q, shape.b, cudnn.data_type.INT32),
        "seq_len_kv": _column(g, _SEQ_KV, shape.b, cudnn.data_type.INT32),
    }
    left, right = shape.window
    if shape.causal:
        right = 0
    if (left, right) != (-1, -1):
        # a window with keys past the query runs on whole documents only (``contract.gpu_window``),
        # where the alignments agree: top-left there, which cuDNN takes with both bounds
        aligned = cudnn.diagonal_alignment.BOTTOM_RIGHT if right == 0 else cudnn.diagonal_alignment.TOP_LEFT
        args["diagonal_alignment"] = aligned
    if right >= 0:
        args["diagonal_band_right_bound"] = right
    if left >= 0:  # cuDNN's bound counts the diagonal: key j is seen from row i when i - j < bound
        args["diagonal_band_left_bound"] = left + 1
    return args


@functools.lru_cache(maxsize=64)
def _forward_graph(shape: _Shape):
    import cudnn

    g, rows = _graph(shape)
    b, hq, hkv, d, s_q, s_kv = shape.b, shape.hq, shape.hkv, shape.d, shape.s_q, shape.s_kv
    q = rows("q", _Q, hq, s_q, _OFF_Q)
    k, v = (rows(n, uid, hkv, s_kv, off, shape.kv_stride) for n, uid, off in (("k", _K, _OFF_K), ("v", _V, _OFF_V)))
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **_sdpa_args(g, shape))
    o.set_uid(_O).set_output(True).set_dim([b, hq, s_q, d]).set_stride(_stride(hq, s_q, d))
    o.set_ragged_offset(_column(g, _OFF_O, b + 1, cudnn.data_type.INT64))
    # statistics [T, H, 1] token-major, like the rows
    stats.set_uid(_STATS).set_output(True).set_dim([b, hq, s_q, 1]).set_stride([s_q * hq, 1, hq, 1])
    stats.set_data_type(cudnn.data_type.FLOAT)
    stats.set_ragged_offset(_column(g, _OFF_STATS, b + 1, cudnn.data_type.INT64))
    return _built(g)


@functools.lru_cache(maxsize=64)
def _backward_graph(shape: _Shape, total_q: int, total_kv: int):
    import cudnn

    g, rows = _graph(shape)
    b, hq, hkv, d, s_q, s_kv = shape.b, shape.hq, shape.hkv, shape.d, shape.s_q, shape.s_kv
    q = rows("q", _Q, hq, s_q, _OFF_Q)
    k, v = (rows(n, uid, hkv, s_kv, off, shape.kv_stride) for n, uid, off in (("k", _K, _OFF_K), ("v", _V, _OFF_V)))
    o, do = rows("o", _O, hq, s_q, _OFF_O), rows("do", _DO, hq, s_q, _OFF_O)
    # the backward takes padded statistics [B, H, S_q, 1] (packed ones are not accepted on every GPU)
    stats = g.tensor(
        name="stats", dim=[b, hq, s_q, 1], stride=[hq * s_q, s_q, 1, 1], data_type=cudnn.data_type.FLOAT, uid=_STATS
    )
    dq, dk, dv = g.sdpa_backward(
        name="sdpa_backward",
        q=q,
        k=k,
        v=v,
        o=o,
        dO=do,
        stats=stats,
        max_total_seq_len_q=total_q,
        max_total_seq_len_kv=total_kv,
        **_sdpa_args(g, shape),
    )
    grads = ((dq, _DQ, hq, s_q, _OFF_DQ), (dk, _DK, hkv, s_kv, _OFF_DK), (dv, _DV, hkv, s_kv, _OFF_DV))
    for t, uid, heads, s, off in grads:
        t.set_uid(uid).set_output(True).set_dim([b, heads, s, d]).set_stride(_stride(heads, s, d))
        t.set_ragged_offset(_column(g, off, b + 1, cudnn.data_type.INT64))
    return _built(g)


def _built(g):
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size()


def _run(graph_and_workspace, buffers: dict, device: torch.device) -> None:
    g, workspace_size = graph_and_workspace
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=device)
    g.execute(buffers, workspace, handle=_handle(device))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float) -> None:
    refuse_variant("cudnn", q, v, softcap)  # its graphs take one head dim, and scores as they are
    if not q.is_cuda or q.dtype not in _DTYPES:
        raise ValueError(f"kernel 'cudnn' needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}")
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % 8:
        raise ValueError(f"kernel 'cudnn' needs one head dim, a multiple of 8, got q {q.shape[-1]}, k {k.shape[-1]}")


def _kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the graphs read them: with their own strides when they share them (the
    halves of one ``[T, 2 Hkv, D]`` buffer, as the ring passes them: no copy), else made contiguous."""
    aligned = all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 for t in (k, v))
    if aligned and k.stride() == v.stride():
        return k, v
    return k.contiguous(), v.contiguous()


def _shape(q, k, meta: Ragged, causal, window, scale, max_q: int, max_k: int) -> _Shape:
    # bounds: tight ones shrink the grid, bucketing keeps the graph count small
    return _Shape(
        q.dtype, meta.seq_q.shape[0], q.shape[1], k.shape[1], q.shape[2], bucket(max_q), bucket(max_k),
        causal, tuple(window), float(scale), q.device, (k.stride(0), k.stride(1)),
    )  # fmt: skip


@functools.cache
def supports_window() -> bool:
    """Whether cuDNN takes a band's left bound: frontend 1.10 and cuDNN 9.6 or later."""
    if not available():
        return False
    import cudnn

    frontend = tuple(int(x) for x in cudnn.__version__.split(".")[:2] if x.isdigit())
    return frontend >= (1, 10) and cudnn.backend_version() >= 90600


def _band(causal: bool, window, pieces: Pieces) -> tuple[int, int]:
    band = gpu_window("cudnn", causal, window, pieces)
    if band != (-1, -1) and not supports_window():
        raise ValueError("kernel 'cudnn' needs cudnn-frontend >= 1.10 and cuDNN >= 9.6 for a sliding window")
    return band


def forward(q, k, v, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, sinks=None):
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.forward`."""
    band = _band(causal, window, pieces)
    _check(q, k, v, softcap)
    q, (k, v) = q.contiguous(), _kv(k, v)
    tq, hq, d = q.shape
    meta = _plan_ragged(*pieces.tensors, k.shape[0])
    shape = _shape(q, k, meta, causal, band, scale, *pieces.bounds(q, k))
    out = torch.empty_like(q)
    stats = torch.empty((tq, hq, 1), device=q.device)  # pieces that see no keys: set by ``finish``
    q_offset, k_offset = _offsets(meta.q_rows, hq * d), _offsets(meta.k_rows, k.stride(0))
    _run(
        _forward_graph(shape),
        {
            _Q: q, _K: k, _V: v, _O: out, _STATS: stats, _SEQ_Q: meta.seq_q, _SEQ_KV: meta.seq_kv,
            _OFF_Q: q_offset, _OFF_K: k_offset, _OFF_V: k_offset, _OFF_O: q_offset,
            _OFF_STATS: _offsets(meta.q_rows, hq),
        },
        q.device,
    )  # fmt: skip
    lse = dead_rows.finish(out, stats.view(tq, hq), dead_rows.live_rows(pieces.cu_q, pieces.k_len, tq))
    return joined((out, lse), sinks)


@per_plan
def _offsets(rows: torch.Tensor, stride: int) -> torch.Tensor:
    """Entries' first ``rows`` as ragged offsets in elements (``stride`` per row); once per plan."""
    return rows * stride


@per_plan
def _longest(k_len: torch.Tensor) -> int:
    """The longest piece of a plan whose pieces read their own rows (``disjoint_keys``); once
    per plan, read on its host twin (a host sync where it has none)."""
    return int(readable(k_len)[0].max())


def backward_pieces(cu_q, k_start, k_len, num_rows: int, num_keys: int, causal: bool):
    """The pieces the backward runs over shared keys, ``(cu_q, k_start, k_len)``, and their
    :class:`Scratch`: causal pieces as row chunks (``metadata.chunks``). Once per plan."""
    if causal:
        cu_q, k_start, k_len = row_chunks(cu_q, k_start, k_len, num_rows)
    return (cu_q, k_start, k_len), scratch_rows(cu_q, k_start, k_len, num_keys)


def backward(
    dout, q, k, v, out, lse, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, grads=None,
    **options,
):  # fmt: skip
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.backward`."""
    check_options(options, "cudnn")
    band = _band(causal, window, pieces)
    _check(q, k, v, softcap)
    q, out, dout = (t.contiguous() for t in (q, out, dout))
    k, v = _kv(k, v)
    tq, hq, d = q.shape
    cu_q, k_start, k_len = pieces.tensors
    in_place = pieces.disjoint_keys and not causal  # each key read by one whole piece: dK/dV at its row
    if in_place:
        meta, rows = _plan_ragged(cu_q, k_start, k_len, k.shape[0]), k.shape[0]
        max_q = max_k = _longest(k_len)  # exact, as below: the padded lse is [B, Hq, S_q]
    else:
        (cu_q, k_start, k_len), scratch = backward_pieces(cu_q, k_start, k_len, tq, k.shape[0], causal)
        meta = _plan_ragged(cu_q, k_start, k_len, k.shape[0], scratch.cu, scratch.rows, scratch.live)
        rows = scratch.rows + 1  # and the spare row ``add_back`` takes
        max_q, max_k = scratch.max_q, scratch.max_k  # exact: the grids shrink
    # rows that no entry writes: the chunks', as a causal piece's first rows may see no key
    live = None if pieces.disjoint_keys else dead_rows.live_rows(cu_q, k_len, tq)
    shape = _shape(q, k, meta, causal, band, scale, min(tq, max_q), min(k.shape[0], max_k))
    dq = torch.empty_like(q)
    # In place, keys no piece reads keep 0. A scratch's rows are each an entry's (``scratch_rows``) and
    # cuDNN writes every key row of an entry, so only the spare row is zeroed: zeroing all of them was
    # two fills of the whole scratch per layer (docs/attention-kernels.md, "Rows that see no keys").
    dkc, dvc = (
        (torch.zeros if in_place else torch.empty)(max(rows, 1), *t.shape[1:], dtype=t.dtype, device=t.device)
        for t in (k, v)
    )
    if not in_place:
        for t in (dkc, dvc):
            t[-1].zero_()
    q_offset, k_offset = _offsets(meta.q_rows, hq * d), _offsets(meta.k_rows, k.stride(0))
    dk_offset = _offsets(meta.dk_rows, dkc.stride(0))
    stats = padded_lse(lse, meta.q_rows, meta.q_len, shape.b, shape.s_q)
    _run(
        _backward_graph(shape, bucket(tq), bucket(max(k.shape[0], rows))),
        {
            _Q: q, _K: k, _V: v, _O: out, _DO: dout, _STATS: stats, _DQ: dq, _DK: dkc, _DV: dvc,
            _SEQ_Q: meta.seq_q, _SEQ_KV: meta.seq_kv, _OFF_Q: q_offset, _OFF_K: k_offset, _OFF_V: k_offset,
            _OFF_O: q_offset, _OFF_DQ: q_offset, _OFF_DK: dk_offset, _OFF_DV: dk_offset,
        },
        q.device,
    )  # fmt: skip
    if live is not None:  # as the forward's ``out``
        dead_rows.zero(dq, live)
    if in_place:
        return dq, *place_grads(dkc, dvc, k_start, k_len, grads)
    return dq, *add_back_grads(dkc, dvc, scratch, grads)

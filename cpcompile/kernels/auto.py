"""The default CUDA kernel when cudnn-frontend is present: each direction on its faster backend (``contract``).

Where FlashAttention-4 runs the call (``fa4.supports``), the forward is FA4's, the
fastest on whole documents and on ranks' pieces, and so is the backward of whole
documents and of pieces that are long (``FA4_PIECE_ROWS`` query rows, averaged over the
rows: balanced, no_load_balance, dual_chunk_swap at cp=2), over each piece's key copies
(``varlen``); on many short pieces (dual_chunk_swap at cp=8, small stripes) cuDNN's
backward is faster (docs/attention-kernels.md, "FlashAttention-4"), and where cuDNN's
does not fit (below) FA4's serves rather than flash's. Otherwise: cuDNN's forward is the
faster one, on one device and on ranks' pieces, so the forward is cuDNN's. cuDNN's
backward is the faster one too, given exact launch bounds, only the pieces that see keys
as entries (``metadata.scratch``) and long triangular pieces cut into row chunks
(``metadata.chunks``): on ranks' pieces, on whole causal documents on one device, and in
place on documents that are not causal (``disjoint_keys``). Its price is memory: it
holds float32 dK/dV for every query head of its scratch rows (``sum(k_len)`` over its
pieces, row chunks included), which does not fit for small stripes, so past
``MAX_KEY_ROWS`` scratch rows per key row flash's backward serves instead. A pack that
is one causal document of more than ``3 x metadata.chunks.ROWS`` tokens takes 2.5 rows
per key in its 4 chunks, so it gets flash's backward too. The two forwards' ``lse``
agree, so either backward takes cuDNN's forward. The measurements behind each choice:
docs/attention-kernels.md.
"""

from __future__ import annotations

from cpcompile.kernels import cudnn, fa4, flash
from cpcompile.kernels.contract import Pieces, check_options, gpu_window, variant
from cpcompile.kernels.metadata.scratch import scratch_rows

MAX_KEY_ROWS = 2  # scratch rows per key row up to which cuDNN's backward fits in memory
FA4_PIECE_ROWS = 1024  # query rows per piece (row-weighted mean) from which FA4's backward is the faster one


def _banded(causal: bool, window, pieces: Pieces) -> bool:
    """Whether the call has a band (a window GPU backends run, or ``ValueError``), which FA4 or cuDNN
    may lack (:func:`fa4.supports_window`, :func:`cudnn.supports_window`)."""
    return gpu_window("auto", causal, window, pieces) != (-1, -1)


def _fa4(q, banded: bool) -> bool:
    return fa4.supports(q) and (not banded or fa4.supports_window())


def forward(q, k, v, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, sinks=None):
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.forward`: FA4's where it runs ``q`` (and the
    window), else cuDNN's (flash's for a window this cuDNN lacks); FA4's for what only it runs
    (``contract.variant``)."""
    banded = _banded(causal, window, pieces)
    kernel = fa4 if _fa4(q, banded) else cudnn if not banded or cudnn.supports_window() else flash
    if variant(q, v, softcap) is not None:
        kernel = fa4
    return kernel.forward(q, k, v, pieces, causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks)


def use_fa4_backward(piece_rows: int) -> bool:
    """Whether FA4's backward is the faster one on pieces of ``piece_rows`` query rows
    (``metadata.scratch.Scratch.piece_rows``): it loses to cuDNN's only on short pieces."""
    return piece_rows >= FA4_PIECE_ROWS


def use_cudnn_backward(key_rows: int, num_keys: int) -> bool:
    """Whether the pieces read at most ``MAX_KEY_ROWS`` key rows per row of the key buffer."""
    return key_rows <= MAX_KEY_ROWS * num_keys


def backward(
    dout, q, k, v, out, lse, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, grads=None,
    **options,
):  # fmt: skip
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.backward`: FA4's where it runs ``q`` and
    :func:`use_fa4_backward` (or ``disjoint_keys``) says so, else from the backend
    :func:`use_cudnn_backward` picks.

    Whole documents that are not causal (``disjoint_keys``): cuDNN's, in place.
    Otherwise the size of cuDNN's scratch (for its own pieces: causal ones as row
    chunks) decides; it is made once per plan, here, and cuDNN's backward finds it made.
    It is budgeted against the pack's keys (the ``pack_keys`` option, default ``k``'s rows):
    where ``k`` holds only the keys that are read (``exchange``), causal row chunks read
    each of them up to about 3 times, and a budget against ``k``'s rows sent the
    exchange's backward to the slower flash (docs/attention-kernels.md).
    """
    check_options(options, "auto")
    args, kw = (dout, q, k, v, out, lse, pieces), {"causal": causal, "scale": scale, "window": window, "grads": grads}
    if variant(q, v, softcap) is not None:  # what only FA4 runs
        return fa4.backward(*args, softcap=softcap, **kw)
    num_keys = options.get("pack_keys") or k.shape[0]
    banded = _banded(causal, window, pieces)
    has_fa4 = _fa4(q, banded)
    if banded and not cudnn.supports_window():
        return (fa4 if has_fa4 else flash).backward(*args, **kw)
    if has_fa4 and (pieces.disjoint_keys or use_fa4_backward(scratch_rows(*pieces.tensors, k.shape[0]).piece_rows)):
        return fa4.backward(*args, **kw)
    if pieces.disjoint_keys and not causal:
        return cudnn.backward(*args, **kw)
    _, scratch = cudnn.backward_pieces(*pieces.tensors, q.shape[0], k.shape[0], causal)
    kernel = cudnn if use_cudnn_backward(scratch.rows, num_keys) else fa4 if has_fa4 else flash
    return kernel.backward(*args, **kw)

"""The default CUDA kernel when cudnn-frontend is present: each direction on its faster backend (``contract``).

cuDNN's forward is the faster one, on one device and on ranks' pieces, so the
forward is cuDNN's. cuDNN's backward is the faster one too, given exact launch
bounds, only the pieces that see keys as entries (``metadata.scratch``) and long
triangular pieces cut into row chunks (``metadata.chunks``): on ranks' pieces, on
whole causal documents on one device, and in place on documents that are not
causal (``disjoint_keys``). Its price is memory: it holds float32 dK/dV for every
query head of its scratch rows (``sum(k_len)`` over its pieces, row chunks
included), which does not fit for small stripes, so past ``MAX_KEY_ROWS``
scratch rows per key row flash's backward serves instead. A pack that is one
causal document of more than ``3 x metadata.chunks.ROWS`` tokens takes 2.5 rows
per key in its 4 chunks, so it gets flash's backward too. The two forwards' ``lse`` agree,
so either backward takes cuDNN's forward. The measurements behind each choice:
docs/attention-kernels.md.
"""

from __future__ import annotations

from . import cudnn, flash
from .contract import check_options

MAX_KEY_ROWS = 2  # scratch rows per key row up to which cuDNN's backward fits in memory

forward = cudnn.forward


def use_cudnn_backward(key_rows: int, num_keys: int) -> bool:
    """Whether the pieces read at most ``MAX_KEY_ROWS`` key rows per row of the key buffer."""
    return key_rows <= MAX_KEY_ROWS * num_keys


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    k_start,
    k_len,
    *,
    causal: bool,
    scale: float,
    max_seqlen_q=None,
    max_seqlen_k=None,
    disjoint_keys: bool = False,
    key_order=None,
    dkv_out=None,
    **options,
):
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.backward`, from the backend
    :func:`use_cudnn_backward` picks.

    Whole documents that are not causal (``disjoint_keys``): cuDNN's, in place.
    Otherwise the size of cuDNN's scratch (for its own pieces: causal ones as row
    chunks) decides; it is made once per plan, here, and cuDNN's backward finds it made.
    It is budgeted against the pack's keys (the ``pack_keys`` option, default ``k``'s rows):
    where ``k`` holds only the keys that are read (``exchange``), causal row chunks read
    each of them up to about 3 times, and a budget against ``k``'s rows sent the
    exchange's backward to the slower flash (docs/attention-kernels.md).
    """
    check_options(options)
    args = (dout, q, k, v, out, lse, cu_q, k_start, k_len)
    kw = {
        "causal": causal,
        "scale": scale,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
        "disjoint_keys": disjoint_keys,
        "key_order": key_order,
        "dkv_out": dkv_out,
    }
    if disjoint_keys and not causal:
        return cudnn.backward(*args, **kw)
    _, scratch = cudnn.backward_pieces(cu_q, k_start, k_len, q.shape[0], k.shape[0], causal)
    kernel = cudnn if use_cudnn_backward(scratch.rows, options.get("pack_keys") or k.shape[0]) else flash
    return kernel.backward(*args, **kw)

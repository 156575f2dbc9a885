"""The default CUDA kernel when cudnn-frontend is present: each direction on its faster backend (``contract``).

Measured on the H200 (docs/attention-kernels.md): cuDNN's forward runs
1.6-1.7x torch's flash forward on ProLong packs, so the forward is cuDNN's. With
exact launch bounds, only the pieces that see keys as entries (``scratch``) and
long triangular pieces cut into row chunks (``chunks``), cuDNN's backward is
the faster one on the ranks' pieces: forward+backward per rank at cp=8, heads
32/8, 8.4 against 13.7 ms (balanced), 9.8 against 16.3 (dual_chunk_swap), 13.4
against 19.5 (no_load_balance); and on one device, whole documents in row chunks:
backward of a ProLong pack of 128K tokens 59.5 against 69.7 ms (36.2 against 39.7
for a pack of shorter documents); documents that are not causal, on one device
(``disjoint_keys``: written in place), 82.2 against 132.7 ms. Flash's backward
serves pieces whose scratch would not fit: cuDNN holds float32 dK/dV for every
query head of its scratch rows (``sum(k_len)`` over its pieces, row chunks
included), 66 GiB for 128-token stripes of a 128K pack at cp=2, so past
``MAX_KEY_ROWS`` scratch rows per key row it is not used. A pack that is one causal
document of more than 6K tokens (``3 x chunks.ROWS``) takes 2.5 rows per key in
its 4 chunks, so it gets flash's backward too.
The two forwards' ``lse`` agree to 3e-6, so either backward takes cuDNN's forward.
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
    It is budgeted against the pack's keys (the ``pack_keys`` option, default ``k``'s rows): where
    ``k`` holds only the keys that are read (``exchange``), causal row chunks read each
    of them 1.7-3.1 times (balanced and no_load_balance ranks, ProLong and Magi packs of
    128K tokens, cp 2 and 8), which against ``k``'s rows sent the exchange's backward to
    flash (cp=2 on 2 H200s, balanced, heads 32/8: 41.5 -> 48.3 ms forward+backward).
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

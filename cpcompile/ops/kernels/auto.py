"""The default CUDA kernel when cudnn-frontend is present: each direction on its faster backend.

Measured on the H200 (BENCHMARKS.md, "Attention on one GPU"): cuDNN's forward runs
1.6-1.7x torch's flash forward on ProLong packs, so the forward is cuDNN's. The
backwards are close, and which one wins depends on how many keys the pieces read
per query row. Flash's backward runs one thread block per key block, looping over
its piece's query rows: where pieces are short against long key prefixes
(dual_chunk_swap at cp=4: 4.5 key rows per query row, 2.5 on the last rank whose two
chunks merge; ~8.5 at cp=8) each block has little work and cuDNN wins (20.4 vs 28.2
ms per rank at cp=4, heads 32/8); where pieces are long (one device and
no_load_balance: ~1; balanced: 1.4-1.9) flash wins (70 vs 86 ms on one GPU).
cuDNN's backward also holds float32 dK/dV for every query head of its scratch rows
(``sum(k_len)``): 66 GiB for 128-token stripes of a 128K pack at cp=2, so past
``MAX_KEY_ROWS`` scratch rows per key row it is not used.
The two forwards' ``lse`` agree to 3e-6, so either backward takes cuDNN's forward.
"""

from __future__ import annotations

from . import cudnn, flash
from .scratch import scratch_rows

KEYS_PER_QUERY = 2.2  # above this, cuDNN's backward (measured: flash wins at <= 1.9, cuDNN at >= 2.5)
MAX_KEY_ROWS = 2  # scratch rows per key row up to which cuDNN's backward fits in memory

forward = cudnn.forward


def use_cudnn_backward(key_rows: int, query_rows: int, num_keys: int) -> bool:
    """Whether the pieces read more than ``KEYS_PER_QUERY`` key rows per query row,
    and at most ``MAX_KEY_ROWS`` per row of the key buffer."""
    return KEYS_PER_QUERY * query_rows < key_rows <= MAX_KEY_ROWS * num_keys


def backward(dout, q, k, v, out, lse, cu_q, k_start, k_len, **kwargs):
    """Gradients of :func:`forward` from the backend :func:`use_cudnn_backward` picks.

    With ``disjoint_keys`` every key is read once, so flash. Otherwise both backends
    need the pieces' scratch rows, whose count decides: made once here (its host
    sync) and handed on.
    """
    if kwargs.get("disjoint_keys"):
        return flash.backward(dout, q, k, v, out, lse, cu_q, k_start, k_len, **kwargs)
    scratch = scratch_rows(k_start, k_len, k.shape[0])
    kernel = cudnn if use_cudnn_backward(scratch.rows, q.shape[0], k.shape[0]) else flash
    return kernel.backward(dout, q, k, v, out, lse, cu_q, k_start, k_len, scratch=scratch, **kwargs)

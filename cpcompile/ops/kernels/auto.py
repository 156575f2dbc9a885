"""The default CUDA kernel when cudnn-frontend is present: each direction on its faster backend.

Measured on the H200 (BENCHMARKS.md, "Attention on one GPU"): cuDNN's forward runs
1.6-1.7x torch's flash forward on ProLong packs, so the forward is cuDNN's. With
exact launch bounds and only the pieces that see keys as entries (``scratch``),
cuDNN's backward is also the faster one on every layout's pieces but one: per
rank at cp=8, 9.3 against 15.5 ms (dual_chunk_swap), 11.2 against 13.4
(balanced), 21.5 against 21.9 (no_load_balance; at cp=4 flash's wins, 28.5
against 30.9). Two cases keep flash's backward: keys read once
(``disjoint_keys``, one device: flash's own layout, no scratch), and pieces whose
scratch would not fit: cuDNN holds float32 dK/dV for every query head of its
scratch rows (``sum(k_len)``), 66 GiB for 128-token stripes of a 128K pack at
cp=2, so past ``MAX_KEY_ROWS`` scratch rows per key row it is not used.
The two forwards' ``lse`` agree to 3e-6, so either backward takes cuDNN's forward.
"""

from __future__ import annotations

from . import cudnn, flash
from .scratch import scratch_rows

MAX_KEY_ROWS = 2  # scratch rows per key row up to which cuDNN's backward fits in memory

forward = cudnn.forward


def use_cudnn_backward(key_rows: int, num_keys: int) -> bool:
    """Whether the pieces read at most ``MAX_KEY_ROWS`` key rows per row of the key buffer."""
    return key_rows <= MAX_KEY_ROWS * num_keys


def backward(dout, q, k, v, out, lse, cu_q, k_start, k_len, **kwargs):
    """Gradients of :func:`forward` from the backend :func:`use_cudnn_backward` picks.

    With ``disjoint_keys`` every key is read once, so flash. Otherwise both backends
    need the pieces' scratch rows, whose count decides: made once per plan here (its
    host sync) and handed on.
    """
    if kwargs.get("disjoint_keys"):
        return flash.backward(dout, q, k, v, out, lse, cu_q, k_start, k_len, **kwargs)
    scratch = scratch_rows(cu_q, k_start, k_len, k.shape[0])
    kernel = cudnn if use_cudnn_backward(scratch.rows, k.shape[0]) else flash
    return kernel.backward(dout, q, k, v, out, lse, cu_q, k_start, k_len, scratch=scratch, **kwargs)

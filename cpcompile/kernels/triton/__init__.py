"""Triton kernels that the backends call around their attention kernels, each with a torch fallback.

- ``sum_rows``: each key's scratch rows over all layers, summed once (``metadata.scratch``).
- ``dead_rows``: the rows of pieces that see no keys, zeroed without a pass over the rest.
- ``sink_grad``: the learnable sinks' gradient in one pass over ``dout`` and ``out``.

The fallbacks run where Triton is missing (torch's CPU wheels) or the tensors are not on CUDA.
"""

from __future__ import annotations

from cpcompile.kernels.triton import dead_rows, sink_grad, sum_rows

__all__ = ["dead_rows", "sink_grad", "sum_rows"]

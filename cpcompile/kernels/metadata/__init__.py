"""What the GPU backwards derive from a plan, once per plan: per-piece key rows and row chunks.

- ``scratch``: a scratch row per (piece, key) for kernels that write dK/dV rather
  than add to it, and the sums of those rows back to the keys (also the sparse
  exchange's sums of returned rows).
- ``chunks``: long causal pieces cut into row chunks for cuDNN's backward.
"""

from __future__ import annotations

from cpcompile.kernels.metadata import chunks, scratch

__all__ = ["chunks", "scratch"]

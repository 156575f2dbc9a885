"""Rows of pieces that see no keys: their output and dQ are 0, set without a pass over the rest.

A piece that sees no keys (padding; in a ring step, a piece with no keys in the
block) is not an entry of a kernel's call, so nothing writes its rows. Zeroing
the whole output before the call, or masking all of it after, is a pass over
every row for rows that are few or none (balanced pads less than ``cp`` tokens).
:func:`zero` reads one flag per row and writes only the dead rows.

cuDNN's forward also leaves those rows' statistics unwritten, and writes them
token-major (``[Tq, Hq]``) where the kernels' ``lse`` is ``[Hq, Tq]``.
:func:`finish` transposes them, with ``-inf`` for dead rows, and zeroes the dead
output rows in the same kernel: one launch, not a fill, a zeroing and a transpose
each waiting behind the last (docs/attention-kernels.md, "Rows that see no keys").
"""

from __future__ import annotations

import torch

from cpcompile.cache import per_plan

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheels come without Triton; CUDA ones bring it
    triton = None

_ROWS = 32  # rows per program: one flag each
_FINISH_ROWS = 64  # rows per program of ``finish``: a [heads, 64] block of statistics
_BLOCK = 1024  # columns per store


@per_plan
def live_rows(cu_q: torch.Tensor, k_len: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[Tq]`` bool: rows whose piece (``cu_q [P + 1]``, ``k_len [P]``) sees at least one key.

    Built once per plan: every layer's call reuses it."""
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    return torch.repeat_interleave(k_len > 0, q_len, output_size=num_rows)


if triton is not None:

    @triton.jit
    def _zero_rows(t, rows, dead, width, rows_per: tl.constexpr, block: tl.constexpr):
        # t [num_rows, width]: the ``dead`` ones of ``rows`` set to 0; most programs have none: no store
        if tl.max(dead.to(tl.int32), axis=0) > 0:
            zeros = tl.zeros([rows_per, block], dtype=t.dtype.element_ty)
            for start in range(0, width, block):
                cols = start + tl.arange(0, block)
                mask = dead[:, None] & (cols < width)[None, :]
                tl.store(t + rows[:, None].to(tl.int64) * width + cols[None, :], zeros, mask=mask)

    @triton.jit
    def _zero_dead(t, live, num_rows, width, rows_per: tl.constexpr, block: tl.constexpr):
        # t [num_rows, width], live [num_rows] uint8; program: rows_per rows, all their columns
        rows = tl.program_id(0) * rows_per + tl.arange(0, rows_per)
        dead = tl.load(live + rows, mask=rows < num_rows, other=1) == 0
        _zero_rows(t, rows, dead, width, rows_per, block)

    @triton.jit
    def _finish(
        out,
        stats,
        lse,
        live,
        num_rows,
        width,
        heads,
        rows_per: tl.constexpr,
        heads_p: tl.constexpr,
        block: tl.constexpr,
    ):
        # stats [num_rows, heads] -> lse [heads, num_rows], -inf where dead; out [num_rows, width]: dead rows 0
        rows = tl.program_id(0) * rows_per + tl.arange(0, rows_per)
        alive = tl.load(live + rows, mask=rows < num_rows, other=1) != 0
        h = tl.arange(0, heads_p)
        mask = (rows < num_rows)[None, :] & (h < heads)[:, None]
        values = tl.load(stats + rows[None, :].to(tl.int64) * heads + h[:, None], mask=mask)
        values = tl.where(alive[None, :], values, float("-inf"))
        tl.store(lse + h[:, None].to(tl.int64) * num_rows + rows[None, :], values, mask=mask)
        _zero_rows(out, rows, ~alive, width, rows_per, block)


def zero(t: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Set the rows of ``t [Tq, ...]`` where ``live [Tq]`` is false to 0, in place; returns ``t``."""
    if triton is None or not t.is_cuda or not t.is_contiguous():
        return t.masked_fill_(~live.view(-1, *(1,) * (t.dim() - 1)), 0)
    num_rows = t.shape[0]
    if num_rows:
        with torch.cuda.device(t.device):  # launched on that device's current stream
            _zero_dead[(triton.cdiv(num_rows, _ROWS),)](
                t, live.view(torch.uint8), num_rows, t[0].numel(), rows_per=_ROWS, block=_BLOCK
            )
    return t


def finish(out: torch.Tensor, stats: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A forward's last step: zero ``out [Tq, ...]``'s rows where ``live [Tq]`` is false, in place,
    and return ``lse [Hq, Tq]`` float32 from token-major ``stats [Tq, Hq]``, ``-inf`` in those rows
    (whatever ``stats`` holds there)."""
    if triton is None or not out.is_cuda or not out.is_contiguous() or not stats.is_contiguous():
        zero(out, live)
        return stats.masked_fill(~live[:, None], float("-inf")).t().contiguous()
    num_rows, heads = stats.shape
    lse = stats.new_empty(heads, num_rows)
    if num_rows:
        with torch.cuda.device(out.device):  # launched on that device's current stream
            _finish[(triton.cdiv(num_rows, _FINISH_ROWS),)](
                out, stats, lse, live.view(torch.uint8), num_rows, out[0].numel(), heads,
                rows_per=_FINISH_ROWS, heads_p=triton.next_power_of_2(heads), block=_BLOCK,
            )  # fmt: skip
    return lse

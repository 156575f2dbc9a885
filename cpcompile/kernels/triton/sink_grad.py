"""The learnable sinks' gradient in one pass over ``dout`` and ``out`` (the math: ``attention.sinks``).

``d sinks[h] = -sum over rows t of exp(sinks[h] - lse[h, t]) * (dout[t, h] . out[t, h])``. Written with
torch ops it casts both ``[T, Hq, Dv]`` tensors to float32, multiplies and sums them: four passes over
copies twice the size of the inputs, in eager mode a cost of the order of the attention backward's own
preprocessing. :func:`grad` reads each input once, forms the row dot products in float32 registers and
writes one partial sum per block of rows and head; the partials are summed in a fixed order
(deterministic, where float32 atomics would not be).

Under torch.compile the op that calls it (``attention.sinks``) is opaque; its fake gives the ``[Hq]`` shape.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheels come without Triton; CUDA ones bring it
    triton = None

_ELEMENTS = 8192  # elements of ``dout`` (and of ``out``) per program: rows_per x the padded head dim


def reference(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The same sum with torch ops, in ``lse``'s dtype: where Triton or CUDA is missing, and for dtypes the
    kernel does not take (float64 ``lse``)."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).t()  # [Hq, T]: D' = rowsum(dO * out_final)
    share = torch.exp(sinks.to(acc)[:, None] - lse)  # 1 - w, the sink's probability; 1 at rows without keys
    return (-(share * delta).sum(1)).to(sinks.dtype)


if triton is not None:

    @triton.jit
    def _partials(
        dout, out, lse, sinks, partial, num_rows, width,
        dout_t, dout_h, out_t, out_h, lse_h, lse_t, sinks_h,
        rows_per: tl.constexpr, block_d: tl.constexpr,
    ):  # fmt: skip
        # program (block b of rows_per rows, head h): partial[h, b] = -sum_t exp(sinks[h] - lse[h, t]) * D'[t, h]
        # (offsets in int64: a head-major dout's or lse's h * stride may pass 2**31)
        b, h = tl.program_id(0), tl.program_id(1).to(tl.int64)
        rows = b * rows_per + tl.arange(0, rows_per)
        inside = rows < num_rows
        cols = tl.arange(0, block_d)
        mask = inside[:, None] & (cols < width)[None, :]
        r = rows.to(tl.int64)[:, None]
        do = tl.load(dout + r * dout_t + h * dout_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        o = tl.load(out + r * out_t + h * out_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(do * o, axis=1)  # [rows_per]
        row_lse = tl.load(lse + h * lse_h + rows.to(tl.int64) * lse_t, mask=inside, other=0.0)
        share = tl.exp(tl.load(sinks + h * sinks_h).to(tl.float32) - row_lse)
        total = tl.sum(tl.where(inside, share * delta, 0.0), axis=0)
        tl.store(partial + h * tl.num_programs(0) + b, -total)


def _served(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> bool:
    return (
        triton is not None
        and dout.is_cuda
        and lse.dtype == torch.float32
        and dout.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and out.dtype == dout.dtype
        and dout.stride(-1) == 1
        and out.stride(-1) == 1
    )


def grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sinks [Hq]`` (sinks' dtype) from ``dout``, ``out [T, Hq, Dv]`` and ``lse [Hq, T]`` (the sink's
    ``out_final`` and ``lse_final``): Triton on CUDA, else :func:`reference`."""
    if not _served(dout, out, lse):
        return reference(dout, out, lse, sinks)
    num_rows, heads, width = out.shape
    block_d = triton.next_power_of_2(max(width, 1))  # Dv = 0: a block of masked columns, dot products 0
    rows_per = max(1, _ELEMENTS // block_d)
    blocks = max(1, triton.cdiv(num_rows, rows_per))
    partial = torch.empty(heads, blocks, dtype=torch.float32, device=out.device)
    with torch.cuda.device(out.device):  # launched on that device's current stream
        _partials[(blocks, heads)](
            dout, out, lse, sinks, partial, num_rows, width,
            dout.stride(0), dout.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), sinks.stride(0),
            rows_per=rows_per, block_d=block_d,
        )  # fmt: skip
    return partial.sum(1).to(sinks.dtype)

"""One GPU kernel for ``metadata.scratch.sum_layers`` (the backward's add-back of per-piece
dK/dV rows, and the sparse exchange's sums of returned ones): each key's rows over all
layers, summed once.

The torch ways were slower: gathering every key once per layer (the spare row where
a layer has none) and summing the gathered ``[L, Tk, H, D]`` copy writes and reads
that copy, and ``index_add_`` layer by layer into zeroed sums pays for float32
atomics, much slower per row than ``index_copy_``. This kernel reads the ``[L, Tk]``
row index, loads only the rows that are there, adds them in float32 in layer order
(deterministic) and writes each key's sum once: no zeroed sums, no gathered copy.
The measurements: docs/attention-kernels.md.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheels come without Triton; CUDA ones bring it
    triton = None


def available(t: torch.Tensor) -> bool:
    """Whether the kernel serves ``t``: a CUDA tensor with Triton installed."""
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _add_layers(total, partial, index, key, num_layers, num_keys, spare, cols, inside, width: tl.constexpr):
        # total [block] float32 plus, layer by layer, partial[index[layer, key]] where it is not ``spare``
        for layer in range(num_layers):
            row = tl.load(index + layer * num_keys + key)  # int32 product: L * Tk < 2^31
            if row != spare:  # the layer has no row for this key: nothing to read
                total += tl.load(partial + row * width + cols, mask=inside).to(tl.float32)
        return total

    @triton.jit
    def _sum_rows(
        partial,
        index,
        keys,
        out,
        num_layers,
        num_keys,
        spare,
        more,
        more_index,
        more_layers,
        more_spare,
        width: tl.constexpr,
        block: tl.constexpr,
        some: tl.constexpr,
        two: tl.constexpr,
    ):
        # partial [R, width], index [num_layers, num_keys] int64, out [num_keys, width] (the sum is
        # float32, rounded once to out's dtype on the store); with ``two``, then ``more``'s layers
        # (``more_index [more_layers, num_keys]``) on the same sums;
        # program (key, column block), the key the program's own or, with ``some``, keys[program]
        if some:
            key = tl.load(keys + tl.program_id(0))
        else:
            key = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * block + tl.arange(0, block)
        inside = cols < width
        total = tl.zeros([block], dtype=tl.float32)
        total = _add_layers(total, partial, index, key, num_layers, num_keys, spare, cols, inside, width)
        if two:
            total = _add_layers(total, more, more_index, key, more_layers, num_keys, more_spare, cols, inside, width)
        tl.store(out + key * width + cols, total, mask=inside)


def sum_rows(partial: torch.Tensor, index: torch.Tensor, spare: int, out=None, keys=None, more=None) -> torch.Tensor:
    """``partial [R, H, D]``, ``index [L, Tk]`` int64 rows of ``partial`` (``spare``: none)
    -> ``[Tk, H, D]``, ``out[k] = sum over l of partial[index[l, k]]``, summed in float32.

    ``out``: the ``[Tk, H, D]`` tensor to write, float32 or a dtype to round the sums to
    once (default: a new float32 one); ``keys``: ``[n]`` int64, the only rows computed and
    written (``out``'s others are kept). ``more``: ``(partial, index, spare)`` of a second
    source, its own dtype and ``[L', Tk]`` index, whose layers follow on the same sums.
    """
    num_layers, num_keys = index.shape
    partial, index = partial.contiguous(), index.contiguous()
    width = math.prod(partial.shape[1:])  # not partial[0]: a source may have no rows
    shape = (num_keys, *partial.shape[1:])
    if more is not None and more[1].shape[0] == 0:  # a second source of no layers adds nothing
        more = None
    if more is not None:
        extra, extra_index, extra_spare = more
        extra, extra_index = extra.contiguous(), extra_index.contiguous()
        if math.prod(extra.shape[1:]) != width or extra_index.shape[1] != num_keys:
            raise ValueError(
                f"sum_rows: more must have rows of {width} values and an index of {num_keys} columns, got "
                f"{list(extra.shape)} and {list(extra_index.shape)}"
            )
    else:  # unused: the kernel's second source is compiled out
        extra, extra_index, extra_spare = partial, index, spare
    if out is None:
        if keys is not None:
            raise ValueError("sum_rows: keys needs out, the tensor whose other rows it keeps")
        out = torch.empty(shape, dtype=torch.float32, device=partial.device)
    elif out.shape != shape or not out.is_floating_point() or not out.is_contiguous() or out.device != partial.device:
        raise ValueError(
            f"sum_rows: out must be a contiguous floating-point {list(shape)} on {partial.device}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    block = min(triton.next_power_of_2(width), 1024)
    programs = num_keys if keys is None else keys.shape[0]
    if programs:
        grid = (programs, triton.cdiv(width, block))
        with torch.cuda.device(partial.device):  # launched on that device's current stream
            _sum_rows[grid](
                partial, index, index if keys is None else keys, out, num_layers, num_keys, spare,
                extra, extra_index, extra_index.shape[0], extra_spare,
                width=width, block=block, some=keys is not None, two=more is not None,
            )  # fmt: skip
    return out

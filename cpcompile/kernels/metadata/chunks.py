"""Long causal pieces cut into row chunks for cuDNN's backward.

cuDNN's backward gives each key block of a piece its own CTA, which loops over the
query tiles that see the block. On a whole causal document those loops run from
1 to ``L / 128`` tiles, and the long ones finish last, so whole causal documents
run well below the rate of pieces with even loops, and below flash's backward.
Cut into row chunks, each reading the keys up to its last row (bottom-right causal
holds per chunk, so the result is the same), they run faster than whole and than
flash: long documents on one device, and ranks holding whole documents (balanced).
Chunks have :data:`ROWS` rows, and a piece is cut into at most :data:`MAX_CHUNKS`.

Pieces of :data:`ROWS` rows or fewer, such as dual_chunk_swap's at cp=8 on 128K
tokens, are left as they are, and so are pieces that read at least twice as many
keys as they have rows: mostly rectangles, whose loops are even already
(dual_chunk_swap's tail chunks), and for which the extra scratch rows cost more
than the chunks gained.

The chunks of a piece share its keys, so each writes its own scratch rows
(``scratch``): more rows to add back, and dK/dV rounded to bf16 once per chunk
before the float32 sums, as for any pieces sharing keys. Against float64 that
stayed within the kernel's own error, even in 16 chunks of an 8K document.

The measurements behind each of these: docs/attention-kernels.md, "cuDNN's
backward in row chunks".
"""

from __future__ import annotations

import torch

from cpcompile.cache import per_plan, twinned

#: Most query rows per chunk: the fastest of 1024, 2048 and 4096 (docs/attention-kernels.md).
ROWS = 2048
#: Most chunks per piece: the ``c`` chunks of an ``n``-row triangle read ``(c + 1) / 2 * n`` scratch rows,
#: so this keeps a piece's scratch within 2.5 rows per key (a 128K-token document in 2048-row chunks would
#: take 32.5). Longer pieces get longer chunks instead, which costs little (docs/attention-kernels.md).
MAX_CHUNKS = 4


@per_plan
@twinned  # on the host where the plan has twins: the scratch rows of the chunks are counted there
def row_chunks(cu_q: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, num_rows: int):
    """Causal pieces ``cu_q [P + 1]``, ``k_start``/``k_len [P]`` over ``num_rows`` query rows,
    as row chunks: ``(cu_q [C + 1], k_start [C], k_len [C])``.

    ``C = P + num_rows // ROWS`` is fixed by the shapes (no host sync); the chunks past
    the pieces' are empty, at the rows' end. A piece of ``n`` rows that reads fewer
    than ``2 n`` keys becomes ``min(ceil(n / ROWS), MAX_CHUNKS)`` chunks of as even sizes
    as can be; other pieces stay one chunk. Built once per plan.
    """
    p = k_len.shape[0]
    c = p + num_rows // ROWS
    device = k_len.device
    q_start, q_len = cu_q[:-1].long(), (cu_q[1:] - cu_q[:-1]).long()
    # mostly triangle: fewer than twice as many keys as rows (longer pieces are rectangles already)
    count = torch.where(k_len < 2 * q_len, (q_len + ROWS - 1) // ROWS, 1).clamp(1, MAX_CHUNKS)  # sum(count) <= c
    # one more piece, empty and at the end, takes the chunks left over
    count = torch.cat([count, c - count.sum().view(1)])
    q_start = torch.cat([q_start, cu_q[-1:].long()])
    q_len, k_len_ext = torch.cat([q_len, q_len.new_zeros(1)]), torch.cat([k_len.long(), q_len.new_zeros(1)])
    piece = torch.repeat_interleave(torch.arange(p + 1, device=device), count, output_size=c)
    first = count.cumsum(0) - count
    i, n, rows = torch.arange(c, device=device) - first[piece], count[piece], q_len[piece]
    lo, hi = rows * i // n, rows * (i + 1) // n  # the chunk's rows within its piece
    # row r of a piece sees k_len - q_len + r + 1 keys: a chunk reads up to its last row's
    chunk_k_len = (k_len_ext[piece] - rows + hi).clamp(min=0).masked_fill(hi == lo, 0)
    chunk_cu = torch.cat([q_start[piece] + lo, cu_q[-1:].long()])
    k_start_ext = torch.cat([k_start, k_start.new_zeros(1)])
    return chunk_cu.to(cu_q.dtype), k_start_ext[piece], chunk_k_len.to(k_len.dtype)

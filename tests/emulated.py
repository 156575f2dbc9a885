"""FlashAttention-4's varlen calls emulated on the reference kernel, for ``kernels.varlen`` on the CPU.

FA4's forward reads each entry's keys at ``cu_k[b]`` for ``seqused_k[b]`` rows (``cu_k`` need not
be monotone); its backward writes dK/dV per entry, so it must be given disjoint, increasing key
ranges, and with ``seqused_q``/``seqused_k`` and output buffers it writes only the used rows. The
emulation checks what the real kernel needs and computes what it would, in float64 where given.
"""

from __future__ import annotations

import torch

from cpcompile.kernels import Pieces, reference, varlen
from cpcompile.kernels.metadata import scratch


def forward_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, seqused_k=None):
    """A varlen forward with FA4's contract: entry ``b`` is query rows ``[cu_q[b], cu_q[b + 1])`` over keys
    ``[cu_k[b], cu_k[b] + seqused_k[b])`` (``cu_k`` monotone without ``seqused_k``)."""
    used_k = cu_k[1:] - cu_k[:-1] if seqused_k is None else seqused_k
    assert seqused_k is not None or bool((used_k >= 0).all()), "cu_k must be monotone without seqused_k"
    return reference.forward(q, k, v, Pieces(cu_q, cu_k[:-1], used_k), causal=causal, scale=scale, window=window)


def in_place_backward_call(calls: list):
    """A varlen backward call with FA4's contract, on the reference kernel: entries ``[cu_q[b], cu_q[b + 1])``
    over keys ``[cu_k[b], cu_k[b + 1])``, or with ``seqused_q``/``seqused_k`` only their first rows and keys,
    written into ``dq``/``dk``/``dv`` (other rows left as they are). It checks what the kernel needs:
    ``cu_k`` monotone, entries' used keys disjoint. Records each call's ``rows`` in ``calls``."""

    def call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, **rows):
        calls.append(rows)
        used_q = rows.get("seqused_q", cu_q[1:] - cu_q[:-1])
        used_k = rows.get("seqused_k", cu_k[1:] - cu_k[:-1])
        assert bool((cu_k[1:] >= cu_k[:-1]).all()) and bool((cu_k[:-1] + used_k <= cu_k[1:]).all())
        pieces = Pieces(cu_q, cu_k[:-1], torch.where(used_q > 0, used_k, 0))
        dq, dk, dv = reference.backward(dout, q, k, v, out, lse, pieces, causal=causal, scale=scale, window=window)
        if not rows:
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        q_rows = torch.repeat_interleave(used_q > 0, cu_q[1:] - cu_q[:-1], output_size=q.shape[0])
        rows["dq"][q_rows] = dq[q_rows].to(q.dtype)
        k_rows = scratch.keys_read(cu_k[:-1], torch.where(used_q > 0, used_k, 0), k.shape[0])
        rows["dk"][k_rows], rows["dv"][k_rows] = dk[k_rows].to(k.dtype), dv[k_rows].to(v.dtype)
        return rows["dq"], rows["dk"], rows["dv"]

    return call


def fa4(calls: list | None = None) -> varlen.VarlenKernel:
    """A backend arranged as ``kernels.fa4`` (``in_place_backward``) over the emulated calls."""
    return varlen.VarlenKernel("fa4", forward_call, in_place_backward_call([] if calls is None else calls),
                               in_place_backward=True)  # fmt: skip

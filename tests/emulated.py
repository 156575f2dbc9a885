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


def forward_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, seqused_k=None, seqused_q=None):
    """A varlen forward with FA4's contract: entry ``b`` is query rows ``[cu_q[b], cu_q[b + 1])``, or with
    ``seqused_q`` ``[cu_q[b], cu_q[b] + seqused_q[b])`` in any order (the entries' rows disjoint), over keys
    ``[cu_k[b], cu_k[b] + seqused_k[b])`` (``cu_k`` monotone without ``seqused_k``). Rows that no entry
    holds are left unwritten: NaN here, for the caller to clear. ``max_q`` bounds every entry's rows."""
    used_k = cu_k[1:] - cu_k[:-1] if seqused_k is None else seqused_k
    assert seqused_k is not None or bool((used_k >= 0).all()), "cu_k must be monotone without seqused_k"
    kw = {"causal": causal, "scale": scale, "window": window, "softcap": softcap}
    if seqused_q is None:
        return reference.forward(q, k, v, Pieces(cu_q, cu_k[:-1], used_k), **kw)
    assert bool((seqused_q <= max_q).all()), "an entry has more query rows than max_q"
    # the entries' rows, gathered in entry order: one piece each, then written back to their rows
    cu_sub = torch.cat([seqused_q.new_zeros(1), seqused_q.cumsum(0)]).int()
    entry = torch.repeat_interleave(torch.arange(seqused_q.shape[0]), seqused_q.long())
    rows = cu_q[:-1].long()[entry] + torch.arange(entry.shape[0]) - cu_sub[:-1].long()[entry]
    assert rows.unique().shape == rows.shape, "entries' query rows overlap"
    sub = reference.forward(q[rows], k, v, Pieces(cu_sub, cu_k[:-1], used_k), **kw)
    out = q.new_full((*q.shape[:2], v.shape[2]), float("nan"))
    lse = q.new_full((q.shape[1], q.shape[0]), float("nan"), dtype=sub[1].dtype)
    out[rows], lse[:, rows] = sub
    return out, lse


def in_place_backward_call(calls: list):
    """A varlen backward call with FA4's contract, on the reference kernel: entry ``b`` is query rows
    ``[cu_q[b], cu_q[b + 1])`` over keys ``[cu_k[b], cu_k[b + 1])``, or with ``seqused_q``/``seqused_k``
    the first ``seqused_q[b]`` rows and ``seqused_k[b]`` keys from there (``cu_q`` then need not
    advance by an entry's rows: rows between entries are nobody's), written into ``dq``/``dk``/``dv``
    (other rows left as they are). It checks what the kernel needs: ``cu_q`` and ``cu_k`` monotone,
    entries' used rows and keys disjoint. Records each call's ``rows`` and key count in ``calls``."""

    def call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, **rows):
        calls.append((rows, k.shape[0]))
        used_q = rows.get("seqused_q", cu_q[1:] - cu_q[:-1])
        used_k = rows.get("seqused_k", cu_k[1:] - cu_k[:-1])
        for cu, used in ((cu_q, used_q), (cu_k, used_k)):
            assert bool((cu[1:] >= cu[:-1]).all()) and bool((cu[:-1] + used <= cu[1:]).all())
        used_k = torch.where(used_q > 0, used_k, 0)
        # the entries' rows, gathered: one piece each
        cu_sub = torch.cat([used_q.new_zeros(1), used_q.cumsum(0)]).int()
        entry = torch.repeat_interleave(torch.arange(used_q.shape[0]), used_q.long())
        q_rows = cu_q[:-1].long()[entry] + torch.arange(entry.shape[0]) - cu_sub[:-1].long()[entry]
        pieces = Pieces(cu_sub, cu_k[:-1], used_k)
        sub = (dout[q_rows], q[q_rows], k, v, out[q_rows], lse[:, q_rows])
        dq, dk, dv = reference.backward(*sub, pieces, causal=causal, scale=scale, window=window, softcap=softcap)
        if not rows:
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        rows["dq"][q_rows] = dq.to(q.dtype)
        k_rows = scratch.keys_read(cu_k[:-1], used_k, k.shape[0])
        rows["dk"][k_rows], rows["dv"][k_rows] = dk[k_rows].to(k.dtype), dv[k_rows].to(v.dtype)
        return rows["dq"], rows["dk"], rows["dv"]

    return call


def fa4(calls: list | None = None) -> varlen.VarlenKernel:
    """A backend arranged as ``kernels.fa4`` (``in_place_backward``) over the emulated calls."""
    return varlen.VarlenKernel("fa4", forward_call, in_place_backward_call([] if calls is None else calls),
                               in_place_backward=True, variants=True)  # fmt: skip

"""Reference kernel: exact piece attention on any device and floating dtype (``contract``).

Rows are processed in blocks against the key window they need, with a dense mask:
simple and exact, meant for CPU tests and small runs, not for speed. It needs
none of the GPU backends' hints (the pieces' launch bounds and ``disjoint_keys``, the
backward's options) and accepts them. It computes in its accumulation dtype under autocast too:
autocast would run the score matmuls in bfloat16 or float16, whose sums and masks it is not written
for (a float32 bound does not fit them), and whose results the ops' fakes do not describe.
"""

from __future__ import annotations

import contextlib

import torch

from cpcompile.kernels.contract import Pieces, check_options
from cpcompile.kernels.metadata.scratch import place_grads
from cpcompile.kernels.sinks import joined

_ROW_BLOCK = 256


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _no_autocast(device: torch.device):
    """Autocast off for ``device``'s type (where it has autocast at all): the kernel casts itself."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _row_bounds(pieces: Pieces, causal: bool, window: tuple[int, int], num_rows: int):
    """Per query row: first visible key row and one past the last, and the row's position
    (where its window sits), ``[Tq]`` int64 each."""
    cu = pieces.cu_q.long()
    q_len = cu[1:] - cu[:-1]
    rows = torch.arange(num_rows, device=cu.device)
    piece = torch.searchsorted(cu, rows, right=True) - 1  # [Tq]
    lo = pieces.k_start.long()[piece]
    n = pieces.k_len.long()[piece]
    i = rows - cu[piece]
    at = lo + n - q_len[piece] if pieces.q_pos is None else pieces.q_pos.long()[piece]
    hi = lo + n
    if causal:
        hi = lo + (n - q_len[piece] + 1 + i).clamp(min=0) * (n > 0)
    if pieces.k_pos is None:  # key rows are positions: the window narrows the bounds
        left, right = window
        if left >= 0:
            lo = torch.maximum(lo, at + i - left)
        if right >= 0:
            hi = torch.minimum(hi, at + i + right + 1)
    return lo, hi, at + i


def _blocks(lo: torch.Tensor, hi: torch.Tensor):
    """Row blocks ``(r0, r1, k0, k1)`` with the key window their rows read."""
    for r0 in range(0, lo.shape[0], _ROW_BLOCK):
        r1 = min(r0 + _ROW_BLOCK, lo.shape[0])
        live = hi[r0:r1] > lo[r0:r1]
        if not bool(live.any()):
            continue
        k0 = int(lo[r0:r1][live].min())
        k1 = int(hi[r0:r1][live].max())
        yield r0, r1, k0, k1


def _scores(q, k, bounds, pieces: Pieces, window, r0, r1, k0, k1, scale, acc, softcap=0.0):
    """Masked scores ``[Hkv, G, rows, keys]`` (capped to ``softcap * tanh(s / softcap)`` where ``softcap``
    is not 0) and the derivative of the cap, ``1 - tanh^2`` (``None`` without one)."""
    lo, hi, at = bounds
    hkv = k.shape[1]
    qb = q[r0:r1].to(acc).unflatten(1, (hkv, -1))  # [rows, Hkv, G, D]
    kb = k[k0:k1].to(acc)  # [keys, Hkv, D]
    s = torch.einsum("rhgd,khd->hgrk", qb, kb) * scale
    slope = None
    if softcap:
        capped = torch.tanh(s / softcap)
        s, slope = softcap * capped, 1 - capped * capped
    keys = torch.arange(k0, k1, device=q.device)
    mask = (keys[None, :] >= lo[r0:r1, None]) & (keys[None, :] < hi[r0:r1, None])
    if pieces.k_pos is not None:  # positions with gaps: the window compares them
        y, x = pieces.k_pos.long()[k0:k1][None, :], at[r0:r1, None]
        left, right = window
        mask &= ((y >= x - left) | (left < 0)) & ((y <= x + right) | (right < 0))
    return s.masked_fill(~mask, float("-inf")), slope


def forward(q, k, v, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, sinks=None):
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.forward`."""
    with _no_autocast(q.device):
        return joined(_forward(q, k, v, pieces, causal=causal, scale=scale, window=window, softcap=softcap), sinks)


def _forward(q, k, v, pieces: Pieces, *, causal: bool, scale: float, window, softcap):
    acc = _acc_dtype(q.dtype)
    tq, hq, _ = q.shape
    out = torch.zeros(tq, hq, v.shape[2], dtype=acc, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=acc, device=q.device)
    bounds = _row_bounds(pieces, causal, window, tq)
    for r0, r1, k0, k1 in _blocks(*bounds[:2]):
        s, _ = _scores(q, k, bounds, pieces, window, r0, r1, k0, k1, scale, acc, softcap)
        m = s.amax(-1, keepdim=True).clamp(min=torch.finfo(acc).min)  # rows with no key stay finite
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        o = torch.einsum("hgrk,khd->rhgd", p / total.clamp(min=torch.finfo(acc).tiny), v[k0:k1].to(acc))
        out[r0:r1] = o.flatten(1, 2)
        lse[:, r0:r1] = (m + torch.log(total)).squeeze(-1).flatten(0, 1)
    return out.to(q.dtype), lse


def backward(
    dout, q, k, v, out, lse, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, grads=None,
    **options,
):  # fmt: skip
    """:meth:`~cpcompile.kernels.contract.AttentionKernel.backward`."""
    check_options(options)
    kw = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "grads": grads}
    with _no_autocast(q.device):
        return _backward(dout, q, k, v, out, lse, pieces, **kw)


def _backward(dout, q, k, v, out, lse, pieces: Pieces, *, causal: bool, scale: float, window, softcap, grads):
    acc = _acc_dtype(q.dtype)
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    bounds = _row_bounds(pieces, causal, window, tq)
    # delta_i = sum_d dO_i O_i: the softmax Jacobian's row term, [Hkv, G, Tq, 1]
    delta = (dout.to(acc) * out.to(acc)).sum(-1).t().unflatten(0, (hkv, -1)).unsqueeze(-1)
    # Rows without keys have lse = -inf; any finite stand-in keeps exp(-inf - lse) = 0.
    lse_g = lse.to(acc).clamp(min=torch.finfo(acc).min).unflatten(0, (hkv, -1)).unsqueeze(-1)  # [Hkv, G, Tq, 1]
    for r0, r1, k0, k1 in _blocks(*bounds[:2]):
        s, slope = _scores(q, k, bounds, pieces, window, r0, r1, k0, k1, scale, acc, softcap)
        p = torch.exp(s - lse_g[:, :, r0:r1])  # masked entries are exp(-inf) = 0
        do = dout[r0:r1].to(acc).unflatten(1, (hkv, -1))  # [rows, Hkv, G, D]
        dv[k0:k1] += torch.einsum("hgrk,rhgd->khd", p, do)
        dp = torch.einsum("rhgd,khd->hgrk", do, v[k0:k1].to(acc))
        ds = p * (dp - delta[:, :, r0:r1]) * scale
        if slope is not None:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2
            ds = ds * slope
        dq[r0:r1] = torch.einsum("hgrk,khd->rhgd", ds, k[k0:k1].to(acc)).flatten(1, 2)
        dk[k0:k1] += torch.einsum("hgrk,rhgd->khd", ds, q[r0:r1].to(acc).unflatten(1, (hkv, -1)))
    return dq.to(q.dtype), *place_grads(dk, dv, pieces.k_start, pieces.k_len, grads)

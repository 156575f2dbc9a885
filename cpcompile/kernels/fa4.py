"""FlashAttention-4 (``flash-attn-4``, module ``flash_attn.cute``; the ``fa4`` extra) behind the
kernel contract (``contract``), arranged as every flash-style varlen kernel is (``varlen``).

FA4 is the fastest attention kernel on Hopper and Blackwell (docs/attention-kernels.md).
Its forward reads each piece's keys in place (``cu_seqlens_k`` not monotone, ``seqused_k``),
and its entries' query rows from ``seqused_q`` in any order, which puts a rank's longest
work first (``metadata.order``). Its backward writes dK/dV per entry, which is wrong for
pieces whose key ranges overlap or decrease, and pads its accumulators by entry order, so
its entries stay in row order; it takes each entry's used rows (``seqused_q``,
``seqused_k``) and output buffers, so it runs in place, one call per layer of pieces whose
ranges are disjoint and increasing (up to ``varlen.IN_PLACE_LAYERS`` layers, the calls side
by side), and on each piece's own copy of its keys where the pieces need more layers or
leave more keys unread than they would copy (``varlen``). FA4 compiles each kernel variant
on first use (seconds), keyed on dtypes, head dims, causality and tile sizes, not on token
counts: packs of any size reuse it. It calls no host sync. Its functions are called inside
cpcompile's ops, so compiled graphs see only those ops.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

from cpcompile.kernels.varlen import VarlenKernel

#: The releases whose low-level functions (``_flash_attn_fwd``, ``_flash_attn_bwd``) this calls.
SUPPORTED = "flash-attn-4>=4.0.0b36,<4.1"


@functools.cache
def available() -> bool:
    """Whether FA4 is installed (the ``fa4`` extra), without importing it (that takes seconds)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


def supports(q: torch.Tensor, v: torch.Tensor | None = None) -> bool:
    """Whether FA4 runs ``q`` ``[T, H, D]`` (and ``v`` ``[T, Hkv, Dv]``, default ``Dv = D``) both ways:
    :func:`why_not` finds nothing against it."""
    return why_not(q, v) is None


def why_not(q: torch.Tensor, v: torch.Tensor | None = None) -> str | None:
    """What keeps FA4 from running ``q`` and ``v`` forward and backward (``None``: nothing): CUDA fp16/bf16
    on Hopper (head dims multiples of 8 up to 256) or Blackwell (up to 128, and DeepSeek's 192/128), and
    installed. Hopper's backward takes a value head dim of its own only without GQA (4.0.0b36's
    ``FlashAttentionBackwardSm90`` asserts ``head_dim == head_dim_v`` where query heads share K/V heads).
    Without a head dim (``kernels.select`` is given a dtype and device): device and dtype only."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return f"it runs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}"
    if not available():
        return f"it is not installed ({SUPPORTED}: pip install 'cpcompile[fa4]')"
    major = _major(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if major not in (9, 10, 11):
        return f"it runs on Hopper or Blackwell, got compute capability {major}.x"
    if q.dim() != 3:
        return None
    d, dv = q.shape[-1], q.shape[-1] if v is None else v.shape[-1]
    if d % 8 or dv % 8 or min(d, dv) < 8 or max(d, dv) > (256 if major == 9 else 128) and (d, dv) != (192, 128):
        return f"head dims {d}/{dv} (query-key/value) are outside what it runs on compute capability {major}.x"
    if major == 9 and d != dv and v is not None and v.shape[-2] != q.shape[-2]:
        return (
            f"on Hopper its backward needs as many K/V heads as query heads ({q.shape[-2]}) where the value head "
            f"dim ({dv}) differs from the query-key one ({d}); got {v.shape[-2]} K/V heads"
        )
    return None


@functools.cache
def _major(device: int) -> int:
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def _interface():
    from flash_attn.cute import interface

    return interface


@functools.cache
def supports_window() -> bool:
    """Whether the installed FA4's forward and backward both take a window (``window_size_left``)."""
    if not available():
        return False
    calls = (_interface()._flash_attn_fwd, _interface()._flash_attn_bwd)
    return all("window_size_left" in inspect.signature(f).parameters for f in calls)


def _keywords(cu_q, cu_k, max_q, max_k, causal, scale, window, softcap) -> dict:
    """What FA4's varlen forward and backward both take by name: the entries, their bounds and the mask
    (``softcap`` where not 0: its capped scores' backward)."""
    entries = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k}
    if window != (-1, -1):
        if not supports_window():
            raise ValueError(f"kernel 'fa4': this FlashAttention-4 takes no window in its backward ({SUPPORTED})")
        left, right = window  # FA4 leaves a side unbounded with None
        entries |= {"window_size_left": None if left < 0 else left, "window_size_right": None if right < 0 else right}
    if softcap:
        # exact in the backward as in the forward: in 4.0.0b36 ``_flash_attn_bwd`` turns ``softcap`` into
        # ``score_mod``/``score_mod_bwd`` (``utils.create_softcap_scoremod_bwd``: dS times 1 - tanh^2 of the
        # recomputed, scaled score) that reach the SM90 and SM100 backward kernels, varlen included (only
        # SM120 and head dim 256 on SM100 refuse it, which ``supports`` never picks); a release that dropped
        # it in the backward would be outside ``SUPPORTED``
        entries["softcap"] = softcap
    return entries | {"softmax_scale": scale, "causal": causal}


def _forward_call(
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, seqused_k=None, seqused_q=None, sinks=None
):  # fmt: skip
    kw = _keywords(cu_q, cu_k, max_q, max_k, causal, scale, window, softcap)
    used = {"seqused_q": seqused_q, "seqused_k": seqused_k}
    if sinks is not None:  # joined in the softmax (its lse includes them): the backward needs nothing more
        kw["learnable_sink"] = sinks if sinks.dtype in (torch.float16, torch.bfloat16, torch.float32) else sinks.float()
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, return_lse=True, **used, **kw)
    return out, lse


def _backward_call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, **rows):
    kw = _keywords(cu_q, cu_k, max_q, max_k, causal, scale, window, softcap)
    dq, dk, dv, *_ = _interface()._flash_attn_bwd(q, k, v, out, dout, lse, **kw, **rows)
    return dq, dk, dv


FA4 = VarlenKernel("fa4", _forward_call, _backward_call, in_place_backward=True, variants=True, joins_sinks=True)
forward, backward = FA4.forward, FA4.backward

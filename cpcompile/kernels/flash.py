"""torch's built-in flash varlen kernel (CUDA, fp16/bf16) behind the kernel contract (``contract``),
arranged as every flash-style varlen kernel is (``varlen``)."""

from __future__ import annotations

import torch

from cpcompile.kernels.varlen import VarlenKernel


def _band(window) -> dict:
    """The window arguments of torch's flash ops (2.11 to 2.13 alike)."""
    return {} if window == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}


def _forward_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, seqused_k=None):
    # softcap: always 0 (VarlenKernel refuses others for this kernel)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=seqused_k, **_band(window)
    )
    return out, lse


def _backward_call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    return torch.ops.aten._flash_attention_backward(
        *(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, rng.new_empty(0)),
        scale=scale,
        **_band(window),
    )


FLASH = VarlenKernel("flash", _forward_call, _backward_call)
forward, backward = FLASH.forward, FLASH.backward

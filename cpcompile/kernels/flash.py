"""torch's built-in flash varlen kernel (CUDA, fp16/bf16) behind the kernel contract (``contract``),
arranged as every flash-style varlen kernel is (``varlen``)."""

from __future__ import annotations

import torch

from .varlen import VarlenKernel


def _forward_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, seqused_k=None):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=seqused_k
    )
    return out, lse


def _backward_call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, rng.new_empty(0), scale=scale
    )


FLASH = VarlenKernel(_forward_call, _backward_call)
forward, backward = FLASH.forward, FLASH.backward

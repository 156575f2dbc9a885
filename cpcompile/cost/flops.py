"""Model FLOPs of a packed training step: the numerator of MFU (model FLOPs utilisation).

Counted as the field counts them (PaLM's appendix B, as torchtitan reports MFU):
``6 N`` per token for the matmuls of ``N`` parameters (forward 2, backward 4), plus
causal attention, whose pairs grow with each document's length squared and not
with the pack's: ``4 d`` per visible (query, key) pair and query head in the
forward (scores and the weighted sum), twice that in the backward. Recomputation
(activation checkpointing) is not model work and is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence


def causal_attention_flops(lengths: Sequence[int], heads: int, head_dim: int, window: int = -1) -> float:
    """Forward FLOPs of one layer's causal attention over documents of ``lengths`` tokens; ``window``:
    a sliding window's left side (each query sees at most ``window + 1`` keys; -1: none)."""
    w = max(lengths, default=0) if window < 0 else window
    return (
        4.0
        * head_dim
        * heads
        * sum(min(n, w + 1) * (min(n, w + 1) + 1) / 2 + max(n - w - 1, 0) * (w + 1) for n in lengths)
    )


def training_flops(lengths: Sequence[int], matmul_params: int, layers: int, heads: int, head_dim: int) -> float:
    """Model FLOPs of forward and backward over one pack of documents of ``lengths`` tokens."""
    return 6.0 * matmul_params * sum(lengths) + 3.0 * layers * causal_attention_flops(lengths, heads, head_dim)

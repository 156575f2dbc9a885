"""Model FLOPs, the numerator of MFU, against a count made pair by pair."""

from __future__ import annotations

from cpcompile.cost.flops import causal_attention_flops, training_flops


def test_causal_attention_counts_each_visible_pair_per_document():
    lengths, heads, d = [1, 3, 5], 2, 4
    pairs = sum(1 for n in lengths for i in range(n) for j in range(n) if j <= i)  # keys a query sees
    assert causal_attention_flops(lengths, heads, d) == 2 * 2 * d * heads * pairs  # QK^T and PV


def test_training_is_six_per_parameter_token_plus_three_attention_passes():
    lengths, params, layers = [7, 9], 1000, 3
    want = 6 * params * 16 + 3 * layers * causal_attention_flops(lengths, 4, 8)
    assert training_flops(lengths, params, layers, 4, 8) == want

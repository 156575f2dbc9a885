"""The compiled pass on real gloo ranks where attention sits inside a higher-order op.

Activation checkpointing (``torch.utils.checkpoint``, HF gradient checkpointing) puts each
checkpointed layer in a subgraph of the Dynamo graph; the pass must rewrite the attention
there too (a call left in it would attend within each rank's tokens alone). A two-layer
model, compiled, checkpointed per layer, trained one step on 2 ranks, must give the
single-process loss and gradients, whatever its layers' masks and which of them are checkpointed.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import cpcompile
from tests.dist import assert_matches_summed_over_ranks, run_ranks

pytestmark = pytest.mark.distributed

HEADS, KV_HEADS, DIM = 4, 2, 8


class Layer(torch.nn.Module):
    def __init__(self, window: tuple[int, int]) -> None:
        super().__init__()
        self.window = window  # (-1, 0) causal, (-1, -1) full
        self.q = torch.nn.Linear(HEADS * DIM, HEADS * DIM, bias=False)
        self.kv = torch.nn.Linear(HEADS * DIM, 2 * KV_HEADS * DIM, bias=False)

    def forward(self, x, cu):  # x [T, HEADS * DIM]
        q = self.q(x).view(-1, HEADS, DIM)
        k, v = self.kv(x).view(-1, 2 * KV_HEADS, DIM).split(KV_HEADS, dim=1)
        causal = self.window[1] == 0
        return x + cpcompile.packed_attention(q, k, v, cu, causal=causal, window_size=self.window).flatten(1)


class Model(torch.nn.Module):
    """Layers of the given windows, each checkpointed or not."""

    def __init__(self, layers: list[tuple[tuple[int, int], bool]]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(window) for window, _ in layers)
        self.checkpointed = [checkpointed for _, checkpointed in layers]

    def forward(self, x, cu):
        for layer, checkpointed in zip(self.layers, self.checkpointed, strict=True):
            x = checkpoint(layer, x, cu, use_reentrant=False) if checkpointed else layer(x, cu)
        return x


CAUSAL, FULL = (-1, 0), (-1, -1)
#: Layer stacks: (window, checkpointed) per layer. Layers of other masks read other outputs of their
#: shared plan (k_len_causal, k_len_full, the window's keys): AOT autograd must not merge their plan ops.
STACKS = [
    [(CAUSAL, True), (CAUSAL, True)],
    [(FULL, True), (CAUSAL, True)],
    [(CAUSAL, True), (FULL, True)],
    [(FULL, False), (CAUSAL, True)],
    [(CAUSAL, False), (FULL, True)],
    [(CAUSAL, True), ((4, 0), True)],
]


def _train_step(rank: int, world: int) -> None:
    lengths = [5, 17, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x, w = (torch.randn(sum(lengths), HEADS * DIM, generator=g) for _ in range(2))
    for stack in STACKS:
        torch.manual_seed(0)
        reference = Model(stack)
        model = Model(stack)
        model.load_state_dict(reference.state_dict())
        want = (reference(x, cu) * w).sum()
        want.backward()

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with cpcompile.strategy("balanced"):
            batch = cpcompile.shard_batch({"x": x, "w": w}, cu, cp_size=world, rank=rank)
            loss = (compiled(batch.tensors["x"], cu) * batch.tensors["w"]).sum()
        loss.backward()
        assert_matches_summed_over_ranks(loss, want, model, reference, f"of layers {stack}", 1e-5)


def test_checkpointed_layers_are_sharded():
    run_ranks(_train_step, 2)

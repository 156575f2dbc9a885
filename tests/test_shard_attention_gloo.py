"""Tier 4: the compiled pass on real gloo ranks where attention sits inside a higher-order op.

Activation checkpointing (``torch.utils.checkpoint``, HF gradient checkpointing) puts each
checkpointed layer in a subgraph of the Dynamo graph; the pass must rewrite the attention
there too (a call left in it would attend within each rank's tokens alone). A two-layer
model, compiled, checkpointed per layer, trained one step on 2 ranks, must give the
single-process loss and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import cpcompile
from tests.dist import run_ranks
from tests.reference import relative_error

HEADS, KV_HEADS, DIM = 4, 2, 8


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(HEADS * DIM, HEADS * DIM, bias=False)
        self.kv = torch.nn.Linear(HEADS * DIM, 2 * KV_HEADS * DIM, bias=False)

    def forward(self, x, cu):  # x [T, HEADS * DIM]
        q = self.q(x).view(-1, HEADS, DIM)
        k, v = self.kv(x).view(-1, 2 * KV_HEADS, DIM).split(KV_HEADS, dim=1)
        return x + cpcompile.packed_attention(q, k, v, cu).flatten(1)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x, cu):
        for layer in self.layers:
            x = checkpoint(layer, x, cu, use_reentrant=False)
        return x


def _train_step(rank: int, world: int) -> None:
    torch.manual_seed(0)
    reference = Model()
    model = Model()
    model.load_state_dict(reference.state_dict())
    lengths = [5, 17, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x, w = (torch.randn(sum(lengths), HEADS * DIM, generator=g) for _ in range(2))
    want = (reference(x, cu) * w).sum()
    want.backward()

    compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
    with cpcompile.strategy("balanced"):
        batch = cpcompile.shard_batch({"x": x, "w": w}, cu, cp_size=world, rank=rank)
        loss = (compiled(batch.tensors["x"], cu) * batch.tensors["w"]).sum()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert relative_error(total, want) < 1e-5, (total, want)
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        assert relative_error(grad, p_ref.grad) < 1e-4, name


def test_checkpointed_layers_are_sharded():
    run_ranks(_train_step, 2)

"""torchtitan's Llama 3 with varlen attention trained context-parallel (``cpcompile.integrations.titan``).

torchtitan's debug Llama 3 (two of its blocks), ``attn_backend="varlen"``, its code unchanged, each block
compiled with ``cpcompile.backend``, trains at cp=2 on gloo on packs of varying composition. The reference is
the same model on one process with each block's inner attention replaced by plain causal softmax attention
one document at a time (torch's ``varlen_attn`` has no CPU kernel), taking q, k and v in bfloat16 as
torchtitan's varlen path does and computing in float64: the loss and every gradient, summed over the ranks,
must match it to bfloat16 rounding of attention's inputs and output, and one graph serves all packs.

torchtitan is not in cpcompile's extras (it pins datasets<4.8 and its model package imports triton): the test
is skipped without it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

import cpcompile
from tests.dist import compiled_graphs, run_ranks
from tests.reference import relative_error

pytest.importorskip("torchtitan.models.llama3", reason="needs torchtitan (pip install torchtitan triton)")
titan = pytest.importorskip("cpcompile.integrations.titan")

PACKS = [[10, 25, 5, 1, 23], [40, 3, 17], [7, 7, 7, 2]]  # document lengths: T and B vary per step
LOSS = 1e-6  # the forward rounds attention's inputs and output to bfloat16 alike on both sides
GRADS = 1e-2  # attention's backward in bfloat16 (bfloat16 epsilon 7.8e-3)


def debug_llama() -> torch.nn.Module:
    """torchtitan's debug Llama 3 (dim 256, 16 heads, vocabulary 2048) with two blocks, seeded weights."""
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="varlen")
    config = dataclasses.replace(config, layers=config.layers[:2])
    torch.manual_seed(0)
    model = config.build()
    if hasattr(model, "init_weights"):
        model.init_weights()
    return model


class DocumentAttention(torch.nn.Module):
    """Causal attention one document at a time in float64, on q, k, v rounded to bfloat16 (the reference)."""

    def forward(self, q, k, v, *, attention_masks, scale=None, **kwargs):
        cu = attention_masks.cu_seq_q.tolist()
        q64, k64, v64 = (x[0].to(torch.bfloat16).double() for x in (q, k, v))  # [T, N, H]
        group = q64.shape[1] // k64.shape[1]
        out = []
        for a, b in zip(cu[:-1], cu[1:]):
            qd = q64[a:b].transpose(0, 1)
            kd, vd = (x[a:b].repeat_interleave(group, 1).transpose(0, 1) for x in (k64, v64))
            out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(out).to(torch.bfloat16).to(q.dtype)[None]


def pack(lengths: list[int], step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(2048, (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
    labels[cu[1:].long() - 1] = -100  # each document's last token predicts nothing
    positions = torch.cat([torch.arange(n) for n in lengths])
    return {"tokens": tokens, "positions": positions, "labels": labels, "cu": cu}


def _train_at_cp(rank: int, world: int) -> None:
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    reference, model = debug_llama(), debug_llama()
    for block in reference.layers.values() if isinstance(reference.layers, torch.nn.ModuleDict) else reference.layers:
        block.attention.inner_attention = DocumentAttention()
    torch._dynamo.reset()
    counters.clear()
    titan.compile_blocks(model, cpcompile.backend(inner="eager"))
    for step, lengths in enumerate(PACKS):
        p = pack(lengths, step)
        labelled = (p["labels"] != -100).sum()
        label = f"rank {rank} step {step} docs {lengths}"
        reference.zero_grad()
        masks = create_varlen_metadata_for_document(p["positions"][None])
        logits = reference(p["tokens"][None], attention_masks=masks, positions=p["positions"][None])
        want = F.cross_entropy(logits[0].double(), p["labels"], reduction="sum") / labelled
        want.backward()

        sharded = cpcompile.shard_batch(
            {k: p[k] for k in ("tokens", "positions", "labels")}, p["cu"], cp_size=world, rank=rank, strategy="balanced"
        )
        t = sharded.tensors
        model.zero_grad()
        with cpcompile.strategy(sharded):
            logits = model(
                t["tokens"][None], attention_masks=titan.varlen_metadata(sharded), positions=t["positions"][None]
            )
        loss = F.cross_entropy(logits[0].double(), t["labels"], reduction="sum") / labelled  # the rank's share
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert relative_error(total, want) < LOSS, f"loss {label}: {total} vs {want}"
        for (name, p_cp), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
            grad = p_cp.grad.clone()
            dist.all_reduce(grad)
            assert relative_error(grad, p_ref.grad) < GRADS, (
                f"grad of {name} {label}: {relative_error(grad, p_ref.grad)}"
            )
    assert compiled_graphs() == 1, compiled_graphs()


@pytest.mark.distributed
def test_torchtitan_varlen_llama_trains_at_cp2_as_one_process():
    run_ranks(_train_at_cp, 2)


def test_metadata_is_the_whole_pack():
    p = pack([7, 5], 0)
    sharded = cpcompile.shard_batch({"tokens": p["tokens"]}, p["cu"], cp_size=2, rank=1, strategy="balanced")
    masks = titan.varlen_metadata(sharded)
    assert masks.cu_seq_q.tolist() == [0, 7, 12] and masks.max_q == masks.max_k == 7
    with pytest.raises(ValueError, match="max_length must be an int of at least the longest document, 7; got 3"):
        titan.varlen_metadata(sharded, 3)

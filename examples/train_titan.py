"""torchtitan's Llama 3 with varlen attention, trained context-parallel with cpcompile.

torchtitan's own model (``llama3_configs["debugmodel"](attn_backend="varlen")``, its code unchanged; its CP
refuses varlen attention) with each transformer block compiled by ``cpcompile.backend``, so the
``varlen_attn`` call inside becomes CP attention. Each step the ranks draw the same pack of documents, keep
their share (``cpcompile.shard_batch`` of tokens, positions and labels), run the model under
``cpcompile.strategy(sharded)`` with the whole pack's ``VarlenMetadata`` (``cpcompile.integrations.titan``), and
sum gradients over the CP group.

    pip install torchtitan triton        # not a cpcompile extra: torchtitan pins datasets<4.8, imports triton
    torchrun --nproc-per-node 2 examples/train_titan.py             # CPU gloo, or GPUs with nccl

torchtitan's varlen path casts q, k and v to bfloat16; on CPU the rest runs in float32.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import require_torchrun
from torch._dynamo.utils import counters
from torchtitan.models.llama3 import llama3_configs

import cpcompile
from cpcompile.advisor.advise import BUILTIN_MIX, cut_pack, positive_int
from cpcompile.integrations import titan
from cpcompile.testing import synthetic_pack


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=2, help="blocks of the debug model (it has 6)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per pack (whole CP group)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--strategy", default="balanced", choices=[s.value for s in cpcompile.Strategy])
    p.add_argument("--inner", default="inductor", help="compiler after the CP pass: inductor, aot_eager, eager")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    try:
        args.backend = cpcompile.backend(inner=args.inner)
    except ValueError as e:
        p.error(str(e))
    return args


def main() -> None:
    args = parse_args()
    require_torchrun("examples/train_titan.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = llama3_configs["debugmodel"](attn_backend="varlen")
    config.layers = config.layers[: args.layers]
    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(device):
        model = config.build()
        model.init_weights()
    titan.compile_blocks(model, args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    draw = BUILTIN_MIX.sampler(torch.Generator().manual_seed(0))
    for step in range(args.steps):
        cu = cut_pack(draw, args.tokens)  # the same pack on every rank: one seeded draw
        lengths = torch.diff(cu).tolist()
        pack = synthetic_pack(lengths, config.vocab_size, torch.Generator().manual_seed(step))
        tensors = {"tokens": pack["input_ids"], "positions": pack["position_ids"], "labels": pack["labels"]}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=cp, rank=rank, strategy=args.strategy, device=device)
        t = sharded.tensors
        with cpcompile.strategy(sharded):
            logits = model(
                t["tokens"][None], attention_masks=titan.varlen_metadata(sharded), positions=t["positions"][None]
            )
        labelled = (pack["labels"] != -100).sum().to(device)
        # this rank's share of the pack's mean loss: the shares add up over the CP group, and so do the gradients
        loss = F.cross_entropy(logits[0].float(), t["labels"], ignore_index=-100, reduction="sum") / labelled
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss := loss.detach())
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} ({len(lengths)} documents)", flush=True)
    if rank == 0:  # one graph for every block and pack composition
        print(f"compiled graphs: {counters['stats']['unique_graphs']} over {args.steps} packs", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a Hugging Face Llama-architecture model with context parallelism: the GPU main job.

The model is transformers' own ``LlamaForCausalLM`` (random weights from a config),
with ``attn_implementation="cpcompile"``; every rank compiles it with
``cpcompile.backend``, takes its share of each pack (``shard_flattened_batch``, which
also makes the step's attention plan ahead of the step) and adds gradients over the
CP group. The progress line shows tokens/s per GPU and, on GPUs, MFU.

    torchrun --nproc-per-node 8 examples/train_hf.py --preset llama-8b-layers --layers 8 --tokens 131072
    torchrun --nproc-per-node 2 examples/train_hf.py                 # a tiny model, CPU or GPUs

--doclens FILE: document lengths as a JSON list of token counts, or a CSV of
``upper_bound_tokens,cumulative_percent``; without it, the advisor's built-in mix.
--regional compiles each decoder layer on its own (one compilation, reused by every
layer) instead of the whole model: compile time then does not grow with depth.

Runs on GPUs with nccl (one per rank, bf16) when CUDA is available, else on CPU with gloo (float32).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from launch import require_torchrun
from torch._dynamo.utils import counters

import cpcompile
import cpcompile.integrations.hf as cphf  # registers attn_implementation="cpcompile"; needs transformers
from cpcompile.advisor.advise import BUILTIN_MIX, cut_pack, length_sampler, positive_int
from cpcompile.cost.flops import training_flops
from cpcompile.testing import synthetic_pack
from cpcompile.testing.hf_llama import (
    LLAMA_8B_LAYERS,
    LlamaShape,
    causal_lm_loss,
    compile_llama,
    fully_shard_llama,
    matmul_params,
    random_llama,
)
from cpcompile.testing.losses import fuse_loss

#: Model shapes: ``tiny`` runs in seconds on CPU; ``llama-8b-layers`` is Llama-3-8B's layer shape.
PRESETS = {
    "tiny": LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256),
    "llama-8b-layers": LLAMA_8B_LAYERS,
}
#: Dense bf16 peak of the GPUs MFU is reported against (by device name), in FLOP/s.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12}


def parse_args() -> argparse.Namespace:
    """The arguments, all checked here: a bad one fails before any process group exists."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape (default: tiny)")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens per pack (whole CP group)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--strategy", default="balanced", choices=[s.value for s in cpcompile.Strategy])
    p.add_argument("--doclens", type=Path, metavar="FILE", help="document lengths (default: a built-in mix)")
    p.add_argument("--regional", action="store_true", help="compile each decoder layer, not the whole model")
    p.add_argument("--checkpointing", action="store_true", help="HF activation checkpointing of every layer")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over the CP ranks (decoder layers, lm_head, the stack)")
    p.add_argument("--loss", default="fused", choices=["fused", "hf"], help="fused: the loss from hidden states "
                   "chunk by chunk, no [T, vocab] logits (the default); hf: the model's own")  # fmt: skip
    p.add_argument("--inner", default="inductor", help="compiler after the CP pass: inductor, aot_eager, ...")
    p.add_argument("--lr", type=float, default=1e-4)
    args = p.parse_args()
    try:
        args.backend = cpcompile.backend(inner=args.inner)
        args.draw = length_sampler(args.doclens, torch.Generator().manual_seed(0)) if args.doclens else None
    except ValueError as e:
        p.error(str(e))
    return args


def main() -> None:
    args = parse_args()
    require_torchrun("examples/train_hf.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shape = PRESETS[args.preset]
    dtype = torch.bfloat16 if cuda else torch.float32
    model = random_llama(
        shape, args.layers, max_tokens=args.tokens, device=device, dtype=dtype, checkpointing=args.checkpointing
    )
    params = matmul_params(model)
    fused = args.loss == "fused"
    if fused:
        fuse_loss(model.lm_head)  # the loss in the output projection's forward, where FSDP2 gathers its weight
    if args.fsdp:  # parameters, gradients and optimizer state sharded over the CP ranks, gradients summed
        fully_shard_llama(model)
    compiled = compile_llama(model, args.backend, regional=args.regional, base=fused)
    # fused on CUDA: one pass over each parameter and its state (foreach makes several)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, **({"fused": True} if cuda else {"foreach": True}))
    peak = next((f for name, f in PEAK_FLOPS.items() if cuda and name in torch.cuda.get_device_name()), None)
    draw = args.draw or BUILTIN_MIX.sampler(torch.Generator().manual_seed(0))
    strategy = cpcompile.Strategy(args.strategy)
    # balanced evens, and auto weighs, the work of the model's layers as they run: sliding windows
    # (none in Llama) cap it
    told = strategy in (cpcompile.Strategy.BALANCED, cpcompile.Strategy.AUTO)
    windows = cphf.layer_windows(model.config) if told else ()
    spec = cpcompile.StrategySpec(strategy, windows=windows)

    start, tokens, flops = time.perf_counter(), 0, 0.0
    for step in range(args.steps):
        cu = cut_pack(draw, args.tokens)  # the same pack on every rank: one seeded draw
        lengths = torch.diff(cu).tolist()
        pack = synthetic_pack(lengths, shape.vocab, torch.Generator().manual_seed(step))
        batch = {k: pack[k][None] for k in ("input_ids", "position_ids")} | {"cu_seq_lens_q": cu}
        batch["labels"] = batch["input_ids"]  # unshifted, as DataCollatorWithFlattening gives them
        inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=cp, rank=rank, strategy=spec, device=device)
        with cpcompile.strategy(sharded):
            # this rank's share of the pack's mean loss
            loss = causal_lm_loss(compiled, model, inputs) if fused else compiled(**inputs).loss
        loss.backward()
        if not args.fsdp:  # (FSDP2 reduce-scatters them itself)
            for p in model.parameters():  # the loss is a sum over ranks: so are its gradients
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:  # the first step compiles: rates count the steps after it
            tokens += int(cu[-1])
            flops += training_flops(lengths, params, args.layers, shape.heads, shape.head_dim)
        if step == 0 or step == args.steps - 1 or (step + 1) % 5 == 0:
            dist.all_reduce(loss := loss.detach())  # the pack's mean loss: the ranks' shares added
            if rank == 0:
                report(step, args.steps, loss.item(), start, tokens, flops, cp, peak)
        if step == 0:  # reading the loss waited for the first step's GPU work: timing starts after it
            start = time.perf_counter()
    if rank == 0:  # one per region and dynamic shape, whatever the packs' lengths and document counts
        print(f"compiled graphs: {counters['stats']['unique_graphs']} over {args.steps} packs", flush=True)
    dist.barrier()  # all done before teardown: exiting with a live gloo group can abort
    dist.destroy_process_group()


def report(step: int, steps: int, loss: float, start: float, tokens: int, flops: float, cp: int, peak) -> None:
    """One line per report (logs keep them apart): the loss, tokens/s per GPU and MFU since the first step.

    Reached after reading the loss, which waited for the GPU: only report steps wait for it."""
    elapsed = time.perf_counter() - start
    rate = f"{tokens / elapsed / cp:,.0f} tok/s per GPU" if tokens else "compiled"
    mfu = f", MFU {flops / elapsed / cp / peak:.3f}" if tokens and peak else ""
    print(f"step {step + 1}/{steps} loss {loss:.4f} {rate}{mfu}", flush=True)


if __name__ == "__main__":
    main()

"""Context-parallel attention on CPU ranks equals single-device attention.

Two (``--cp``) gloo processes each take their shard of one packed batch, run
``cpcompile.cp_attention`` forward and backward for every strategy (``auto`` as
``shard_batch`` resolves it), and compare output and gradients with
``cpcompile.packed_attention`` on the whole batch.

    python examples/cp_attention_demo.py [--cp 2] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cpcompile

# every strategy; auto is resolved per batch by shard_batch, which records its pick in the batch's spec
STRATEGIES = [
    cpcompile.StrategySpec(s, stripe_size=16 if s is cpcompile.Strategy.STRIPED else 1) for s in cpcompile.Strategy
]


def packed_lengths(total: int, generator: torch.Generator) -> list[int]:
    """Document lengths of a pack: log-normal, median 150 tokens, the last one cut at ``total``."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(max(1, int(torch.empty(1).log_normal_(5.0, 1.0, generator=generator))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def run(rank: int, cp: int, init_file: str, tokens: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cp)
    g = torch.Generator().manual_seed(0)  # same batch on every rank
    lengths = packed_lengths(tokens, g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, dout = torch.randn(tokens, 8, 64, generator=g), torch.randn(tokens, 8, 64, generator=g)
    k, v = torch.randn(tokens, 2, 64, generator=g), torch.randn(tokens, 2, 64, generator=g)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = cpcompile.packed_attention(*full, cu)
    want_grads = torch.autograd.grad(want, full, dout)

    if rank == 0:
        print(f"{len(lengths)} documents, {tokens} tokens, cp={cp}, q heads 8, kv heads 2, head dim 64")
        print(f"{'strategy':<24}{'padding':>8}{'out err':>10}{'dq err':>10}{'dk err':>10}{'dv err':>10}")
    for spec in STRATEGIES:
        shard = cpcompile.shard_batch({"q": q, "k": k, "v": v, "dout": dout}, cu, cp_size=cp, rank=rank, strategy=spec)
        local = [shard.tensors[n].clone().requires_grad_() for n in "qkv"]
        out = cpcompile.cp_attention(*local, cu, cu_seqlens_padded=shard.cu_seqlens_padded, strategy=shard)
        grads = torch.autograd.grad(out, local, shard.tensors["dout"])
        # back to the unpadded global order, to compare with the single-device run
        real = cpcompile.batch.physical_positions(cu, shard.cu_seqlens_padded)
        errors = [
            (cpcompile.unshard(got.detach(), shard)[real] - ref).abs().max().item()
            for got, ref in zip([out, *grads], [want, *want_grads])
        ]
        if rank == 0:
            name = f"{spec.strategy.value}" + (f" (stripe {spec.stripe_size})" if spec.stripe_size > 1 else "")
            if spec.strategy is cpcompile.Strategy.AUTO:
                name += f" -> {shard.spec.strategy.value}"
            pad = int(shard.cu_seqlens_padded[-1]) - tokens
            print(f"{name:<24}{pad:>8}" + "".join(f"{e:>10.1e}" for e in errors))
            assert max(errors) < 1e-4, "CP attention differs from single-device attention"
    if rank == 0:
        print("cp_attention equals single-device packed_attention for every strategy")
    dist.barrier()  # all done before teardown: exiting with a live gloo group can abort
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="CP ranks (CPU processes)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the packed batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args.cp, os.path.join(tmp, "init"), args.tokens), nprocs=args.cp)


if __name__ == "__main__":
    main()

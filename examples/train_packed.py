"""Train a packed GPT with context parallelism through ``torch.compile``.

The model (``cpcompile/testing/packed_gpt.py``) is written for one device. Every rank
compiles it with ``cpcompile.backend``, takes its shard of each pack (``shard_batch``)
and adds gradients over the CP group. Rank 0 then trains the same model on one process, on
the same packs, and checks that the two loss curves match.

    torchrun --nproc-per-node 2 examples/train_packed.py --strategy dual_chunk_swap
    torchrun --nproc-per-node 3 examples/train_packed.py --doclens lengths.json
    torchrun --nproc-per-node 2 examples/train_packed.py --strategy striped --kv ring

--doclens FILE: document lengths as a JSON list of token counts, or a CSV of
``upper_bound_tokens,cumulative_percent`` (a length histogram as a CDF); without it,
a log-normal mix (median 1,914 tokens, mean 3,052).

Runs on CPU with gloo, or on GPUs with nccl (one per rank) when CUDA is available.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from launch import require_torchrun
from torch._dynamo.utils import counters

import cpcompile
from cpcompile.advisor.advise import cut_pack, length_sampler, positive_int
from cpcompile.config import KV
from cpcompile.testing import GPTConfig, PackedGPT, sample_lengths, summed_loss, synthetic_pack


def parse_args() -> argparse.Namespace:
    """The arguments, all checked here: a bad one fails before any process group exists."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    strategies = [s.value for s in cpcompile.Strategy]
    p.add_argument("--strategy", default="dual_chunk_swap", choices=strategies, help="how tokens are split over ranks")
    p.add_argument("--stripe-size", type=int, default=None, help="tokens per stripe for --strategy striped")
    p.add_argument(
        "--kv", default="auto", choices=KV[:-1], help="how K/V move (StrategySpec.kv; 'heads' needs head_parallel)"
    )
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--tokens", type=positive_int, default=4096, help="tokens per packed batch (whole CP group)")
    p.add_argument(
        "--doclens",
        type=Path,
        default=None,
        metavar="FILE",
        help="document lengths: a JSON list of token counts, or a CSV of upper_bound_tokens,cumulative_percent "
        "(default: a log-normal mix, median 1,914 tokens)",
    )
    p.add_argument("--inner", default="inductor", help="compiler after the CP pass: inductor, aot_eager, eager, ...")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--no-check", action="store_true", help="skip the single-process reference run")
    args = p.parse_args()
    stripe = 1 if args.stripe_size is None else args.stripe_size
    try:
        args.spec = cpcompile.StrategySpec(cpcompile.Strategy(args.strategy), stripe_size=stripe, kv=args.kv)
    except ValueError as e:
        p.error(f"--stripe-size: {e}")
    try:
        args.backend = cpcompile.backend(inner=args.inner)
    except ValueError as e:
        p.error(f"--inner: {e}")
    if args.doclens is not None:
        try:
            length_sampler(args.doclens, torch.Generator())  # a bad file fails here, before any process group
        except ValueError as e:
            p.error(str(e))
    return args


def packs(args, vocab: int):
    """The same sequence of packs on every rank (seeded), with document lengths that vary."""
    g = torch.Generator().manual_seed(1234)
    if args.doclens is None:
        return [synthetic_pack(sample_lengths(args.tokens, g), vocab, g) for _ in range(args.steps)]
    draw = length_sampler(args.doclens, g)
    return [synthetic_pack(torch.diff(cut_pack(draw, args.tokens)).tolist(), vocab, g) for _ in range(args.steps)]


def train(model, step_fn, data, optimizer, label: str, show: bool) -> list[float]:
    # a bar redrawn in place on a terminal; one line per step in captured logs, where "\r" runs steps together
    redraw = show and sys.stdout.isatty()
    losses, start = [], time.perf_counter()
    for i, pack in enumerate(data):
        optimizer.zero_grad()
        loss = step_fn(model, pack)
        optimizer.step()
        losses.append(loss)
        if show:
            rate = (i + 1) * int(pack["cu_seqlens"][-1]) / (time.perf_counter() - start)
            status = f"step {i + 1}/{len(data)} loss {loss:.4f} {rate:,.0f} tok/s"
            if redraw:
                bar = "#" * (20 * (i + 1) // len(data))
                print(f"\r{label:<28} [{bar:<20}] {status}", end="", flush=True)
            else:
                print(f"{label:<28} {status}", flush=True)
    if redraw:
        print()
    return losses


def main() -> None:
    args = parse_args()
    require_torchrun("examples/train_packed.py")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = GPTConfig(vocab=64, dim=64, heads=4, kv_heads=2, layers=2, max_position=max(8192, args.tokens))
    data = packs(args, cfg.vocab)
    torch.manual_seed(0)
    init = PackedGPT(cfg).state_dict()

    model = PackedGPT(cfg).to(device)
    model.load_state_dict(init)
    compiled = torch.compile(model, backend=args.backend, dynamic=True)

    def cp_step(m, pack):
        cu = pack["cu_seqlens"]
        batch = cpcompile.shard_batch(
            {k: pack[k] for k in ("input_ids", "labels", "position_ids")}, cu, cp_size=world, rank=rank
        )
        t = {k: v.to(device) for k, v in batch.tensors.items()}
        labelled = int((pack["labels"] != -100).sum())
        max_len = int((cu[1:] - cu[:-1]).max())
        with cpcompile.strategy(batch):  # the batch's layout, and whose rows these are
            logits = compiled(t["input_ids"], t["position_ids"], batch.cu_seqlens.to(device), max_len)
        loss = summed_loss(logits, t["labels"]) / labelled
        loss.backward()
        for p in m.parameters():  # the loss is a sum over ranks: so are its gradients
            dist.all_reduce(p.grad)
        dist.all_reduce(loss := loss.detach())
        return loss.item()

    with cpcompile.strategy(args.spec):
        label = f"cp={world} {cpcompile.spec.current_spec().strategy.value} {args.kv}"
        cp_losses = train(model, cp_step, data, torch.optim.AdamW(model.parameters(), lr=args.lr), label, rank == 0)
    graphs = counters["stats"]["unique_graphs"]

    if rank == 0:
        print(f"compiled graphs: {graphs} for {args.steps} packs of varying document counts")
        if not args.no_check:
            reference = PackedGPT(cfg).to(device)
            reference.load_state_dict(init)

            def single_step(m, pack):
                p = {k: v.to(device) for k, v in pack.items()}
                max_len = int((pack["cu_seqlens"][1:] - pack["cu_seqlens"][:-1]).max())
                loss = summed_loss(m(p["input_ids"], p["position_ids"], p["cu_seqlens"], max_len), p["labels"])
                loss = loss / int((pack["labels"] != -100).sum())
                loss.backward()
                return loss.item()

            opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
            ref_losses = train(reference, single_step, data, opt, "one process, eager", True)
            worst = max(abs(a - b) / abs(b) for a, b in zip(cp_losses, ref_losses))
            print(f"loss curves: largest relative difference {worst:.2e} over {args.steps} steps")
            if worst > 1e-3:
                raise SystemExit("CP training diverged from the single-process run")
    dist.barrier()  # all done before teardown: exiting with a live gloo group can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

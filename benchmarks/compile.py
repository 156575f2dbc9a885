"""Compilations and compile time over varying microbatches, with and without the CP pass.

50 microbatches whose token count and document count all differ go through one
compiled packed GPT (forward and backward). With the pass, each is one CP rank's
shard (cp=2 on a fake process group: graphs and timings are real, collective
values are not); without it, the whole pack on one device. It prints its section
of ``BENCHMARKS.md``; ``--output FILE`` also writes it there.

    python benchmarks/compile.py [--steps 50] [--inner aot_eager inductor] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from report import add_output_argument, header, publish
from torch._dynamo.utils import counters
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile
from cpcompile.testing import GPTConfig, PackedGPT, sample_lengths, summed_loss, synthetic_pack

HEADING = "## Compile (benchmarks/compile.py)"
CP = 2


def batches(steps: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1024, 4096, (steps,), generator=g).tolist()
    return [synthetic_pack(sample_lengths(n, g), vocab, g) for n in sizes]


def run(model, backend, data, shard: bool) -> tuple[int, float, float]:
    """(graphs compiled, compile s, median step ms); compile = first step - median step."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    times = []
    for pack in data:
        cu = pack["cu_seqlens"]
        t = pack
        if shard:
            keys = ("input_ids", "labels", "position_ids")
            t = cpcompile.shard_batch({k: pack[k] for k in keys}, cu, cp_size=CP, rank=0).tensors
        start = time.perf_counter()
        max_len = int((cu[1:] - cu[:-1]).max())
        summed_loss(compiled(t["input_ids"], t["position_ids"], cu, max_len), t["labels"]).backward()
        times.append(time.perf_counter() - start)
    median = sorted(times[1:])[len(times) // 2 - 1]
    return counters["stats"]["unique_graphs"], times[0] - median, 1e3 * median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--inner", nargs="+", default=["aot_eager", "inductor"])
    add_output_argument(parser)
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CP)
    cfg = GPTConfig(vocab=64, dim=64, heads=4, kv_heads=2, layers=2, max_position=4096)
    torch.manual_seed(0)
    model = PackedGPT(cfg)
    data = batches(args.steps, cfg.vocab)
    torch._inductor.config.force_disable_caches = True  # every compile starts cold, both ways
    rows = ["| inner | CP pass | graphs compiled | compile s | step, median ms |", "| --- | --- | --- | --- | --- |"]
    graphs_seen = set()
    for inner in args.inner:
        for with_pass in (False, True):
            backend = cpcompile.backend(inner=inner) if with_pass else inner
            graphs, first, later = run(model, backend, data, shard=with_pass)
            graphs_seen.add(graphs)
            rows.append(f"| {inner} | {'yes (cp=2)' if with_pass else 'no'} | {graphs} | {first:.1f} | {later:.1f} |")
            print(rows[-1], file=sys.stderr, flush=True)  # progress
    docs = [len(p["cu_seqlens"]) - 1 for p in data]
    tokens = [int(p["cu_seqlens"][-1]) for p in data]
    lines = [
        *header(HEADING),
        f"{args.steps} microbatches of {min(tokens)}-{max(tokens)} tokens and {min(docs)}-{max(docs)} documents "
        "(ProLong-like lengths), forward + backward of a 2-layer packed GPT, `dynamic=True`, caches off. "
        "Compile = first step minus the median step. Steps run CPU kernels (the exact reference attention, "
        "on the whole pack without the pass and on one rank's half with it) and a fake group. Each inner's "
        "first run (without the pass) also pays one-time imports and warm-up.",
        "",
        *rows,
        "",
        f"Graphs compiled per run: {', '.join(map(str, sorted(graphs_seen)))}, for {args.steps} microbatches of "
        "different token and document counts.",
    ]
    publish(HEADING, lines, args.output)


if __name__ == "__main__":
    main()

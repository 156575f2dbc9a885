"""TP overlap: all-gather + matmul run sequentially, as cpcompile.tp.ag_gemm, and as torch's fused op.

Each of ``--gpus`` ranks holds ``x [t, K]`` and ``w [N_local, K]`` and computes
``all_gather(x) @ w.T`` -> ``[tp * t, N_local]`` (bf16). Per (t, N_local), timed with CUDA
events (mean of ``--iters`` back-to-back calls after ``--warmup``; the slowest rank counts):

    comm        all_gather_into_tensor alone
    gemm        the [tp * t, K] x [K, N_local] matmul alone
    bound       max(comm, gemm): what perfect overlap reaches
    sequential  all_gather, then mm
    ag_gemm     cpcompile.tp.ag_gemm on buffers of capacity max(t) (allocated once): copy engine
                over symmetric memory, and ``ag_gemm p2p`` (``tp_comm="p2p"``, NCCL p2p)
    torch fused torch.ops.symm_mem.fused_all_gather_matmul (micro-pipeline TP's op)

Prints its section of ``BENCHMARKS.md`` (milliseconds and each variant's ratio to the bound);
``--output FILE`` also writes it there. Needs >= 2 GPUs; elsewhere it says so and exits 0.

    python benchmarks/tp_overlap.py [--tokens 1024,4096,16384] [--n 1024,3584,7168] [--k 8192] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from report import add_output_argument, header, publish

import cpcompile
from cpcompile.comm.collectives import all_gather_rows

HEADING = "## TP overlap (benchmarks/tp_overlap.py)"
TIMED = ("sequential", "ag_gemm", "ag_gemm p2p", "torch fused")


def _ag_gemm(x, w, group, capacity: int, comm: str):
    def fn():
        return cpcompile.tp.ag_gemm(x, w, group=group, capacity_tokens=capacity, tp_comm=comm)

    return fn


def _variants(x, w, gathered, group, capacity: int) -> dict:
    return {
        "comm": lambda: all_gather_rows(x, group),
        "gemm": lambda: gathered @ w.t(),
        "sequential": lambda: all_gather_rows(x, group) @ w.t(),
        "ag_gemm": _ag_gemm(x, w, group, capacity, "symm_mem"),
        "ag_gemm p2p": _ag_gemm(x, w, group, capacity, "p2p"),
    }


def _timed(fn, *, warmup: int, iters: int) -> float:
    """Mean milliseconds per call over ``iters`` back-to-back calls, the slowest rank's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _torch_fused(x: torch.Tensor, w: torch.Tensor, group_name: str):
    """torch's fused all-gather matmul, or None with the reason when this torch/machine lacks it."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        with warnings.catch_warnings():  # deprecated (a no-op) from torch 2.13, required before
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        op = torch.ops.symm_mem.fused_all_gather_matmul
        fn = lambda: op(x, [w.t()], 0, group_name, return_A=False)  # noqa: E731
        fn()
        return fn, None
    except Exception as e:  # noqa: BLE001  (report any failure as "n/a", keep benchmarking)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _bench_rank(rank: int, tp: int, init_file: str, args, rows: list) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=tp, device_id=torch.device("cuda", rank)
    )
    group = dist.group.WORLD
    capacity = max(args.tokens)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    notes = set()
    for t in args.tokens:
        for n in args.n:
            x = torch.randn(t, args.k, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(n, args.k, device="cuda", dtype=torch.bfloat16, generator=gen) / args.k**0.5
            gathered = all_gather_rows(x, group)
            want = gathered @ w.t()
            err = max(
                ((fn().float() - want.float()).abs().max() / want.float().abs().max()).item()
                for fn in (_ag_gemm(x, w, group, capacity, comm) for comm in ("symm_mem", "p2p"))
            )
            fused, why = _torch_fused(x, w, group.group_name)
            if why:
                notes.add(why)
            fns = _variants(x, w, gathered, group, capacity) | {"torch fused": fused}
            ms = {name: _timed(fn, warmup=args.warmup, iters=args.iters) if fn else None for name, fn in fns.items()}
            if rank == 0:
                rows.append((t, n, err, ms))
    if rank == 0:
        rows.append(sorted(notes))
    dist.destroy_process_group()


def _cell(ms: float | None, bound: float) -> str:
    return "n/a" if ms is None else f"{ms:.3f} ({ms / bound:.2f})"


def _table(rows, tp: int, k: int) -> list[str]:
    head = f"tp={tp}, K={k}, bf16; ms (ratio to bound = max(comm, gemm))"
    cols = [
        "t",
        "N_local",
        "comm",
        "gemm",
        "bound",
        "sequential",
        "ag_gemm",
        "ag_gemm p2p",
        "torch fused",
        "ag_gemm err",
    ]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for t, n, err, ms in rows:
        bound = max(ms["comm"], ms["gemm"])
        timed = " | ".join(_cell(ms[name], bound) for name in TIMED)
        lines.append(f"| {t} | {n} | {ms['comm']:.3f} | {ms['gemm']:.3f} | {bound:.3f} | {timed} | {err:.1e} |")
    return lines


def reading(rows) -> list[str]:
    """Each variant's ratio to the bound over the shapes, and how often ag_gemm beats torch's fused op."""
    timings = [ms for *_, ms in rows]
    bounds = [max(ms["comm"], ms["gemm"]) for ms in timings]
    ratios = {name: [ms[name] / b for ms, b in zip(timings, bounds) if ms[name] is not None] for name in TIMED}
    pairs = [(ms["ag_gemm"], ms["torch fused"]) for ms in timings if ms["torch fused"] is not None]
    spread = [f"{n} {min(r):.2f}-{max(r):.2f} (median {statistics.median(r):.2f})" for n, r in ratios.items() if r]
    lines = ["Ratio to the bound over the shapes: " + "; ".join(spread) + "."]
    if pairs:
        faster = sum(ag <= fused for ag, fused in pairs)
        lines.append(f"ag_gemm is at least as fast as torch's fused op in {faster} of {len(pairs)} shapes.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--tokens", type=ints, default=[1024, 4096, 16384], help="tokens per rank, t")
    parser.add_argument("--n", type=ints, default=[1024, 3584, 7168], help="output features per rank, N_local")
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--gpus", type=int, default=None, help="TP size (default: every visible GPU)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    add_output_argument(parser)
    args = parser.parse_args()
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = args.gpus or found
    if found < 2 or tp < 2 or tp > found:
        print(f"tp_overlap: needs >= 2 GPUs (found {found}, asked for {args.gpus}); nothing measured")
        return
    rows = mp.get_context("spawn").Manager().list()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _bench_rank, args=(tp, os.path.join(tmp, "init"), args, rows), nprocs=tp, start_method="spawn"
        )
    *rows, notes = list(rows)
    lines = [*header(HEADING), *_table(rows, tp, args.k), "", *reading(rows)]
    lines += [f"torch fused n/a: {note}" for note in notes]
    publish(HEADING, lines, args.output)


if __name__ == "__main__":
    main()

"""CP attention step with real communication, on several GPUs (``torchrun``, NCCL).

Every rank runs ``cp_attention`` (K/V all-gather, one kernel call over its pieces,
and in backward the re-gather and dK/dV reduce-scatter; or the sparse exchange of
only the rows each rank reads, ``cpcompile.attention.exchange``, forced each way with
``StrategySpec.kv``) on its shard of one pack;
CP efficiency = single-GPU ``packed_attention`` time / (cp x slowest rank). The ring
(``kv="ring"``: K/V blocks passed around, one kernel call per step) is checked and
timed beside it for dual_chunk_swap and balanced. Before each timing, every rank's output
and its gradients for a fixed dO, on the plan that is timed, are checked against one GPU's
(bf16: largest difference under 2.5e-2 of the largest value, relative L2 under 2e-2).
Rank 0 prints its section of ``BENCHMARKS.md``; ``--output FILE`` also writes it there.

    torchrun --nproc-per-node 2 benchmarks/cp_step.py --doclens .../prolong.json [--tokens 131072]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_gpu import STRATEGIES, timed  # noqa: E402
from report import add_output_argument, command, header, publish  # noqa: E402

import cpcompile  # noqa: E402
from cpcompile import kernels  # noqa: E402
from cpcompile.cache import upload  # noqa: E402
from cpcompile.comm.collectives import all_gather_rows  # noqa: E402
from cpcompile.testing import sample_lengths  # noqa: E402

HEADING = "## CP step with communication (benchmarks/cp_step.py)"
RING_LAYOUTS = ("dual_chunk_swap", "balanced")  # also run with kv="ring"


def rank_plan(cu, padded, spec, local_tokens: int, device):
    """This rank's plan, built once per step on the host and shared by the layers."""
    build = cpcompile.plan.ring.make_ring_plan if spec.kv == "ring" else cpcompile.plan.make_plan
    cp, rank = dist.get_world_size(), dist.get_rank()
    plan = build(cu.cpu(), padded.cpu(), cp_size=cp, rank=rank, strategy=spec, num_tokens=local_tokens * cp)
    # uploaded with host twins: what derives from it (the sparse exchange's plan, kernel metadata) reads them, no sync
    return type(plan)(*(upload(t, device) for t in plan))


def step(q, k, v, cu, padded, spec, max_len, backward: bool, plan):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]

    def run():
        out = cpcompile.cp_attention(
            *leaves, cu, cu_seqlens_padded=padded, strategy=spec, max_seqlen=max_len, plan=plan
        )
        if backward:  # the gradients returned, not accumulated into .grad (as ``single``'s)
            torch.autograd.grad(out, leaves, out)

    return run


def check_rank(local, cu, padded, spec, max_len, plan, want, dout, rows, picked, label: str) -> None:
    """This rank's rows of the output (``dout`` None) or of the gradients for ``dout`` against
    one GPU's ``want``, every rank failing together. The backward first runs once with the
    full mask on the same plan: the dK/dV buffers it leaves must not reach the causal sums."""
    backward = dout is not None

    def call(causal: bool):
        leaves = [t.detach().requires_grad_(backward) for t in local]
        out = cpcompile.cp_attention(
            *leaves, cu, cu_seqlens_padded=padded, strategy=spec, max_seqlen=max_len, plan=plan, causal=causal
        )
        if not backward:
            return [out]
        local_dout = torch.zeros_like(out)
        local_dout[rows] = dout[picked]
        return torch.autograd.grad(out, leaves, local_dout)

    if backward:
        call(causal=False)
    errors = []
    for name, got, ref in zip(("dq", "dk", "dv") if backward else ("out",), call(causal=True), want):
        delta = got[rows].float() - ref[picked].float()
        largest = (delta.abs().max() / ref.abs().max()).item()
        l2 = (delta.norm() / ref[picked].float().norm()).item()
        if largest >= 2.5e-2 or l2 >= 2e-2:
            errors.append(f"{name}: largest difference {largest:.3g} of the largest value, relative L2 {l2:.3g}")
    failed = torch.tensor(len(errors), device=dout.device if backward else want[0].device)
    dist.all_reduce(failed)
    assert not failed.item(), (
        f"{label}: CP against one GPU on rank {dist.get_rank()}: {errors or 'another rank failed'}"
    )


def section(cp: int, tokens: int, source: str, documents: int, kernel: str, rows: list[str], timed_rows) -> list[str]:
    """The section below its header: the setup, the table, the most efficient row per head layout and pass."""
    best = {}
    for key, what, efficiency in timed_rows:
        best[key] = max(best.get(key, (0.0, "")), (efficiency, what))
    return [
        f"cp={cp}, {tokens} tokens from `{source}` ({documents} documents), bf16, head dim 128, kernel `{kernel}`; "
        "median of 5 timed steps after 2 warm-ups. K/V: all-gathered (in 1 or 2 head-group chunks), the sparse "
        "exchange, or the ring, each forced; every rank's output and gradients matched one GPU's before its timing. "
        "Analyses: [docs/communication.md](docs/communication.md).",
        "",
        *rows,
        "",
        "Highest efficiency: " + "; ".join(f"{key} {what} {eff:.3f}" for key, (eff, what) in best.items()) + ".",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doclens", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=131072)
    add_output_argument(parser)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    lengths = sample_lengths(args.tokens, torch.Generator().manual_seed(0), json.loads(args.doclens.read_text()))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    max_len = max(lengths)
    kernel = kernels.select(torch.empty(0, device=device, dtype=torch.bfloat16)).__name__.rsplit(".", 1)[-1]
    g = torch.Generator(device=device).manual_seed(0)
    g_dout = torch.Generator(device=device).manual_seed(1)  # apart, so that the inputs stay those of earlier runs
    rows = [
        "| heads | pass | layout | K/V | single GPU ms | slowest rank ms | efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    timed_rows = []  # ("heads pass", "layout, K/V", efficiency) of every timed row
    for hq, hkv in ((32, 8), (16, 16)):
        full = [
            torch.randn(args.tokens, h, 128, device=device, dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv)
        ]
        for backward in (False, True):
            leaves = [t.detach().requires_grad_(backward) for t in full]

            def single(leaves=leaves, backward=backward):
                out = cpcompile.packed_attention(*leaves, cu.to(device), max_seqlen=max_len)
                if backward:  # returned: accumulating into .grad would add a pass over Q, K and V per call
                    torch.autograd.grad(out, leaves, out)

            single_ms = timed(single)
            # one GPU's result to check each rank's rows against: the output, and for a fixed dO
            # the gradients (those of the rank's own rows: dK/dV reduce-scattered to their owners)
            ref = [t.detach().requires_grad_(backward) for t in full]
            want = [cpcompile.packed_attention(*ref, cu.to(device), max_seqlen=max_len)]
            if backward:
                dout = torch.randn(want[0].shape, device=device, dtype=want[0].dtype, generator=g_dout)
                want = torch.autograd.grad(want[0], ref, dout)
            for spec in STRATEGIES:
                batch = cpcompile.shard_batch(
                    dict(zip("qkv", (t.cpu() for t in full))), cu, cp_size=cp, rank=rank, strategy=spec
                )
                local = [batch.tensors[n].to(device) for n in "qkv"]
                comms = ("all_gather", "ring") if spec.strategy.value in RING_LAYOUTS else ("all_gather",)
                # each rank's real rows against one GPU's, with real communication
                real = cpcompile.batch.physical_positions(cu, batch.cu_seqlens_padded)
                where = torch.full((int(batch.cu_seqlens_padded[-1]),), -1, dtype=torch.long)
                where[real] = torch.arange(args.tokens)
                src = where[batch.indices]
                rows_real, picked = (src >= 0).to(device), src[src >= 0].to(device)
                # (kv, K/V head groups): the all-gather and the sparse exchange forced each way, so
                # that both are timed for every layout
                variants = [("all_gather", 1), ("exchange", 1)]
                if spec == STRATEGIES[0]:  # the K/V gather pipelined over head groups
                    variants.append(("all_gather", 2))
                if "ring" in comms:
                    variants.append(("ring", 1))
                for kv, chunks in variants:
                    run_spec = dataclasses.replace(spec, kv=kv, kv_chunks=chunks)
                    padded = batch.cu_seqlens_padded.to(device)
                    plan = rank_plan(cu, padded, run_spec, local[0].shape[0], device)
                    if kv != "all_gather":
                        how = kv
                    else:
                        how = "all-gather" if chunks == 1 else f"all-gather, {chunks} chunks"
                    label = f"{hq}/{hkv} {spec.strategy.value} {how}"
                    check_rank(local, cu.to(device), padded, run_spec, max_len, plan, want,
                               dout if backward else None, rows_real, picked, label)  # fmt: skip
                    run = step(*local, cu.to(device), padded, run_spec, max_len, backward, plan)
                    ms = torch.tensor(timed(run), device=device)
                    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                    name = spec.strategy.value + (f" /{spec.stripe_size}" if spec.stripe_size > 1 else "")
                    what, slowest = "fwd+bwd" if backward else "fwd", ms.item()
                    efficiency = single_ms / (cp * slowest)
                    rows.append(
                        f"| {hq}/{hkv} | {what} | {name} | {how} | {single_ms:.2f} | {slowest:.2f} | {efficiency:.3f} |"
                    )
                    timed_rows.append((f"{hq}/{hkv} {what}", f"{name}, {how}", efficiency))
                    if rank == 0:
                        print(rows[-1], file=sys.stderr, flush=True)  # progress
        gather_ms = timed(
            lambda full=full: all_gather_rows(
                torch.cat([full[1][: args.tokens // cp], full[2][: args.tokens // cp]], 1), dist.group.WORLD
            )
        )
        rows.append(f"| {hq}/{hkv} | K/V all-gather alone | | | | {gather_ms:.2f} | |")
    if rank == 0:
        run_command = f"torchrun --nproc-per-node {cp} {command()[len('python ') :]}"
        setup = (cp, args.tokens, args.doclens.name, len(lengths), kernel)
        publish(HEADING, [*header(HEADING, run_command=run_command), *section(*setup, rows, timed_rows)], args.output)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

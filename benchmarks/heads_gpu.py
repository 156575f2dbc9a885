"""Head parallelism on one GPU: every rank's attention kernel for ``head_parallel`` u in {1, 2, 4, 8}
at cp=8, against the fastest single-GPU kernel, with the bytes each rank's attention moves per layer.

A rank's kernel work per u (each timed with the real kernel, as cpcompile runs it):

- u = 1 (sequence CP): the rank's pieces over the keys ``cp_attention`` gives it, all of them
  (all-gather) or those it reads where it exchanges (``attention_gpu.kernel_step``); every rank timed;
- 1 < u < cp (the hybrid): its head group's pieces (``plan.make_hybrid_plan``) for ``Hq / u`` query
  heads over every key of ``Hkv f / u`` heads: the all-gather path the hybrid runs between groups.
  The ranks of a group make the same call, so one rank per group is timed;
- u = cp (pure head parallelism): the op's own per-rank call (``cpcompile.attention.heads.LocalCall``:
  the documents' real tokens gathered back to back, one kernel call on disjoint key ranges, the
  output gathered back) for ``Hq / cp`` query heads over all tokens. Every rank makes the same
  call; one is timed.

Efficiency = best single-GPU time / (cp x slowest rank), communication excluded (docs/design.md
"Cost"). Beside it, what the busiest rank receives per layer (``cpcompile.cost.comm.layer_bytes``:
head all-to-alls, all-gather, exchange, counted from the plans), that time *modelled* at
``--bandwidth`` GB/s per GPU (not measured), and the efficiency with it added (nothing overlapped).

    python benchmarks/heads_gpu.py --doclens ../shared/data/doclens/prolong.json [--packs 2] [--output BENCHMARKS.md]
    python benchmarks/heads_gpu.py --dry-run    # no GPU: the plans and bytes of the same cases, nothing timed

The length file is read at run time (default ``../shared/data/doclens/prolong.json``; missing, the
packs are synthetic, ProLong-like, and the section says so). It prints its section of
``BENCHMARKS.md``; ``--output FILE`` also writes it there.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gpu import fa4_varlen_step, kernel_step, packed_step, rank_reads, timed, torch_varlen_step  # noqa: E402
from report import REPO, add_output_argument, header, publish  # noqa: E402

import cpcompile  # noqa: E402
from cpcompile import Strategy, StrategySpec, kernels  # noqa: E402
from cpcompile.advisor.comm_model import Link  # noqa: E402
from cpcompile.attention import heads as head_ops  # noqa: E402
from cpcompile.cache import upload  # noqa: E402
from cpcompile.comm.heads import kv_replication  # noqa: E402
from cpcompile.cost.comm import Heads, layer_bytes  # noqa: E402
from cpcompile.cost.flops import causal_attention_flops  # noqa: E402
from cpcompile.kernels import fa4  # noqa: E402
from cpcompile.plan.pieces import AttentionPlan, make_head_plan, make_hybrid_plan, max_piece_len  # noqa: E402
from cpcompile.testing import sample_lengths  # noqa: E402

CAUSAL = (-1, 0)  # attention_gpu's steps take a window; head parallelism runs causal calls

HEADING = "## Head parallelism on one GPU (benchmarks/heads_gpu.py)"
DEFAULT_DOCLENS = REPO.parent / "shared" / "data" / "doclens" / "prolong.json"
HEAD_SHAPES = ((32, 8), (16, 16))
#: sequence layouts for u < cp; pure head parallelism (u = cp) runs every layout alike and takes
#: no_load_balance, which pads least
LAYOUTS = (StrategySpec(Strategy.DUAL_CHUNK_SWAP), StrategySpec(Strategy.BALANCED))
D = 128


def cases(cp: int, us: list[int], hq: int) -> list[StrategySpec]:
    """The specs measured: each layout for every u < cp, no_load_balance for u = cp; u must divide cp and Hq."""
    specs = []
    for u in us:
        heads = {"kv": "heads", "head_parallel": u} if u > 1 else {}  # u = 1: sequence CP
        if u == cp:
            specs.append(StrategySpec(Strategy.NO_LOAD_BALANCE, **heads))
        elif cp % u == 0 and hq % u == 0:
            specs += [StrategySpec(s.strategy, s.stripe_size, **heads) for s in LAYOUTS]
    return specs


def rank_plans(cu: torch.Tensor, padded: torch.Tensor, cp: int, spec: StrategySpec) -> list[AttentionPlan]:
    """One plan per distinct call: every rank's (u = 1), one per head group (the hybrid), one (u = cp)."""
    u = spec.head_parallel
    layout = StrategySpec(spec.strategy, spec.stripe_size)
    if u == 1:
        return [cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=r, strategy=layout) for r in range(cp)]
    if u == cp:
        return [make_head_plan(cu, padded, cp_size=cp, strategy=layout)]
    return [
        make_hybrid_plan(cu, padded, cp_size=cp, head_parallel=u, rank=g * u, strategy=layout) for g in range(cp // u)
    ]


@functools.cache
def _plans(lengths: tuple[int, ...], cp: int, spec: StrategySpec) -> list[AttentionPlan]:
    """:func:`rank_plans` once per pack and spec (head shapes and passes share them)."""
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return rank_plans(cu, cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec), cp, spec)


def rank_steps(spec, plans, cu, padded, heads: Heads, cp: int, backward: bool, kernel_name, tensors):
    """The timed step of each plan's call, as cpcompile makes it."""
    q, k, v = tensors
    u, n, max_len = spec.head_parallel, int(padded[-1]), int(cu.diff().max())
    f = kv_replication(heads.q, heads.kv, u)
    hq, hkv = heads.q // u, heads.kv * f // u  # a rank's heads after the all-to-all
    # values do not matter, sizes and pieces do
    q_u, k_u, v_u = (x[:, :h].contiguous() for x, h in ((q, hq), (k, hkv), (v, hkv)))
    kernel = kernels.select(q_u, kernel_name)
    if u == cp:
        (plan,) = plans
        call = head_ops.local_call(
            plan.gather_index, plan.k_start, plan.k_len_causal, q=q_u, causal=True, scale=None,
            max_seqlen=max_len, kernel_name=kernel_name,
        )  # fmt: skip

        def run():
            out, lse = call.forward(q_u[:n], k_u[:n], v_u[:n])
            if backward:
                call.backward(out, q_u[:n], k_u[:n], v_u[:n], out, lse, k_u.dtype if f == 1 else torch.float32)

        return [run]
    if u == 1:
        read = rank_reads(plans, cp, CAUSAL)  # the exchange where cp_attention would take it
        bound = max_piece_len(spec, cp, max_len)  # as cp_attention launches it
        return [
            kernel_step(kernel, q_u[: n // cp], k_u[:n], v_u[:n], p, CAUSAL, max_len, backward, bound,
                        None if read is None else read[r], r)
            for r, p in enumerate(plans)
        ]  # fmt: skip
    # the hybrid calls cp_attention with the document bound for queries and keys, never exchanging
    return [kernel_step(kernel, q_u[: u * n // cp], k_u[:n], v_u[:n], p, CAUSAL, max_len, backward) for p in plans]


def measure(lengths, heads: Heads, cp: int, us: list[int], backward: bool, kernel_name, link: Link, dry_run: bool):
    """Table rows of one pack: the single-GPU references, then each spec's slowest rank and bytes."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t, max_len = int(cu[-1]), max(lengths)
    flops = causal_attention_flops(lengths, heads.q, D) * (3.5 if backward else 1.0)  # backward ~ 2.5x forward
    rows, best = [], None
    if not dry_run:
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(0)
        pad_room = 2 * cp * len(lengths)  # enough physical rows for any layout's padding
        q = torch.randn(t + pad_room, heads.q, D, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(t + pad_room, heads.kv, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in "kv")
        cu_dev = cu.to(dev)
        singles = {"(torch varlen_attn)": torch_varlen_step(q[:t], k[:t], v[:t], cu_dev, max_len, backward, CAUSAL)}
        if fa4.available():
            singles["(FA4 flash_attn_varlen_func)"] = fa4_varlen_step(
                q[:t], k[:t], v[:t], cu_dev, max_len, backward, CAUSAL
            )
        singles[f"[{kernel_name or 'default'}]"] = packed_step(
            q[:t], k[:t], v[:t], cu_dev, max_len, backward, kernel_name, CAUSAL
        )
        single_ms = {what: timed(step) for what, step in singles.items()}
        rows += [{"what": f"single GPU {w}", "ms": ms, "tflops": flops / ms / 1e9} for w, ms in single_ms.items()]
        best = singles[min(single_ms, key=single_ms.get)]
    for spec in cases(cp, us, heads.q):
        padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
        nbytes = layer_bytes(cu, cp_size=cp, strategy=spec, heads=heads, cu_seqlens_padded=padded)
        moved = int((nbytes.total if backward else nbytes.forward).max())
        pairs = cpcompile.cost.predict_rank_costs(
            cu, cp_size=cp, strategy=spec, cu_seqlens_padded=padded
        ).pairs.double()
        row = {
            "what": f"u={spec.head_parallel} {spec.strategy.value}",
            "u": spec.head_parallel,
            "path": nbytes.path,
            "work": float(pairs.max() / pairs.mean()),
            "mb": moved / 1e6,
            "comm_ms": link.milliseconds(moved),
        }
        plans = _plans(tuple(lengths), cp, spec)  # made in a dry run too: what the GPU run will need
        if not dry_run:
            plans = [AttentionPlan(*(upload(x, "cuda") for x in p)) for p in plans]  # with host twins, as step plans
            steps = rank_steps(spec, plans, cu, padded, heads, cp, backward, kernel_name, (q, k, v))
            reference = timed(best)  # in the GPU's power state of the ranks' timings (docs/measurement.md)
            per_rank = [timed(step) for step in steps]
            slowest = max(per_rank)
            row |= {
                "ms": slowest,
                "tflops": flops / cp / slowest / 1e9,
                "efficiency": reference / (cp * slowest),
                "with_comm": reference / (cp * (slowest + row["comm_ms"])),
                "imbalance": slowest / statistics.mean(per_rank),
            }
        rows.append(row)
    return rows


TABLE_HEADER = [
    "| u | layout | path | ms (slowest rank) | TFLOP/s per GPU | efficiency | max/mean (ranks timed) "
    "| work max/mean (model) | MB per layer, busiest rank | comm ms (modelled) | efficiency with comm (modelled) |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]


def table(title: str, rows: list[dict]) -> list[str]:
    def cell(row, key, fmt):
        return format(row[key], fmt) if key in row else ""

    lines = [f"### {title}", "", *TABLE_HEADER]
    for row in rows:
        if "u" not in row:  # a single-GPU reference
            lines.append(f"| | {row['what']} | | {row['ms']:.2f} | {row['tflops']:.0f} | | | | | | |")
            continue
        u, layout = row["what"].split(" ", 1)
        cells = [u[2:], layout, row["path"], cell(row, "ms", ".2f"), cell(row, "tflops", ".0f")]
        cells += [cell(row, "efficiency", ".3f"), cell(row, "imbalance", ".3f"), cell(row, "work", ".3f")]
        cells += [cell(row, "mb", ".0f"), cell(row, "comm_ms", ".2f"), cell(row, "with_comm", ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def intro(args, source: str, link: Link, kernel: str) -> list[str]:
    timing = (
        "no timings (--dry-run: plans and bytes only)"
        if args.dry_run
        else f"each cell the median over {args.packs} packs of a median of 5 timed runs (attention_gpu.py's timing), "
        f"kernel `{kernel}`; efficiency = best single-GPU time / (cp x slowest rank), communication excluded"
    )
    return [
        f"cp={args.cp}, {args.tokens} tokens per pack from {source}, bf16, head dim {D}, causal; {timing}. "
        "u = head_parallel: 1 sequence CP, 1 < u < cp the hybrid (heads inside groups of u, the all-gather "
        "between them), u = cp pure head parallelism (the op's per-rank call on whole documents). MB: what the "
        "busiest rank receives per layer in the pass timed (`cpcompile.cost.comm.layer_bytes`, counted from "
        "the "
        f"plans); comm ms: that at an assumed {link.bandwidth_gbps} GB/s per GPU, modelled, not measured; "
        "efficiency with comm: the same reference / (cp x (slowest rank + comm ms)), nothing overlapped. "
        "Analyses: [docs/communication.md](docs/communication.md).",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doclens", type=Path, default=DEFAULT_DOCLENS, help="JSON list of document lengths")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--u", type=int, nargs="+", default=[1, 2, 4, 8], help="head_parallel values (divisors of cp)")
    parser.add_argument("--packs", type=int, default=2, help="packs sampled; medians are reported")
    parser.add_argument(
        "--kernel", default=None, choices=["flash", "cudnn", "fa4", "auto"], help="default: cpcompile's"
    )
    parser.add_argument("--bandwidth", type=int, default=Link().bandwidth_gbps, help="GB/s per GPU, assumed")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the plans and bytes only, nothing timed")
    add_output_argument(parser)
    args = parser.parse_args(argv)
    bad = [u for u in args.u if u < 1 or args.cp % u]
    if bad:
        parser.error(f"--u {bad[0]} must divide --cp {args.cp} (accepted: its divisors)")
    if args.dry_run and args.output not in (None, "-"):
        parser.error("--dry-run times nothing: its tables are no benchmark results, so it takes no --output")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs CUDA (or --dry-run: the plans and bytes of the same cases on CPU, nothing timed)")
    if args.doclens.exists():
        pool, source = json.loads(args.doclens.read_text()), f"`{args.doclens.name}`"
    else:
        pool, source = None, f"synthetic ProLong-like lengths (no {args.doclens})"
    link = Link(bandwidth_gbps=args.bandwidth)
    kernel = args.kernel or "cpcompile's default"
    lines = [*header(HEADING), *intro(args, source, link, kernel)]
    for backward in (False, True):
        for hq, hkv in HEAD_SHAPES:
            heads = Heads(hq, hkv, D)
            per_pack = []
            for p in range(args.packs):
                lengths = sample_lengths(args.tokens, torch.Generator().manual_seed(p), pool)
                per_pack.append(measure(lengths, heads, args.cp, args.u, backward, args.kernel, link, args.dry_run))
            medians = [
                {
                    key: v if isinstance(v, str) else statistics.median(pp[i][key] for pp in per_pack)
                    for key, v in r.items()
                }
                for i, r in enumerate(per_pack[0])
            ]
            done = table(f"{'forward+backward' if backward else 'forward'}, heads {hq}/{hkv}", medians)
            lines += done
            print("\n".join(done), file=sys.stderr, flush=True)  # progress
    publish(HEADING, lines, args.output)


if __name__ == "__main__":
    main()

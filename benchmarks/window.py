"""What a sliding window saves CP, analytically on CPU from the plans (issue 27).

For packs of ``--tokens`` tokens drawn from the ProLong length mix (read at run time from
``--doclens``; without it, the synthetic "1 long" mix of ``benchmarks/balance.py``), cp in
``--cp``, and causal attention with and without windows ``(w, 0)`` of ``--windows`` tokens,
it reports per strategy:

- exchange: K/V bytes the sparse exchange brings the busiest rank per layer (``Hkv`` heads of
  ``D`` in bf16, K and V), and what an all-gather brings it, from every rank's reads
  (``cpcompile.layouts.reads.read_ranges``, which the exchange's plan is made from);
- ring: the K/V blocks each rank's pieces read, of ``cp`` (the ring skips the others' kernel calls);
- work: max/mean per-rank attention pairs under the window (``CostModel(window=w)``), and the
  strategy ``choose_strategy`` picks under it; ``balanced_w`` is balanced told the window
  (``StrategySpec("balanced", windows=(w,))``).

It prints its section of ``BENCHMARKS.md``; ``--output FILE`` also writes it there.

    python benchmarks/window.py [--doclens ../shared/data/doclens] [--tokens 131072] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.cost.model import CostModel, choose_strategy, predict_rank_costs
from cpcompile.plan.ring import ring_window_plan
from cpcompile.plan.window import window_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from balance import STRATEGIES as LAYOUTS  # noqa: E402
from balance import cu_of, make_packs  # noqa: E402
from report import REPO, add_output_argument, header, publish  # noqa: E402

SECTION = "## Sliding windows: exchange bytes, ring blocks, balance (benchmarks/window.py)"
# balance.py's layouts (striped with tile-sized stripes), and balanced told the window
STRATEGIES = {name: LAYOUTS[name] for name in ("dual_chunk_swap", "no_load_balance", "striped_128", "balanced")}
STRATEGIES["balanced_w"] = LAYOUTS["balanced"]  # for a window: StrategySpec.windows=(w,)
KV_HEADS, HEAD_DIM, BYTES = 8, 128, 2  # Llama-3-8B's K/V heads, bf16


def ring_blocks(cu: torch.Tensor, cp: int, spec: StrategySpec, window: tuple[int, int]) -> list[int]:
    """Per rank, the K/V blocks (of ``cp``) that its pieces read under ``window``."""
    live = []
    for rank in range(cp):
        plan = cpcompile.plan.make_plan(cu, cp_size=cp, rank=rank, strategy=spec)
        k_start, k_len, _ = window_keys(*plan.pieces, window)
        _, lengths, _ = ring_window_plan(plan.gather_index, k_start, k_len, cp)
        live.append(int(lengths.gt(0).any(1).sum()))
    return live


def measure(lengths: list[int], cp: int, window: int) -> dict:
    """One pack, one cp, one window (-1: causal): per strategy exchange bytes, ring blocks, work balance."""
    cu = cu_of(lengths)
    model = CostModel(window=window)
    row = {}
    for name, spec in STRATEGIES.items():
        if name == "balanced_w" and window >= 0:
            spec = StrategySpec(Strategy.BALANCED, windows=(window,))
        costs = predict_rank_costs(cu, cp_size=cp, strategy=spec, model=model)
        t_local = int(costs.tokens[0])
        pairs = costs.pairs.double()
        row[name] = {
            "exchange": int(costs.keys_remote.max()) * 2 * KV_HEADS * HEAD_DIM * BYTES,
            "all_gather": (cp - 1) * t_local * 2 * KV_HEADS * HEAD_DIM * BYTES,
            "blocks": statistics.mean(ring_blocks(cu, cp, spec, (window, 0))) if window >= 0 else float(cp),
            "work": float(pairs.max() / pairs.mean()),
        }
    row["auto"] = choose_strategy(cu, cp_size=cp, model=model).strategy.value
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doclens", type=Path, default=REPO.parent / "shared" / "data" / "doclens")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--packs", type=int, default=2)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 1024])
    add_output_argument(parser)
    args = parser.parse_args()
    packs = make_packs(args.doclens, args.tokens, args.packs)
    mix = "prolong" if "prolong" in packs else "1 long"
    lines = header(SECTION)
    lines += [
        f"Mix: {mix} ({args.packs} packs of {args.tokens:,} tokens"
        + ("" if mix == "prolong" else f"; no prolong.json under {args.doclens}, so the synthetic mix")
        + f"); K/V of {KV_HEADS} heads x {HEAD_DIM} in bf16 per layer. Exchange = MiB the sparse exchange brings the"
        " busiest rank (all-gather: every rank's); blocks = K/V blocks a rank's pieces read on the ring, mean over"
        " ranks, of cp; work = max/mean attention pairs per rank under the window; auto = `choose_strategy` under"
        " `CostModel(window=w)`.",
        "",
        "| cp | window | all-gather MiB | " + " | ".join(f"exchange {n}" for n in STRATEGIES) + " | "
        + " | ".join(f"blocks {n}" for n in STRATEGIES) + " | " + " | ".join(f"work {n}" for n in STRATEGIES)
        + " | auto |",
        "|" + " --- |" * (3 + 3 * len(STRATEGIES) + 1),
    ]  # fmt: skip
    mib = 1 << 20
    for cp in args.cp:
        for window in (-1, *args.windows):
            rows = [measure(lengths, cp, window) for lengths in packs[mix]]
            worst = {n: {k: max(r[n][k] for r in rows) for k in ("exchange", "all_gather", "work")} for n in STRATEGIES}
            blocks = {n: statistics.mean(r[n]["blocks"] for r in rows) for n in STRATEGIES}
            picks = ",".join(sorted({r["auto"] for r in rows}))
            lines.append(
                f"| {cp} | {'causal' if window < 0 else f'({window}, 0)'} | "
                f"{worst['balanced']['all_gather'] / mib:.0f} | "
                + " | ".join(f"{worst[n]['exchange'] / mib:.1f}" for n in STRATEGIES) + " | "
                + " | ".join(f"{blocks[n]:.1f}" for n in STRATEGIES) + " | "
                + " | ".join(f"{worst[n]['work']:.3f}" for n in STRATEGIES) + f" | {picks} |"
            )  # fmt: skip
    lines += [
        "",
        "Reading: a window bounds what a rank reads of other ranks to about `w` keys before each of its pieces, so",
        "the exchange's bytes fall to a few windows' worth where pieces are long (no_load_balance, balanced), and",
        "the ring's far blocks are read by no piece. `balanced` cuts for causal work, which a window flattens (a",
        "long document's tokens all cost about `w` pairs); told the window (`balanced_w`), it cuts for windowed",
        "work, reading documents in order, and evens the ranks again. The `auto` column is not told the window;",
        "told it (`StrategySpec.windows`), `auto` lays balanced out as `balanced_w`.",
    ]
    publish(SECTION, lines, args.output)


if __name__ == "__main__":
    main()

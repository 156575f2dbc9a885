"""Load balance of every strategy, analytically on CPU (docs/design.md, "Cost").

For packs of 32K-512K tokens drawn from real document-length mixes (ProLong,
MagiAttention's default, read at run time from ``--doclens``) and from synthetic
ones ("1 long": one document of 50-90 % of the pack, the rest < 1K; a
single long document), and cp in {2, 4, 8, 16, 32}, it reports per strategy:

- max/mean per-rank attention work (the sum over a rank's query tokens of the
  keys they see, causal), the worst over ``--packs`` packs;
- padding the strategy adds (tokens);
- the cost model's view (:mod:`cpcompile.cost.model`): max/mean kernel tiles (128x128)
  per rank, pieces per rank that cut a document below 128 tokens, the predicted
  step, the keys the busiest rank reads;
- the strategy ``auto`` picks;

then checks balanced against the targets of issue 5 and times the balanced layout
on a 100K-token pack of 1,000 documents (one thread, as in a data-loader worker).
It prints its section of ``BENCHMARKS.md``; ``--output FILE`` also writes it there.

    python benchmarks/balance.py [--doclens ../shared/data/doclens] [--packs 3] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.cost.model import choose_strategy, predict_rank_costs
from cpcompile.layouts import balanced as balanced_module
from cpcompile.layouts.balanced import balanced_layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import REPO, add_output_argument, header, publish  # noqa: E402

SECTION = "## Balance (benchmarks/balance.py)"
STRATEGIES = {
    "dual_chunk_swap": StrategySpec(Strategy.DUAL_CHUNK_SWAP),
    "no_load_balance": StrategySpec(Strategy.NO_LOAD_BALANCE),
    "striped": StrategySpec(Strategy.STRIPED),
    "striped_128": StrategySpec(Strategy.STRIPED, stripe_size=128),
    "balanced": StrategySpec(Strategy.BALANCED),
}
CP_SIZES = (2, 4, 8, 16, 32)
TOKENS = (32768, 131072, 524288)
# issue 5: max/mean work per cp on the real mixes at 128K and 512K; padding < cp; <= 2 short cuts per rank
TARGETS = {4: 1.02, 8: 1.02, 32: 1.05}
MAX_SHORT_CUTS = 2.0


# --- packs -------------------------------------------------------------------------


def cut_pack(draw, total: int) -> list[int]:
    """Documents drawn until ``total`` tokens, the last one cut (as a data loader packs)."""
    lengths, filled = [], 0
    while filled < total:
        n = draw()
        lengths.append(min(n, total - filled))
        filled += lengths[-1]
    return lengths


def prolong_sampler(path: Path, g: torch.Generator):
    lengths = torch.tensor(json.loads(path.read_text()))
    return lambda: int(lengths[torch.randint(lengths.shape[0], (1,), generator=g)])


def magi_sampler(path: Path, g: torch.Generator):
    """A bin by its probability, then a length uniformly inside it."""
    with path.open() as f:
        rows = [(int(r["upper_bound_tokens"]), float(r["cumulative_percent"])) for r in csv.DictReader(f)]
    upper = [u for u, _ in rows]
    lower = [1] + [u + 1 for u in upper[:-1]]
    cum = torch.tensor([c for _, c in rows])
    prob = torch.diff(cum, prepend=cum.new_zeros(1))

    def draw() -> int:
        b = int(torch.multinomial(prob, 1, generator=g))
        return int(torch.randint(lower[b], upper[b] + 1, (1,), generator=g))

    return draw


def one_long_sampler(total: int, g: torch.Generator):
    """One document of 50-90 % of the pack first, then documents of 1-1023 tokens."""
    first = [int(total * (0.5 + 0.4 * float(torch.rand(1, generator=g))))]
    return lambda: first.pop() if first else int(torch.randint(1, 1024, (1,), generator=g))


def make_packs(doclens: Path, total: int, count: int) -> dict[str, list[list[int]]]:
    """mix -> ``count`` packs of ``total`` tokens (each a list of document lengths)."""
    packs = {}
    for mix, file, sampler in (("prolong", "prolong.json", prolong_sampler), ("magi", "magi_cdf.csv", magi_sampler)):
        if (doclens / file).exists():
            g = torch.Generator().manual_seed(total)
            draw = sampler(doclens / file, g)
            packs[mix] = [cut_pack(draw, total) for _ in range(count)]
    g = torch.Generator().manual_seed(total)
    packs["1 long"] = [cut_pack(one_long_sampler(total, g), total) for _ in range(count)]
    packs["1 doc"] = [[total]]
    return packs


# --- measurements --------------------------------------------------------------------


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def measure(lengths: list[int], cp: int) -> dict:
    """One pack at one cp: per strategy work max/mean and padding; balanced's kernel view; auto's pick."""
    cu = cu_of(lengths)
    row = {}
    one_device = int(predict_rank_costs(cu, cp_size=1, strategy="no_load_balance").tiles[0])
    for name, spec in STRATEGIES.items():
        costs = predict_rank_costs(cu, cp_size=cp, strategy=spec)
        pairs, tiles = costs.pairs.double(), costs.tiles.double()
        row[name] = {
            "work": float(pairs.max() / pairs.mean()),
            "padding": int(costs.tokens.sum()) - sum(lengths),
            "tiles": float(tiles.max() / tiles.mean()),
            # the forward CP efficiency a 128x128-tile kernel can reach on this layout
            "tile_bound": one_device / (cp * float(tiles.max())),
            "short_cuts": float(costs.short_cuts.double().mean()),
            # share of the pack's keys the busiest reader reads: the dK/dV rows its backward writes
            "keys_read": float(costs.keys_read.max()) / int(costs.tokens.sum()),
            # what the sparse K/V exchange brings the busiest rank, over what an all-gather brings it
            "exchange": float(costs.keys_remote.max()) / max(int(costs.tokens.sum()) - int(costs.tokens[0]), 1),
            "step": costs.step,
        }
    for name in STRATEGIES:
        row[name]["step"] /= row["balanced"]["step"]  # predicted step relative to balanced's
    row["auto"] = choose_strategy(cu, cp_size=cp)
    return row


def sweep(doclens: Path, packs_per_config: int) -> list[dict]:
    results = []
    for total in TOKENS:
        for mix, packs in make_packs(doclens, total, packs_per_config).items():
            for cp in CP_SIZES:
                rows = [measure(p, cp) for p in packs]
                # the worst pack for every measure (for the step ratio, the pack least favourable to balanced)
                worst = {
                    name: {k: (min if k in LOWER_IS_WORSE else max)(r[name][k] for r in rows) for k in rows[0][name]}
                    for name in STRATEGIES
                }
                picks = sorted({_label(r["auto"]) for r in rows})
                results.append(
                    {
                        "mix": mix,
                        "tokens": total,
                        "cp": cp,
                        "docs": statistics.mean(len(p) for p in packs),
                        "worst": worst,
                        "auto": "/".join(picks),
                    }
                )
                print(_balance_row(results[-1]), file=sys.stderr, flush=True)  # progress
    return results


def _label(spec: StrategySpec) -> str:
    return next(name for name, s in STRATEGIES.items() if s == spec)


def time_balanced(cp_sizes=(4, 8, 32), repeats: int = 50) -> list[tuple[int, float, float]]:
    """Median ms of the balanced layout and of auto on 100K tokens in 1,000 log-normal documents."""
    g = torch.Generator().manual_seed(0)
    raw = torch.empty(1000).log_normal_(4.0, 1.2, generator=g)
    lengths = (raw * 100_000 / raw.sum()).long().clamp(min=1)
    lengths[-1] += 100_000 - int(lengths.sum())
    cu = cu_of(lengths.tolist())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for cp in cp_sizes:
            padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy="balanced")
            layout_ms = _median_ms(lambda p=padded, c=cp: balanced_layout(p, c), repeats)
            auto_ms = _median_ms(lambda c=cp: choose_strategy(cu, cp_size=c), max(3, repeats // 10))
            out.append((cp, layout_ms, auto_ms))
    finally:
        torch.set_num_threads(threads)
    return out


def _median_ms(fn, repeats: int) -> float:
    """Median ms of ``fn`` from scratch: the balanced runs a step keeps per pack (``RUNS_KEPT``) dropped first."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        balanced_module._runs.clear()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# --- report --------------------------------------------------------------------------

SHORT = {"dual_chunk_swap": "DCS", "no_load_balance": "NLB", "striped": "S1", "striped_128": "S128", "balanced": "BAL"}
BALANCE_HEADER = (
    "| mix | tokens | cp | docs | work DCS | work NLB | work S1 | work S128 | work BAL | pad DCS |\n"
    + "|---" * 10
    + "|"
)
#: Layouts that pad only the total, to a multiple of cp (x the stripe): their padding is stated once, in the legend.
TOTAL_PADDED = ("striped_128", "balanced")
KERNEL_HEADER = (
    "| mix | tokens | cp | short cuts/rank DCS | short cuts/rank BAL | tiles max/mean BAL "
    "| tile bound DCS | tile bound BAL | step DCS / BAL | step NLB / BAL | step S128 / BAL "
    "| keys read DCS | keys read NLB | keys read BAL | exchange DCS | exchange NLB | exchange BAL "
    "| auto picks |\n" + "|---" * 18 + "|"
)
LOWER_IS_WORSE = ("step", "tile_bound")
#: The CP sizes whose rows the section prints (the sweep, the targets and the reading cover every size): the
#: whole grid would fill most of BENCHMARKS.md's size limit (tests/test_docs.py).
BALANCE_TABLE_CPS = (2, 8, 32)
KERNEL_TABLE_CPS = (8, 32)


def _config(r: dict) -> str:
    return f"| {r['mix']} | {r['tokens'] // 1024}K | {r['cp']} |"


def _balance_row(r: dict) -> str:
    w = r["worst"]
    work = [f"{w[n]['work']:.3f}" for n in STRATEGIES]
    return f"{_config(r)} {r['docs']:.0f} | {' | '.join(work)} | {w['dual_chunk_swap']['padding']} |"


def _kernel_row(r: dict) -> str:
    w = r["worst"]
    steps = " | ".join(f"{w[n]['step']:.3f}" for n in ("dual_chunk_swap", "no_load_balance", "striped_128"))
    bounds = " | ".join(f"{w[n]['tile_bound']:.3f}" for n in ("dual_chunk_swap", "balanced"))
    layouts = ("dual_chunk_swap", "no_load_balance", "balanced")
    reads = " | ".join(f"{w[n][key]:.2f}" for key in ("keys_read", "exchange") for n in layouts)
    return (
        f"{_config(r)} {w['dual_chunk_swap']['short_cuts']:.1f} | {w['balanced']['short_cuts']:.2f} | "
        f"{w['balanced']['tiles']:.3f} | {bounds} | {steps} | {reads} | "
        f"{'/'.join(SHORT[p] for p in r['auto'].split('/'))} |"
    )


def targets(results: list[dict]) -> list[str]:
    """Balanced against its targets on the real mixes at 128K+ (the other layouts: the tables above)."""
    lines = [
        "| mix | tokens | cp | balanced: forward work max/mean (target) | padding (< cp) | short cuts/rank (<= 2) "
        "| met |",
        "|---" * 7 + "|",
    ]
    for r in results:
        if r["mix"] not in ("prolong", "magi") or r["tokens"] < 131072 or r["cp"] not in TARGETS:
            continue
        b, goal = r["worst"]["balanced"], TARGETS[r["cp"]]
        met = b["work"] <= goal and b["padding"] < r["cp"] and b["short_cuts"] <= MAX_SHORT_CUTS
        lines.append(
            f"| {r['mix']} | {r['tokens'] // 1024}K | {r['cp']} | {b['work']:.4f} (<= {goal}) | {b['padding']} | "
            f"{b['short_cuts']:.2f} | {'yes' if met else '**no**'} |"
        )
    return lines


def timing_lines(timing: list[tuple[int, float, float]]) -> list[str]:
    return [
        "Host time, one thread, 100K tokens in 1,000 log-normal documents: the balanced layout",
        "(`cpcompile.layouts.balanced.balanced_layout`) and `auto`'s pick (`choose_strategy`, four candidates'",
        "predictions):",
        "",
        "| cp | balanced layout ms (median) | auto ms (median) |",
        "|---|---|---|",
        *(f"| {cp} | {layout:.2f} | {auto:.1f} |" for cp, layout, auto in timing),
    ]


def reading(results: list[dict]) -> list[str]:
    """A few lines drawn from the results: balanced on the real mixes, the others' worst, auto's picks."""
    real = [r for r in results if r["mix"] in ("prolong", "magi") and r["tokens"] >= 131072]
    under_cp = all(r["worst"]["balanced"]["padding"] < r["cp"] for r in results)
    padding = "padding < cp tokens on every pack" if under_cp else "padding >= cp tokens on some pack"
    picks = Counter(r["auto"] for r in results)
    if real:
        worst = {n: {key: max(r["worst"][n][key] for r in real) for key in ("work", "short_cuts")} for n in SHORT}
        tiles = max(r["worst"]["balanced"]["tiles"] for r in real if r["cp"] <= 8)
        bal, dcs = worst["balanced"], worst["dual_chunk_swap"]
        mixes = [
            f"- balanced, real mixes at 128K-512K: work max/mean <= {bal['work']:.3f} (tiles at cp 2-8 <= "
            f"{tiles:.3f}), short cuts/rank <= {bal['short_cuts']:.2f}; {padding}.",
            f"- dual_chunk_swap there: work <= {dcs['work']:.3f}, up to {dcs['short_cuts']:.0f} short cuts/rank;"
            f" no_load_balance: work up to {worst['no_load_balance']['work']:.2f}.",
        ]
    else:  # a clone without the length files: the synthetic mixes only
        mixes = [f"- no real mix (prolong.json, magi_cdf.csv) under --doclens: synthetic mixes only; {padding}."]
    missed = [
        f"{r['mix']} {r['tokens'] // 1024}K cp={r['cp']}"
        for r in real
        if r["cp"] in TARGETS and r["worst"]["balanced"]["work"] > TARGETS[r["cp"]]
    ]
    if missed:  # step 5 evens forward + backward, keeping the forward's tiles within 1 %, not its pairs
        mixes.append(
            f"- forward work above its target ({', '.join(missed)}): balanced evens forward + backward (step 5), "
            "the forward's tiles kept within 1 % of the forward-only layout's."
        )
    return [
        *mixes,
        f"- `auto` picks, over the {len(results)} rows: "
        + ", ".join(f"{'/'.join(SHORT[p] for p in label.split('/'))} {n}" for label, n in picks.items())
        + ".",
        "- why: [docs/balanced-layout.md](docs/balanced-layout.md).",
    ]


def report(results: list[dict], timing: list[tuple[int, float, float]], packs: int, first: list[str]) -> list[str]:
    """The section: ``first`` (heading, machine, date, command), the tables, the reading."""
    max_total_padding = max(r["worst"][n]["padding"] for r in results for n in TOTAL_PADDED)
    return [
        *first,
        "Work = max/mean over ranks of the attention pairs (query, visible key), causal; pad = tokens added. Cells:",
        f"the worst of {packs} packs (`1 doc`: one document; `1 long`: one of 50-90 % of the pack, the rest under 1K).",
        f"S128 and BAL pad the total only (at most {max_total_padding} tokens here). DCS dual_chunk_swap, NLB",
        "no_load_balance, S1 / S128 1- / 128-token stripes, BAL balanced.",
        "",
        BALANCE_HEADER,
        *(_balance_row(r) for r in results if r["cp"] in BALANCE_TABLE_CPS),
        "",
        "Kernel view (`cpcompile.cost.model`, 128x128 tiles; the worst pack, for step X / BAL the one least",
        "favourable to balanced): short cuts = pieces under 128 tokens cutting a document, per rank; tile bound = one",
        "device's tiles / (cp x the slowest rank's); step X / BAL = X's predicted step over balanced's; keys read =",
        "the busiest reader's share of the keys; exchange = K/V rows the sparse exchange brings the busiest rank, over",
        "an all-gather's. Rows: cp "
        + ", ".join(map(str, BALANCE_TABLE_CPS))
        + " above, "
        + ", ".join(map(str, KERNEL_TABLE_CPS))
        + " below.",
        "",
        KERNEL_HEADER,
        *(_kernel_row(r) for r in results if r["cp"] in KERNEL_TABLE_CPS),
        "",
        "Targets, balanced on the real mixes:",
        "",
        *targets(results),
        "",
        *timing_lines(timing),
        "",
        *reading(results),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--doclens",
        type=Path,
        default=REPO.parent / "shared" / "data" / "doclens",
        help="folder with prolong.json and magi_cdf.csv (mixes whose file is missing are skipped)",
    )
    parser.add_argument("--packs", type=int, default=3, help="packs per mix, size and cp (the worst is reported)")
    add_output_argument(parser)
    args = parser.parse_args()
    print(BALANCE_HEADER, file=sys.stderr)
    results = sweep(args.doclens, args.packs)
    timing = time_balanced()
    publish(SECTION, report(results, timing, args.packs, header(SECTION)), args.output)


if __name__ == "__main__":
    main()

"""CP at scale on paper (CPU): the step-time model (``cpcompile.cost.timing``) calibrated against the
measured cp=2 runs, then per-GPU efficiency, bytes and host planning time from cp=8 to 256.

Scale: packs of ProLong's document lengths (``--doclens``; ``--cpu-smoke``: the advisor's built-in
synthetic mix), heads 32/8 of 128 in bf16, over 8-GPU H200 nodes (``Topology`` ``h200``: NVLink as
fitted, 50 GB/s per GPU across nodes, assumed). Per CP size, :func:`cpcompile.cost.timing.decide`
picks among dual_chunk_swap and balanced with the all-gather, the exchange and (up to cp 64) the ring,
the hybrid with heads inside a node (``u = 8``) and pure head parallelism where ``cp`` divides the
heads; efficiency = one GPU's attention time for the pack / (cp x the slowest rank's predicted
time), forward and backward of one layer, as run and with all communication hidden (overlapped). Two
series: tokens per rank fixed, and total tokens fixed. Then dp x cp: the same GPUs as ``dp`` groups of
``cp``, each with its own pack cut from the same documents, against one group over all of them. Host
time (measured here, one thread): rank 0's plan for the pick (``make_plan``, with the exchange's plan
where it exchanges, median of 3), and ``decide`` itself as the runtime's ``auto`` runs it (``prune``).

Calibration: the cp=2 rows of BENCHMARKS.md's "CP step with communication" section (2 x H200, NCCL,
one ProLong pack rebuilt here as ``benchmarks/cp_step.py`` draws it: ``--doclens`` must hold
``prolong.json``) against the model's prediction with its default constants, each row's error;
``--fit`` refits the constants by least squares of the relative errors and prints them.

    python benchmarks/scale.py --doclens ../shared/data/doclens [--fit] [--output BENCHMARKS.md]
    python benchmarks/scale.py --cpu-smoke   # seconds: a synthetic mix, small scales, no calibration
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.advisor.advise import BUILTIN_MIX, cut_pack, length_sampler
from cpcompile.cost.comm import Heads, Phase, layout_key
from cpcompile.cost.timing import (
    H200,
    KernelSpeed,
    LayerTerms,
    Topology,
    _phase_us,
    decide,
    evaluate,
    layer_terms,
    option_name,
)
from cpcompile.layouts import balanced
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import layout_runs
from cpcompile.layouts.reads import read_ranges
from cpcompile.plan.exchange import make_exchange
from cpcompile.plan.pieces import layout_of
from cpcompile.testing import sample_lengths

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import REPO, add_output_argument, header, publish  # noqa: E402

SECTION = "## Scale on paper (benchmarks/scale.py)"
CP_STEP = "## CP step with communication (benchmarks/cp_step.py)"
LAYOUTS = {
    "dual_chunk_swap": StrategySpec(Strategy.DUAL_CHUNK_SWAP),
    "no_load_balance": StrategySpec(Strategy.NO_LOAD_BALANCE),
    "striped /128": StrategySpec(Strategy.STRIPED, stripe_size=128),
    "balanced": StrategySpec(Strategy.BALANCED),
}
#: the constants --fit refits: KernelSpeed's (all but token_ns), then Topology's
FITTED = ("forward_ps", "backward_ps", "key_row_ps", "memory_gbps", "ring_row_ps", "piece_ps", "intra_gbps", "call_us")


# --- calibration against the measured cp=2 runs ---------------------------------------


class Case(NamedTuple):
    label: str
    terms: LayerTerms | Phase  # a layer, or the K/V all-gather alone (one phase, rank 0)
    measured_ms: float


def measured_rows(benchmarks: Path) -> list[list[str]]:
    """The cp_step section's table rows: heads, pass, layout, K/V, single GPU ms, slowest rank ms, efficiency."""
    text = benchmarks.read_text()
    if CP_STEP not in text:
        raise SystemExit(f"{benchmarks} has no section {CP_STEP!r} to calibrate against")
    section = text.split(CP_STEP, 1)[1].split("\n## ", 1)[0]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()]
    return [c for c in cells if len(c) == 7 and re.fullmatch(r"\d+/\d+", c[0])]


def calibration_cases(cu: torch.Tensor, rows: list[list[str]], cp: int = 2) -> list[Case]:
    """Every measured row as a case (the 2-chunk all-gather predicted as one chunk), and each heads and
    pass's single-GPU time (cp=1, no_load_balance, no communication)."""
    cases, singles, tokens = [], set(), int(cu[-1])
    for hs, what, layout, kv, single, slowest, _ in rows:
        q, k = map(int, hs.split("/"))
        heads, passes = Heads(q, k), "forward" if what == "fwd" else "forward+backward"
        if not layout:  # the K/V all-gather alone: [T / cp, 2 Hkv, D] bf16 from the other rank
            block = tokens // cp * 2 * k * heads.dim * heads.itemsize
            recv = [[0 if s == r else block for s in range(cp)] for r in range(cp)]
            cases.append(Case(f"{hs} K/V all-gather alone", Phase("forward", "gather", recv), float(slowest)))
            continue
        spec = dataclasses.replace(LAYOUTS[layout], kv=kv if kv in ("ring", "exchange") else "all_gather")
        terms = layer_terms(cu, cp_size=cp, strategy=spec, heads=heads, passes=passes)
        cases.append(Case(f"{hs} {what} {layout}, {kv}", terms, float(slowest)))
        if (hs, what) not in singles:
            singles.add((hs, what))
            one = layer_terms(cu, cp_size=1, strategy="no_load_balance", heads=heads, passes=passes)
            cases.append(Case(f"{hs} {what} one GPU", one, float(single)))
    return cases


def predict_ms(case: Case, topology: Topology, speed: KernelSpeed) -> float:
    if isinstance(case.terms, Phase):
        return _phase_us(case.terms, 0, topology) / 1e3
    return evaluate(case.terms, topology, speed).as_run / 1e3


def constants(values: dict[str, float]) -> tuple[Topology, KernelSpeed]:
    speed = {k: v for k, v in values.items() if k in KernelSpeed.__dataclass_fields__}
    topology = {k: v for k, v in values.items() if k in Topology.__dataclass_fields__}
    return dataclasses.replace(H200, **topology), KernelSpeed(**speed)


def fit(cases: list[Case], iterations: int = 40) -> dict[str, float]:
    """The constants ``FITTED`` minimizing the squared relative errors (Levenberg-Marquardt on their logs)."""
    start = {**dataclasses.asdict(H200), **dataclasses.asdict(KernelSpeed())}
    logs = torch.tensor([math.log(start[n]) for n in FITTED], dtype=torch.float64)

    def residuals(x: torch.Tensor) -> torch.Tensor:
        topology, speed = constants({n: math.exp(float(v)) for n, v in zip(FITTED, x)})
        return torch.tensor([predict_ms(c, topology, speed) / c.measured_ms - 1 for c in cases], dtype=torch.float64)

    r, damping, eye = residuals(logs), 1e-2, torch.eye(len(FITTED), dtype=torch.float64)
    for _ in range(iterations):
        jac = torch.stack([(residuals(logs + 1e-4 * eye[j]) - r) / 1e-4 for j in range(len(FITTED))], 1)
        normal = jac.T @ jac
        step = torch.linalg.solve(normal + damping * torch.diag(normal.diagonal() + 1e-9), -jac.T @ r)
        trial = residuals(logs + step)
        if trial.square().sum() < r.square().sum():
            logs, r, damping = logs + step, trial, damping / 3
        else:
            damping *= 5
    return {n: math.exp(float(v)) for n, v in zip(FITTED, logs)}


def calibration(doclens: Path | None, refit: bool) -> tuple[str, list[str]]:
    """One line of summary, and a table of each measured figure against the prediction: measured /
    predicted ms (error), by heads, pass and layout (rows) and K/V path (columns)."""
    prolong = None if doclens is None else (doclens if doclens.suffix == ".json" else doclens / "prolong.json")
    if prolong is None or not prolong.is_file():
        return "no calibration: it rebuilds `benchmarks/cp_step.py`'s pack from `prolong.json` (`--doclens`).", []
    lengths = sample_lengths(131072, torch.Generator().manual_seed(0), json.loads(prolong.read_text()))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cases = calibration_cases(cu, measured_rows(REPO / "BENCHMARKS.md"))
    topology, speed = H200, KernelSpeed()
    lines = []
    if refit:
        values = fit(cases)
        lines += ["Refitted constants: " + ", ".join(f"{n} {v:.4g}" for n, v in values.items()), ""]
        topology, speed = constants(values)
    columns = ["one GPU", "all-gather", "exchange", "ring", "all-gather, 2 chunks"]
    table: dict[str, dict[str, str]] = {}
    errors = []
    for case in cases:
        predicted = predict_ms(case, topology, speed)
        errors.append(predicted / case.measured_ms - 1)
        row, _, column = case.label.partition(", ")
        if not column:  # "32/8 fwd one GPU", "32/8 K/V all-gather alone"
            row, column = (
                (case.label[: -len(" one GPU")], "one GPU")
                if case.label.endswith("one GPU")
                else (case.label, "all-gather")
            )
        cell = f"{case.measured_ms:.2f} / {predicted:.2f} ({100 * errors[-1]:+.1f}%)"
        table.setdefault(row, {})[column] = cell
    lines += [
        "| heads, pass, layout | " + " | ".join(columns) + " |",
        "| --- |" + " --- |" * len(columns),
        *(f"| {row} | " + " | ".join(cells.get(c, "") for c in columns) + " |" for row, cells in table.items()),
    ]
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    within = sum(abs(e) <= 0.10 for e in errors)
    summary = (
        f"against the {len(cases)} measured cp=2 figures (2 x H200): rms error {100 * rms:.1f}%, {within} within "
        f"10%, largest {100 * errors[worst]:+.1f}% ({cases[worst].label})"
    )
    return summary, lines


# --- scale ---------------------------------------------------------------------------------

HEADS = Heads(32, 8)
DCS, BAL = StrategySpec(Strategy.DUAL_CHUNK_SWAP), StrategySpec(Strategy.BALANCED)
RING_UP_TO = 64  # the ring's steps grow with cp and it loses at every measured size: priced up to here


class Setup(NamedTuple):
    cp_sizes: tuple[int, ...]
    per_rank: int  # tokens per rank, the first series
    total: int  # tokens per pack, the second series
    gpus: int  # dp x cp over this many GPUs
    mix: str


FULL = Setup((8, 16, 32, 64, 128, 256), 16384, 1 << 20, 64, "prolong.json")
SMOKE = Setup((8, 16), 2048, 32768, 16, "the built-in synthetic mix")


def choices(cp: int) -> tuple[StrategySpec, ...]:
    """What decide weighs at ``cp`` (module docstring)."""
    found = [dataclasses.replace(s, kv="all_gather") for s in (DCS, BAL)]
    found.append(dataclasses.replace(BAL, kv="exchange"))  # DCS exchanges as much
    if cp <= RING_UP_TO:
        found.append(dataclasses.replace(DCS, kv="ring"))
    if cp > 8:
        found += [dataclasses.replace(s, kv="heads", head_parallel=8) for s in (DCS, BAL)]
    if HEADS.q % cp == 0:
        found.append(StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=cp))
    return tuple(found)


def median_ms(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def plan_ms(cu: torch.Tensor, cp: int, option: StrategySpec, scratch: bool = True) -> float:
    """Rank 0's host plan for ``option``: its layout and plan, and the exchange's plan from the plan, as the
    runtime makes them (``plan.pieces.step_plan``, ``plan.exchange.exchange_plan``: the layout is the plan's
    ``gather_index`` inverted, not laid out again). ``scratch``: balanced's cuts found anew (else those
    ``decide`` found for the pack, which ``layouts.balanced.balanced_runs`` keeps)."""
    spec = layout_key(option)

    def plan() -> None:
        if scratch:
            balanced._runs.clear()
        p = cpcompile.plan.make_plan(cu, cp_size=cp, rank=0, strategy=spec)
        if option.kv == "exchange":
            layout = layout_of(p.gather_index, cp)
            pack, runs = Pack(layout, p.cu_seqlens, p.cu_seqlens_padded), layout_runs(layout)
            make_exchange(p.k_start, p.k_len(True), pack, read_ranges(pack, (-1, 0), runs), 0, "always", runs)

    return median_ms(plan)


class Row(NamedTuple):
    cp: int
    documents: int
    pick: str
    efficiency: float
    overlapped: float
    megabytes: float
    gather: float  # the best all-gather option's efficiency
    plan_ms: float
    warm_ms: float  # the plan after decide
    decide_ms: float
    step_ms: float
    single_us: float
    pairs: int


def single_us(cu: torch.Tensor) -> float:
    return evaluate(layer_terms(cu, cp_size=1, strategy="no_load_balance", heads=HEADS)).as_run


def scale_row(cu: torch.Tensor, cp: int) -> Row:
    start = time.perf_counter()
    d = decide(cu, cp_size=cp, heads=HEADS, choices=choices(cp), prune=True)  # as the runtime's auto decides
    decide_ms = 1e3 * (time.perf_counter() - start)
    one = single_us(cu)
    gathers = [o for o in choices(cp) if o.kv == "all_gather"]  # priced whole, which pruning may not have
    gather = min(t.as_run for t in decide(cu, cp_size=cp, heads=HEADS, choices=tuple(gathers)).times)
    lengths = cu.diff().long()
    return Row(
        cp=cp,
        documents=lengths.numel(),
        pick=option_name(d.spec, cp),
        efficiency=one / (cp * d.time.as_run),
        overlapped=one / (cp * d.time.overlapped),
        megabytes=max(d.time.received) / 1e6,
        gather=one / (cp * gather),
        plan_ms=plan_ms(cu, cp, d.spec),
        warm_ms=plan_ms(cu, cp, d.spec, scratch=False),
        decide_ms=decide_ms,
        step_ms=d.time.as_run / 1e3,
        single_us=one,
        pairs=int((lengths * (lengths + 1) // 2).sum()),
    )


SHORT = {"balanced": "bal", "dual_chunk_swap": "dcs", "no_load_balance": "nlb", "exchange": "ex",
         "all-gather": "ag", "hybrid": "hyb", "heads": "heads", "ring": "ring"}  # fmt: skip


def short(pick: str) -> str:
    """``balanced exchange`` -> ``bal ex``, ``balanced hybrid u=8`` -> ``bal hyb8``."""
    words = pick.split()
    name = " ".join(SHORT.get(w, w) for w in words if not w.startswith("u="))
    return name + "".join(w[2:] for w in words if w.startswith("u="))


def scale_table(per_rank: list[Row], fixed: list[Row]) -> list[str]:
    """Both series side by side, one row per cp."""
    lines = [
        "| cp | pick | eff | ovl | MB | ag eff | plan / decide ms | pick | eff | ovl | MB | plan ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a, b in zip(per_rank, fixed, strict=True):
        lines.append(
            f"| {a.cp} | {short(a.pick)} | {a.efficiency:.2f} | {a.overlapped:.2f} | {a.megabytes:.0f} | "
            f"{a.gather:.2f} | {a.plan_ms:.0f} / {a.decide_ms:.0f} | {short(b.pick)} | {b.efficiency:.2f} | "
            f"{b.overlapped:.2f} | {b.megabytes:.0f} | {b.plan_ms:.0f} |"
        )
    return lines


def split(cu: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``cu`` cut into ``parts`` consecutive packs of equal tokens, documents cut at their edges."""
    total = int(cu[-1])
    size = total // parts
    packs = []
    for g in range(parts):
        lo, hi = g * size, (g + 1) * size
        inner = cu[(cu > lo) & (cu < hi)].long()
        packs.append(torch.cat([torch.tensor([0]), inner - lo, torch.tensor([size])]).to(torch.int32))
    return packs


def dp_table(cu: torch.Tensor, gpus: int) -> list[str]:
    """dp x cp over ``gpus``: each group's own pack, the step the slowest group's."""
    lines = ["| dp x cp | pick | step ms | eff | pairs | plan ms |", "| --- | --- | --- | --- | --- | --- |"]
    whole = None
    dp = 1
    while gpus // dp >= 8:
        rows = [scale_row(p, gpus // dp) for p in split(cu, dp)]
        step = max(r.step_ms for r in rows)
        pairs = sum(r.pairs for r in rows)
        whole = pairs if whole is None else whole
        efficiency = sum(r.single_us for r in rows) / 1e3 / (gpus * step)
        lines.append(
            f"| {dp} x {gpus // dp} | {short(rows[0].pick)} | {step:.1f} | {efficiency:.2f} | {pairs / whole:.3f} | "
            f"{max(r.plan_ms for r in rows):.0f} |"
        )
        dp *= 2
    return lines


def scale_section(setup: Setup, draw) -> list[str]:
    per_rank = [scale_row(cut_pack(draw, setup.per_rank * cp), cp) for cp in setup.cp_sizes]
    fixed = [scale_row(cut_pack(draw, setup.total), cp) for cp in setup.cp_sizes]
    dp = dp_table(cut_pack(draw, setup.per_rank * setup.gpus), setup.gpus)
    top = per_rank[-1]
    return [
        f"A pack per row from {setup.mix}, heads {HEADS.q}/{HEADS.kv}, 8-GPU H200 nodes; a layer's attention fwd+bwd,"
        " predicted. eff: one GPU / (cp x slowest rank), as run; ovl: traffic hidden; ag: best all-gather; MB:"
        " most a rank receives; plan, decide: host ms here (module docstring).",
        "",
        f"Left {setup.per_rank // 1024}K tokens per rank, right {setup.total // 1024}K per pack:",
        "",
        *scale_table(per_rank, fixed),
        "",
        f"dp x cp over {setup.gpus} GPUs, {setup.per_rank // 1024}K tokens each; pairs: attention the cut packs keep:",
        "",
        *dp,
        "",
        f"cp={top.cp}: {top.pick} {top.efficiency:.2f}, a {top.step_ms:.1f} ms layer; host: decide"
        f" {top.decide_ms:.0f} ms, rank 0's plan {top.plan_ms:.0f} ms from scratch, {top.warm_ms:.0f} ms after decide"
        " (balanced's cuts kept).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doclens", type=Path, default=None, help="folder of length mixes (or prolong.json)")
    parser.add_argument("--fit", action="store_true", help="refit the model's constants to the cp=2 runs")
    parser.add_argument("--cpu-smoke", action="store_true", help="a few seconds: synthetic mix, small scales")
    parser.add_argument(
        "--calibration", action="store_true", help="print the calibration table alone (docs/communication.md)"
    )
    add_output_argument(parser)
    args = parser.parse_args()
    if args.calibration:
        summary, table = calibration(args.doclens, args.fit)
        print("\n".join([f"Model {summary}.", "", *table]))
        return
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    lines = [*header(SECTION)]
    if args.cpu_smoke:
        setup, draw = SMOKE, BUILTIN_MIX.sampler(generator)
    else:
        path = None if args.doclens is None else (args.doclens / FULL.mix if args.doclens.is_dir() else args.doclens)
        if path is None or not path.is_file():
            parser.error(f"--doclens must hold {FULL.mix} (or use --cpu-smoke)")
        setup, draw = FULL, length_sampler(path, generator)
        summary = calibration(args.doclens, args.fit)[0]
        lines += [f"Model {summary.split(' (2 x H200)')[0]}{summary.split(' (2 x H200)')[-1].split(', largest')[0]}"
                  " (docs/communication.md).", ""]  # fmt: skip
    publish(SECTION, [*lines, *scale_section(setup, draw)], args.output)


if __name__ == "__main__":
    main()

"""CP at scale on paper (CPU): the step-time model (``cpcompile.advisor.timing``) calibrated against the
measured cp=2 runs, then per-GPU efficiency, bytes and host planning time from cp=8 to 256.

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
from pathlib import Path
from typing import NamedTuple

import torch

from cpcompile import Strategy, StrategySpec
from cpcompile.advisor.comm_model import Heads
from cpcompile.advisor.timing import H200, KernelSpeed, LayerTerms, Phase, Topology, _phase_us, evaluate, layer_terms
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
        spec = LAYOUTS[layout]
        if kv == "ring":
            spec = dataclasses.replace(spec, comm="ring")
        exchange = "always" if kv == "exchange" else "never"
        terms = layer_terms(cu, cp_size=cp, strategy=spec, heads=heads, passes=passes, kv_exchange=exchange)
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
    lines = [*header(SECTION)]
    if not args.cpu_smoke:
        lines += [f"Model {calibration(args.doclens, args.fit)[0]} (per figure: docs/communication.md).", ""]
    publish(SECTION, lines, args.output)


if __name__ == "__main__":
    main()

"""Strategy advisor: which CP strategy suits a document-length mix, from the cost model alone.

    python -m cpcompile.advisor [--doclens lengths.json] --pack 131072 --cp 8 [--packs 4] [--plot out.png]
        [--heads 32/8] [--head-dim 128] [--bandwidth 300] [--topology h200[,field=value...]]

It samples packs from the length file as a data loader packs them (documents drawn
until the pack is full, the last one cut), runs :func:`cpcompile.cost.predict_rank_costs`
for every strategy ``auto`` chooses from, prints per strategy the per-rank attention
work (max/mean), the padding it adds, pieces per rank and the predicted step, and
recommends one. ``--plot`` draws each strategy's per-rank work and predicted cost on
the first pack (needs matplotlib: ``pip install "cpcompile[advise]"``).

A second table adds head parallelism (``head_parallel = u`` for every ``u > 1`` that
divides both ``--cp`` and the query heads) beside those strategies, for the model's
``--heads`` (bf16): per rank its attention work, the bytes its attention moves per layer
and their modelled time at ``--bandwidth`` GB/s (:mod:`cpcompile.advisor.comm_model`), and the
step with that communication added; its recommendation is what
:func:`cpcompile.advisor.comm_model.choose_spec` (the opt-in that weighs ``u``) would pick.

``--topology`` adds a third table: every layout with every K/V path (all-gather, sparse
exchange, ring, the hybrid of each ``u``, pure head parallelism) and its predicted layer in
milliseconds over that topology, as run and overlapped (:mod:`cpcompile.cost.timing`), and
what :func:`cpcompile.cost.timing.decide` picks on each pack.

Length files: a JSON list of token counts, a text file with one count per line, or a
CSV of ``upper_bound_tokens,cumulative_percent`` (a length histogram as a CDF: a bin
is drawn by its share, then a length uniformly inside it). Without one, a built-in
synthetic mix (:data:`BUILTIN_MIX`: many short documents, a long tail) is sampled.

Design constraint: no GPU, no process group, no model: everything comes from
``cu_seqlens`` and the cost model's constants, so it runs where a data set is prepared.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from cpcompile.advisor.comm_model import Link, StepPrediction, candidates_with_heads, predict_step
from cpcompile.cost.comm import Heads, check_heads
from cpcompile.cost.model import CostModel, RankCosts, auto_candidates, predict_rank_costs
from cpcompile.cost.timing import StepTime, Topology, decide, option_name, parse_topology
from cpcompile.spec import Strategy, StrategySpec

# auto must beat the best fixed strategy by this much to be worth a per-batch host-side decision
AUTO_MARGIN = 0.01


def spec_name(spec: StrategySpec) -> str:
    """``striped_128`` for striped with 128-token stripes, else the strategy's value; `` u=4``
    added for ``head_parallel=4``."""
    name = spec.strategy.value
    if spec.strategy is Strategy.STRIPED and spec.stripe_size != 1:
        name = f"striped_{spec.stripe_size}"
    return name if spec.head_parallel == 1 else f"{name} u={spec.head_parallel}"


# --- document lengths and packs --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthMix:
    """A synthetic document-length mix: log-normal short documents and a log-uniform long tail.

    Stands in for a length file: long-context pretraining data is mostly short documents
    (web pages) with a few long ones (books, code repositories) that hold most tokens.
    Made up to have that shape, not fitted to any data set.
    """

    median: int = 1024  # tokens, of the short documents
    sigma: float = 1.2  # of the short documents' log length
    long_share: float = 0.02  # of documents
    long_min: int = 16384
    long_max: int = 524288

    def describe(self) -> str:
        return (
            f"{100 * (1 - self.long_share):.0f}% of documents log-normal around {self.median:,} tokens "
            f"(sigma {self.sigma}), {100 * self.long_share:.0f}% log-uniform in "
            f"{self.long_min:,}-{self.long_max:,} tokens"
        )

    def sampler(self, generator: torch.Generator) -> Callable[[int], torch.Tensor]:
        """``draw(n)`` -> ``[n]`` int64 document lengths."""

        def draw(n: int) -> torch.Tensor:
            short = torch.empty(n, dtype=torch.float64)
            short.log_normal_(math.log(self.median), self.sigma, generator=generator)
            log_long = torch.empty(n, dtype=torch.float64).uniform_(
                math.log(self.long_min), math.log(self.long_max), generator=generator
            )
            is_long = torch.rand(n, dtype=torch.float64, generator=generator) < self.long_share
            return torch.where(is_long, log_long.exp(), short).long().clamp_(min=1)

        return draw


#: what the advisor samples when no length file is given
BUILTIN_MIX = LengthMix()


def length_sampler(path: Path, generator: torch.Generator) -> Callable[[int], torch.Tensor]:
    """``draw(n)`` -> ``[n]`` int64 document lengths from a length file (see the module docstring).

    Raises ``ValueError`` naming ``--doclens``, the file and what is accepted when the
    file cannot be read or holds anything else.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--doclens {path}: cannot read it as text ({getattr(e, 'strerror', None) or e})") from None
    accepted = "a JSON list of token counts (.json), one count per line, or a .csv CDF"
    if not text.strip():
        raise ValueError(f"--doclens {path}: the file is empty; expected {accepted}")
    if path.suffix == ".csv":
        lower, upper, share = read_cdf(text, path)

        def draw_binned(n: int) -> torch.Tensor:
            b = torch.multinomial(share, n, replacement=True, generator=generator)
            return lower[b] + (torch.rand(n, generator=generator) * (upper[b] - lower[b] + 1)).long()

        return draw_binned
    try:
        values = json.loads(text) if path.suffix == ".json" else [int(word) for word in text.split()]
    except ValueError as e:
        raise ValueError(f"--doclens {path}: expected {accepted} ({e})") from None
    if not isinstance(values, list) or not values:
        got = "an empty list" if values == [] else f"a JSON {type(values).__name__}"
        raise ValueError(f"--doclens {path}: expected a JSON list of token counts (ints >= 1), got {got}")
    bad = [v for v in values if type(v) is not int or v < 1]
    if bad:
        raise ValueError(
            f"--doclens {path}: token counts must be ints >= 1, got {bad[0]!r} ({len(bad)} such of {len(values)})"
        )
    lengths = torch.tensor(values, dtype=torch.long)
    return lambda n: lengths[torch.randint(lengths.numel(), (n,), generator=generator)]


def read_cdf(text: str, path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CSV length histogram as ``[bins]`` int64 lower and upper bounds and float32 shares."""
    columns = "a CSV must have columns upper_bound_tokens,cumulative_percent"
    reader = csv.DictReader(text.splitlines())
    if not {"upper_bound_tokens", "cumulative_percent"} <= set(reader.fieldnames or ()):
        raise ValueError(f"--doclens {path}: {columns}, got {','.join(reader.fieldnames or ())}")
    rows = []
    for row in reader:
        try:
            rows.append((int(row["upper_bound_tokens"]), float(row["cumulative_percent"])))
        except (TypeError, ValueError):
            line = text.splitlines()[reader.line_num - 1]
            raise ValueError(
                f"--doclens {path}: line {reader.line_num} needs an int upper_bound_tokens and a number "
                f"cumulative_percent, got {line!r}"
            ) from None
    if not rows:
        raise ValueError(f"--doclens {path}: {columns} and at least one row, got none")
    upper = torch.tensor([u for u, _ in rows], dtype=torch.long)
    cum = torch.tensor([c for _, c in rows])
    if int(upper[0]) < 1 or bool((upper[1:] <= upper[:-1]).any()):
        raise ValueError(f"--doclens {path}: upper_bound_tokens must rise from 1 or more, got {upper.tolist()[:8]}")
    if not bool(cum.isfinite().all()) or float(cum[0]) < 0 or bool((cum[1:] < cum[:-1]).any()) or float(cum[-1]) <= 0:
        raise ValueError(
            f"--doclens {path}: cumulative_percent must not fall and must end above 0, got {cum.tolist()[:8]}"
        )
    lower = torch.cat([upper.new_ones(1), upper[:-1] + 1])
    return lower, upper, torch.diff(cum, prepend=cum.new_zeros(1))


def cut_pack(draw: Callable[[int], torch.Tensor], pack: int) -> torch.Tensor:
    """``[B + 1]`` int32 ``cu_seqlens`` of one pack of ``pack`` tokens: documents drawn, the last one cut."""
    lengths = draw(64)
    while int(lengths.sum()) < pack:
        lengths = torch.cat([lengths, draw(64)])
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    cu = cu[: int(torch.searchsorted(cu, pack)) + 1]  # up to the first document that reaches the end
    cu[-1] = pack
    return cu.to(torch.int32)


# --- the advice -------------------------------------------------------------------


@dataclasses.dataclass
class StrategyReport:
    """One strategy over the sampled packs; each list holds one value per pack."""

    spec: StrategySpec
    costs: list[RankCosts]

    @property
    def name(self) -> str:
        return spec_name(self.spec)

    def work_imbalance(self) -> list[float]:
        """max/mean over ranks of exact attention work (pairs)."""
        return [float(c.pairs.max() / c.pairs.double().mean()) for c in self.costs]

    def steps(self) -> list[int]:
        return [c.step for c in self.costs]


@dataclasses.dataclass
class OptionReport:
    """One spec, head parallelism included, over the sampled packs, with its communication."""

    spec: StrategySpec
    steps: list[StepPrediction]  # per pack

    @property
    def name(self) -> str:
        return spec_name(self.spec)

    def step_totals(self) -> list[int]:
        return [s.step for s in self.steps]


@dataclasses.dataclass
class HeadAdvice:
    """The second table: every option with its modelled communication (module docstring)."""

    heads: Heads
    link: Link
    options: list[OptionReport]  # sequence strategies first, then by head_parallel
    picks: list[str]  # per pack: what choose_spec picks
    recommended: str


@dataclasses.dataclass
class TopologyAdvice:
    """The third table: every option :func:`cpcompile.cost.timing.decide` weighs, its predicted layer
    on each pack over a topology."""

    topology: Topology
    heads: Heads
    options: tuple[StrategySpec, ...]  # decide's order
    times: list[list[StepTime]]  # [option][pack]
    picks: list[str]  # per pack: what decide picks
    recommended: str  # the lowest total as run


@dataclasses.dataclass
class Advice:
    pack: int
    cp: int
    packs: list[torch.Tensor]  # cu_seqlens of each sampled pack
    reports: list[StrategyReport]  # in auto's candidate order
    auto_picks: list[str]  # per pack
    recommended: str
    reason: str
    heads: HeadAdvice | None = None
    topology: TopologyAdvice | None = None


def advise_topology(packs: list[torch.Tensor], *, cp_size: int, heads: Heads, topology: Topology) -> TopologyAdvice:
    """:func:`cpcompile.cost.timing.decide` on every pack, with every option's predicted layer kept."""
    decisions = [decide(cu, cp_size=cp_size, heads=heads, topology=topology) for cu in packs]
    choices = decisions[0].options
    times = [[d.times[i] for d in decisions] for i in range(len(choices))]
    totals = [sum(t.as_run for t in per_pack) for per_pack in times]
    best = option_name(choices[totals.index(min(totals))], cp_size)
    return TopologyAdvice(topology, heads, choices, times, [option_name(d.spec, cp_size) for d in decisions], best)


def advise_heads(
    packs: list[torch.Tensor], *, cp_size: int, heads: Heads, model: CostModel | None = None, link: Link | None = None
) -> HeadAdvice:
    """Every spec of :func:`cpcompile.advisor.comm_model.candidates_with_heads` on ``packs``, its step with the
    communication its path moves (:func:`cpcompile.advisor.comm_model.predict_step`); recommended: the one
    with the lowest total."""
    heads, link = check_heads(heads), Link() if link is None else link
    kw = {"cp_size": cp_size, "heads": heads, "model": model, "link": link}
    options = [
        OptionReport(spec, [predict_step(cu, strategy=spec, **kw) for cu in packs])
        for spec in candidates_with_heads(cp_size, heads, model)
    ]
    per_pack = list(zip(*(o.step_totals() for o in options)))  # [pack][option]
    picks = [options[steps.index(min(steps))].name for steps in per_pack]  # choose_spec's rule
    totals = [sum(o.step_totals()) for o in options]
    return HeadAdvice(heads, link, options, picks, options[totals.index(min(totals))].name)


def advise(
    packs: list[torch.Tensor],
    *,
    cp_size: int,
    model: CostModel | None = None,
    heads: Heads | None = None,
    link: Link | None = None,
    topology: Topology | None = None,
) -> Advice:
    """Predict every candidate strategy on ``packs`` and recommend one.

    Args:
        packs: ``cu_seqlens`` ``[B + 1]`` int32 of each pack, all of the same total.
        model: cost constants (default :class:`cpcompile.cost.CostModel`).
        heads: the model's :class:`~cpcompile.cost.comm.Heads`: also weigh head parallelism and
            every option's communication at ``link`` (:func:`advise_heads`); ``None``: not.
        topology: also predict every layout, K/V path and ``u`` over it in milliseconds
            (:func:`advise_topology`; needs ``heads``); ``None``: not.
    Returns:
        :class:`Advice`: the fixed strategy with the lowest total predicted step, or
        ``auto`` when picking per pack saves more than ``AUTO_MARGIN`` of it.
    """
    if not packs:
        raise ValueError("packs must hold at least one cu_seqlens tensor, got none")
    model = CostModel() if model is None else model
    reports = [
        StrategyReport(spec, [predict_rank_costs(cu, cp_size=cp_size, strategy=spec, model=model) for cu in packs])
        for spec in auto_candidates(model)
    ]
    per_pack = list(zip(*(r.steps() for r in reports)))  # [pack][strategy]
    # choose_strategy's rule (lowest step, ties to the earlier candidate) on steps computed once
    picks = [reports[steps.index(min(steps))].name for steps in per_pack]
    totals = [sum(r.steps()) for r in reports]
    best = min(range(len(reports)), key=totals.__getitem__)
    auto_total = sum(min(steps) for steps in per_pack)
    saving = 1 - auto_total / totals[best]
    if saving > AUTO_MARGIN:
        recommended = "auto"
        reason = (
            f"picking per pack predicts {100 * saving:.1f}% less than the best fixed strategy, {reports[best].name}"
        )
    else:
        recommended = reports[best].name
        reason = f"lowest predicted step over {len(packs)} packs"
        if saving > 0:
            reason += f"; auto would save only {100 * saving:.1f}%"
    pack = int(packs[0][-1])
    with_heads = None if heads is None else advise_heads(packs, cp_size=cp_size, heads=heads, model=model, link=link)
    if topology is not None and heads is None:
        raise ValueError("topology needs heads: the time of each path depends on what it moves")
    timed = None if topology is None else advise_topology(packs, cp_size=cp_size, heads=heads, topology=topology)
    return Advice(pack, cp_size, packs, reports, picks, recommended, reason, with_heads, timed)


def format_table(advice: Advice) -> str:
    """The advice as a text table: one row per strategy, then the recommendation."""
    docs = sum(cu.shape[0] - 1 for cu in advice.packs) / len(advice.packs)
    best = min(sum(r.steps()) for r in advice.reports)
    lines = [
        f"{len(advice.packs)} packs of {advice.pack:,} tokens ({docs:.0f} documents on average), cp={advice.cp}, "
        f"{advice.pack // advice.cp:,} tokens per rank",
        "",
        f"{'strategy':<16} {'work max/mean':>13} {'worst':>7} {'padding':>9} {'pieces/rank':>12} "
        f"{'step (Gpairs)':>14} {'step/best':>10} {'auto picks':>10}",
    ]
    for r in advice.reports:
        work = r.work_imbalance()
        padding = sum(int(c.tokens.sum()) for c in r.costs) / len(r.costs) - advice.pack
        pieces = sum(float(c.pieces.double().mean()) for c in r.costs) / len(r.costs)
        step = sum(r.steps()) / len(r.costs)
        lines.append(
            f"{r.name:<16} {sum(work) / len(work):>13.3f} {max(work):>7.3f} {padding:>9,.0f} {pieces:>12.1f} "
            f"{step / 1e9:>14.3f} {sum(r.steps()) / best:>10.3f} {advice.auto_picks.count(r.name):>10}"
        )
    lines += [
        "",
        "work: exact causal attention pairs per rank, max/mean (1.0 is even), mean over packs, and the worst pack;",
        "padding: tokens added per pack; pieces/rank: kernel sequences per rank (short pieces waste tiles);",
        "step: the slowest rank's predicted cost (cpcompile.cost: kernel tiles + per-token work + backward key",
        "copies, in attention pairs), mean over packs; auto picks: packs on which auto would choose it.",
        "",
        f"recommended: {advice.recommended} ({advice.reason})",
    ]
    if advice.heads is not None:
        lines += ["", *format_heads(advice.heads, advice.cp)]
    if advice.topology is not None:
        lines += ["", *format_topology(advice.topology, advice.cp)]
    return "\n".join(lines)


def format_topology(advice: TopologyAdvice, cp: int) -> list[str]:
    """The third table: every option's predicted layer over the topology, milliseconds (mean over packs)."""
    t, h = advice.topology, advice.heads
    nodes = -(-cp // t.gpus_per_node)
    lines = [
        f"predicted layer over the topology (cpcompile.cost.timing): {nodes} node(s) of {t.gpus_per_node} GPUs, "
        f"NVLink {t.intra_gbps:g} GB/s, across nodes {t.inter_gbps:g} GB/s per GPU; heads {h.q}/{h.kv} x {h.dim}, "
        "forward+backward of attention:",
        "",
        f"{'option':<30} {'as run ms':>9} {'overlapped':>10} {'compute':>8} {'comm':>7} {'MB/rank':>8} {'/best':>6} "
        f"{'picks':>5}",
    ]
    n = len(advice.times[0])
    best = min(sum(x.as_run for x in per_pack) for per_pack in advice.times)
    for option, per_pack in zip(advice.options, advice.times, strict=True):
        name = option_name(option, cp)
        run, over = (sum(getattr(x, a) for x in per_pack) / n / 1e3 for a in ("as_run", "overlapped"))
        compute, comm = (sum(max(getattr(x, a)) for x in per_pack) / n / 1e3 for a in ("compute", "comm"))
        mb = sum(max(x.received) for x in per_pack) / n / 1e6
        total = sum(x.as_run for x in per_pack)
        lines.append(
            f"{name:<30} {run:>9.2f} {over:>10.2f} {compute:>8.2f} {comm:>7.2f} {mb:>8.0f} {total / best:>6.3f} "
            f"{advice.picks.count(name):>5}"
        )
    return [
        *lines,
        "",
        "as run: the slowest rank's compute + communication (the ring: each step its slowest rank's, its next block",
        "in flight); overlapped: the slowest rank's max(compute, communication), what hiding the traffic would give;",
        "compute, comm: the busiest rank's; MB/rank: the most a rank receives; picks: packs on which",
        "cpcompile.cost.timing.decide picks it. The constants are fitted to cp=2 on 2 x H200; the inter-node link",
        "is assumed (docs/communication.md, 'The step-time model').",
        "",
        f"over this topology: {advice.recommended} (lowest predicted layer over {n} packs)",
    ]


def format_heads(advice: HeadAdvice, cp: int) -> list[str]:
    """The second table: every option, head parallelism included, with its communication."""
    h, link = advice.heads, advice.link
    columns = (
        f"{'option':<20} {'heads/rank':>10} {'work max/mean':>13} {'Mpairs/rank':>11} {'path':<23} "
        f"{'MB fwd':>7} {'MB fwd+bwd':>10} {'comm ms':>8} {'step+comm':>10} {'/best':>6} {'picks':>5}"
    )
    title = f"with head parallelism, heads {h.q}/{h.kv} x {h.dim} ({8 * h.itemsize}-bit), communication"
    lines = [
        f"{title} modelled at {link.bandwidth_gbps} GB/s per GPU (cpcompile.advisor.comm_model, not measured):",
        "",
        columns,
    ]
    best = min(sum(o.step_totals()) for o in advice.options)
    for o in advice.options:
        n = len(o.steps)
        pairs = [s.costs.pairs.double() for s in o.steps]
        work = sum(float(p.max() / p.mean()) for p in pairs) / n
        forward = sum(int(s.bytes.forward.max()) for s in o.steps) / n
        total = sum(int(s.bytes.total.max()) for s in o.steps) / n
        most = sum(float(p.max()) for p in pairs) / n
        step = sum(o.step_totals())
        lines.append(
            f"{o.name:<20} {h.q // o.spec.head_parallel:>10} {work:>13.3f} {most / 1e6:>11.1f} "
            f"{o.steps[0].bytes.path:<23} {forward / 1e6:>7.0f} {total / 1e6:>10.0f} {link.milliseconds(total):>8.2f} "
            f"{step / n / 1e9:>10.3f} {step / best:>6.3f} {advice.picks.count(o.name):>5}"
        )
    return [
        *lines,
        "",
        f"u=N: kv='heads', head_parallel=N (N = cp {cp}: pure head parallelism, whole documents on every rank; "
        "else the hybrid);",
        "work: attention pairs per rank on its heads (max/mean, and the max in millions, in all-heads pairs);",
        "MB: what the busiest rank receives per layer in its attention's forward, and forward and backward;",
        "comm ms: that at the bandwidth above, not overlapped; step+comm: the step (Gpairs) with it added;",
        "picks: packs on which cpcompile.advisor.comm_model.choose_spec (the opt-in that weighs head parallelism)",
        "picks it.",
        "",
        f"with communication: {advice.recommended} (lowest step+comm over {len(advice.options[0].steps)} packs)",
    ]


def plot(advice: Advice, path: Path, *, pack_index: int = 0) -> None:
    """Per-rank bars for pack ``pack_index``: attention work (top) and predicted cost by part (bottom), per strategy.

    The title says which pack of how many it draws (the table averages them all).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError('--plot needs matplotlib: pip install "cpcompile[advise]" (or matplotlib)') from None
    model = CostModel()
    n = len(advice.reports)
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n, 7.5), sharey="row", squeeze=False)
    costs = [r.costs[pack_index] for r in advice.reports]
    # one scale for every panel: the mean of the lowest-cost strategy is 1.0
    cost_unit = min(float(c.cost.double().mean()) for c in costs)
    ranks = torch.arange(advice.cp).tolist()
    for col, (r, c) in enumerate(zip(advice.reports, costs)):
        work = (c.pairs.double() / c.pairs.double().mean()).tolist()
        top, bottom = axes[0][col], axes[1][col]
        top.bar(ranks, work, color="tab:blue")
        top.axhline(1.0, color="black", linestyle="--", linewidth=1)
        pad = int(c.tokens.sum()) - advice.pack
        top.set_title(f"{r.name}\nwork max/mean {max(work):.3f}, padding {pad}", fontsize=11)
        parts = (
            ("attention tiles", c.tiles * model.block_q * model.block_k, "tab:blue"),
            ("per-token work", model.token_cost * c.tokens, "tab:gray"),
            ("backward key copies", model.key_cost * c.key_rows, "tab:orange"),
        )
        base = torch.zeros(advice.cp, dtype=torch.float64)
        for label, part, color in parts:
            height = part.double() / cost_unit
            bottom.bar(ranks, height.tolist(), bottom=base.tolist(), color=color, label=label)
            base += height
        bottom.set_title(f"step {c.step / cost_unit:.3f} (max rank)", fontsize=11)
        bottom.set_xlabel("rank")
        for ax in (top, bottom):
            ax.set_xticks(ranks)
    axes[0][0].set_ylabel("attention work / mean")
    axes[1][0].set_ylabel("predicted cost / best mean")
    handles, labels = axes[1][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=10)
    docs = advice.packs[pack_index].shape[0] - 1
    fig.suptitle(
        f"Per-rank work, cp={advice.cp}, pack {pack_index + 1} of {len(advice.packs)}: {advice.pack:,} tokens "
        f"in {docs} documents (recommended over all packs: {advice.recommended})",
        fontsize=13,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the legend below the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, else argparse's one-line error naming the option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def heads_pair(text: str) -> tuple[int, int]:
    """argparse type: ``Q/KV`` query and key-value heads, ``Q`` a multiple of ``KV``."""
    q, _, kv = text.partition("/")
    try:
        heads = (int(q), int(kv))
    except ValueError:
        heads = (0, 0)
    if min(heads) < 1 or heads[0] % heads[1]:
        raise argparse.ArgumentTypeError(f"must be Q/KV, positive ints with Q a multiple of KV, got {text!r}")
    return heads


def topology_option(text: str) -> Topology:
    """argparse type: :func:`cpcompile.cost.timing.parse_topology`, its error as argparse's."""
    try:
        return parse_topology(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def plot_path_error(path: Path) -> str | None:
    """Why a plot cannot be written to ``path``, or ``None``; checked before any work."""
    if path.is_dir():
        return "is a directory"
    if not path.parent.is_dir():
        return f"directory {path.parent} does not exist"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "is not writable"
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None  # no plot at all: said after the table
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        return f"needs a suffix matplotlib writes ({', '.join('.' + f for f in sorted(formats))})"
    return None


def main(argv: list[str] | None = None) -> Advice:
    parser = argparse.ArgumentParser(
        prog="python -m cpcompile.advisor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--doclens",
        type=Path,
        default=None,
        metavar="FILE",
        help="length file: .json list, .csv CDF, or text (default: a built-in synthetic mix)",
    )
    parser.add_argument(
        "--pack", type=positive_int, default=131072, help="tokens per pack, whole CP group (default 131072)"
    )
    parser.add_argument("--cp", type=positive_int, default=8, help="CP ranks (default 8)")
    parser.add_argument("--packs", type=positive_int, default=4, help="packs to sample (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, help="write per-rank bars of the first pack (.png, ...)")
    parser.add_argument(
        "--heads", type=heads_pair, default=(32, 8), metavar="Q/KV", help="query/key-value heads (default 32/8)"
    )
    parser.add_argument("--head-dim", type=positive_int, default=128, help="elements per head (default 128)")
    parser.add_argument(
        "--bandwidth", type=positive_int, default=Link().bandwidth_gbps, help="GB/s per GPU, assumed (default 300)"
    )
    parser.add_argument(
        "--topology",
        type=topology_option,
        default=None,
        metavar="NAME[,FIELD=VALUE...]",
        help="also predict every layout, K/V path and u in milliseconds over this topology (h200, h200-200g, "
        "h200-4; fields of cpcompile.cost.timing.Topology replaced, e.g. h200,inter_gbps=25)",
    )
    args = parser.parse_args(argv)
    if args.pack < args.cp:
        parser.error(f"--pack {args.pack} must be at least --cp {args.cp} (one token per rank)")
    if args.plot is not None and (why := plot_path_error(args.plot)) is not None:
        parser.error(f"--plot {args.plot}: {why}")
    generator = torch.Generator().manual_seed(args.seed)
    if args.doclens is None:
        draw = BUILTIN_MIX.sampler(generator)
        print(f"document lengths: the built-in synthetic mix (no --doclens): {BUILTIN_MIX.describe()}")
    else:
        try:
            draw = length_sampler(args.doclens, generator)
        except ValueError as e:
            parser.error(str(e))
        print(f"document lengths: {args.doclens}")
    heads = Heads(*args.heads, args.head_dim)
    advice = advise(
        [cut_pack(draw, args.pack) for _ in range(args.packs)],
        cp_size=args.cp,
        heads=heads,
        link=Link(bandwidth_gbps=args.bandwidth),
        topology=args.topology,
    )
    print(format_table(advice))
    if args.plot is not None:
        try:
            plot(advice, args.plot)
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
        else:
            print(f"wrote {args.plot}: per-rank bars of pack 1 of {args.packs} (the table averages all {args.packs})")
    return advice


if __name__ == "__main__":
    main()

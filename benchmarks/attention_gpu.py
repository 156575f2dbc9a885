"""Packed attention on one GPU: the single-GPU ceiling, then every CP rank's local step.

CP efficiency = single-GPU time / (cp x slowest rank), each rank's pieces timed with
the real kernel on the keys ``cp_attention`` gives it: all of them (all-gather), or
those it reads (sparse exchange, where it would be chosen; column K/V); communication
excluded (docs/measurement.md).
Forward and forward+backward, bf16, heads 32/8 (GQA) and 16/16, head dim 128 (``--heads HQ/HKV ...``,
``--head-dims D/DV``: DeepSeek-V3's multi-head latent attention is ``--heads 128/128 --head-dims 192/128``;
``--softcap C``: Gemma 2's logit soft-capping; kernels that cannot run the variant are left out;
``--sinks``: GPT-OSS's learnable sinks, ``[Hq]`` float32 logits in every call: the single-GPU reference is FA4's own
varlen call with ``learnable_sink=`` (torch's ``varlen_attn`` has none: left out), ``packed_attention(sinks=)``
and each rank's kernel calls given the sinks, as the ops give them (FA4 joins them in its softmax)).

    python benchmarks/attention_gpu.py --doclens ../shared/data/doclens/prolong.json [--tokens 131072] [--window 4096]

``--forward-even`` also times balanced laid out by its forward work alone (its steps 0-4,
``balanced_layout(..., backward=False)``), the layout before forward+backward balancing became the
default: the rows named ``balanced forward-even``.

``--window W`` times sliding-window attention ``window_size=(W, 0)`` throughout:
the pieces read only their windows' keys, and balanced is timed also told the window
(``StrategySpec("balanced", windows=(W,))``).

Every GPU kernel backend present is measured: flash always; with the ``gpu`` extra also
cudnn and auto (the default then: FA4 where installed, else cuDNN's forward and the
backward chosen per call); with the ``fa4`` extra fa4, and FA4's own varlen call on
whole documents among the single-GPU references (the fastest, where installed).
It prints its section of ``BENCHMARKS.md``; ``--output FILE`` also writes it there.

Timing and columns: each cell is the median over the packs of a median of 5 timed runs, each queued
behind an untimed call; with ``--rounds`` the single-GPU calls, and the reference and each rank, are
timed in rounds in turn (each round starting one later), each their median. Single GPU =
``cpcompile.packed_attention`` (or torch's ``varlen_attn``, or FA4's own varlen call) on the whole pack;
efficiency = best single-GPU time / (cp x slowest rank), that reference timed again right before each
layout's ranks; max/mean = slowest rank over the mean; short = pieces per rank under 128 query rows;
K/V = the keys a rank's kernel runs on, all (all-gather) or those it reads (exchange; its backward timed
with the sums of the rows it sends back, not the one adding the rows it gets back to its own);
communication is not timed. ``[flash]`` torch's varlen flash kernel, ``[cudnn]`` cuDNN's fused attention
on the ragged pieces, ``[fa4]`` FlashAttention-4, ``[auto]`` FA4 where installed, else cuDNN's forward
and the backward chosen per call.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
from report import add_output_argument, header, publish

import cpcompile
from cpcompile import kernels
from cpcompile.attention import exchange as exchange_op
from cpcompile.attention import gathered
from cpcompile.attention import sinks as sink_ops
from cpcompile.batch import _to_documents
from cpcompile.cache import upload
from cpcompile.comm.kv_gather import grad_buffers
from cpcompile.cost.comm import use_exchange
from cpcompile.cost.flops import causal_attention_flops
from cpcompile.kernels import cudnn, fa4
from cpcompile.layouts import balanced_op
from cpcompile.layouts.partition import padding_multiple
from cpcompile.plan import exchange
from cpcompile.plan.pieces import max_piece_len
from cpcompile.plan.window import window_keys
from cpcompile.testing import VARLEN_GQA, sample_lengths

HEADING = "## Attention on one GPU (benchmarks/attention_gpu.py)"
STRATEGIES = [
    cpcompile.StrategySpec(cpcompile.Strategy.DUAL_CHUNK_SWAP),
    cpcompile.StrategySpec(cpcompile.Strategy.NO_LOAD_BALANCE),
    cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, stripe_size=128),
    cpcompile.StrategySpec(cpcompile.Strategy.BALANCED),
]


def timed(fn, warmup: int = 2, iters: int = 5, calls: int = 4) -> float:
    """Median milliseconds per call of ``fn()`` on the current stream.

    Each timing queues ``calls`` calls back to back, as a training step queues its
    layers: the host's work per call is hidden behind the GPU's unless a call waits
    for the GPU (a host sync) or takes the host longer than the GPU, as it is in
    training. The start event is queued behind one more call, so the GPU is busy
    when it starts: from an idle GPU it would also count the host's work before
    the first call's kernels (docs/measurement.md).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # the lead call: the GPU runs it while the host queues the timed ones
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def in_turn(steps: list, rounds: int) -> list[float]:
    """The median over ``rounds`` of :func:`timed` of each of ``steps``, timed in turn, each round
    starting one step later. Where a timing falls in the run moves it by several % (the GPU's power
    state after the step before: docs/measurement.md, "A timing's place in the run"), so no step
    keeps one place, as the first in every round or the one after a lighter kernel."""
    n = len(steps)
    timings = [[0.0] * n for _ in range(rounds)]
    for round_ in range(rounds):
        for j in range(n):
            i = (round_ + j) % n
            timings[round_][i] = timed(steps[i])
    return [statistics.median(column) for column in zip(*timings)]


#: Kinds of GPU kernel a rank's call runs, by a part of the kernel's name (first match), for ``--profile``.
KERNEL_KINDS = (
    ("preprocess", "backward pre"),
    ("postprocess", "backward post"),
    ("backward", "backward"),
    ("forward", "forward"),
    ("sum_rows", "send pass (sum_rows)"),
    ("fill", "zero fills"),
)


def kernel_time_by_kind(fn, calls: int = 3) -> dict[str, float]:
    """GPU milliseconds per call of ``fn()`` by kind of kernel (:data:`KERNEL_KINDS`; ``other``), from
    ``torch.profiler`` over ``calls`` calls after one untimed: where a rank's time goes beside one GPU's."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.lower()
            kind = next((k for part, k in KERNEL_KINDS if part in name), "other")
            kinds[kind] = kinds.get(kind, 0.0) + event.time_range.elapsed_us() / 1e3 / calls
    return dict(sorted(kinds.items(), key=lambda item: -item[1]))


def kernel_step(
    kernel, q, k, v, plan, window, max_seqlen, backward: bool, max_seqlen_q=None, read=None, rank=0, softcap=0.0,
    sinks=None,
):  # fmt: skip
    """A rank's kernel calls as ``cp_attention`` makes them, its keys already brought: with
    ``read`` (the sparse exchange's :class:`~cpcompile.comm.exchange.Reads`) over the keys the
    rank (``rank``) reads, the backward giving dK/dV as parts, of which those of the keys other ranks own
    are summed into float32 rows to send, as the exchange's backward does before its
    all-to-all (what it does after, adding the returned sums to the rank's own parts, is not
    timed, as no communication is); else over all the keys (all-gathered), the backward
    writing dK/dV sums in the all-gather's order into the buffers the reduce-scatter reads."""
    k_start, k_len, _ = window_keys(*plan.pieces, window)  # (w, 0): bottom-right aligned, no positions
    kw = {"causal": True, "scale": q.shape[-1] ** -0.5, "window": window, "softcap": softcap}
    bounds = {"max_q": max_seqlen_q or max_seqlen, "max_k": max_seqlen}
    if read is not None:
        k, v = k[read.rows], v[read.rows]
        pieces = kernels.Pieces(plan.cu_q, read.k_start, k_len, **bounds)
        others = (read.owner != rank).nonzero().flatten()  # the compact rows other ranks own

        def sums():  # the parts, as the exchange's backward asks for them
            return {"pack_keys": plan.gather_index.shape[0], "grads": kernels.KeyGrads(partial=True)}

        def finish(parts):  # other ranks' rows summed into float32 rows to send, as the op does
            exchange_op.sums_to_send(parts, others, (k, v))
    else:
        pieces = kernels.Pieces(plan.cu_q, k_start, k_len, **bounds)
        key_order = gathered.gathered_order(plan.gather_index)

        def sums():
            dk_sums, dv_sums = grad_buffers(plan.gather_index, pieces.tensors, k, v, 1)
            return {"grads": kernels.KeyGrads(key_order, dk_sums[0], dv_sums[0])}

        def finish(parts):
            pass

    def run():
        out, lse = kernel.forward(q, k, v, pieces, sinks=sinks, **kw)  # as the ops hand them to the kernel
        if backward:
            finish(kernel.backward(out, q, k, v, out, lse, pieces, **sums(), **kw)[1:])
            if sinks is not None:  # the sinks' gradient, as the ops' autograd adds it (dO: out, as above)
                sink_ops.grad(out, out, lse, sinks)

    return run


def rank_reads(plans: list, cp: int, window) -> list | None:
    """Each rank's keys read, where ``cp_attention`` would exchange them (the rule its ranks
    apply to the counts they all hold), else ``None``: the all-gather."""
    read = [exchange.reads(p.gather_index, *window_keys(*p.pieces, window)[:2], cp) for p in plans]
    counts = [r.counts.tolist() for r in read]
    return read if use_exchange(counts, plans[0].gather_index.shape[0] // cp) else None


def single_step(attention, q, k, v, backward: bool):
    """A step of ``attention(q, k, v) -> out`` on leaves of ``q``, ``k``, ``v``: forward, and with
    ``backward`` the gradients for ``out`` (its own values as the gradient), returned rather
    than accumulated into the leaves' ``.grad``: from the second call on, that would add an
    elementwise pass over Q, K and V that the ranks' steps (``kernel_step``) do not make."""
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]

    def run():
        out = attention(*leaves)
        if backward:
            torch.autograd.grad(out, leaves, out)

    return run


def packed_step(q, k, v, cu, max_seqlen, backward: bool, kernel: str, window, softcap=0.0, sinks=None):
    """``cpcompile.packed_attention`` on the whole pack: the single-device op CP replaces."""
    kw = {"max_seqlen": max_seqlen, "window_size": window, "softcap": softcap, "kernel": kernel, "sinks": sinks}
    return single_step(lambda *qkv: cpcompile.packed_attention(*qkv, cu, **kw), q, k, v, backward)


def fa4_varlen_step(q, k, v, cu, max_seqlen, backward: bool, window, softcap=0.0, sinks=None):
    """FlashAttention-4's own varlen call on whole documents: the fastest single-GPU kernel, where installed
    (with the variant timed: values' head dim, ``softcap``, ``sinks`` as its ``learnable_sink``)."""
    from flash_attn.cute import flash_attn_varlen_func

    kw = {"max_seqlen_q": max_seqlen, "max_seqlen_k": max_seqlen, "causal": True}
    if softcap:
        kw["softcap"] = softcap
    if sinks is not None:
        kw["learnable_sink"] = sinks
    if window[0] >= 0:
        kw["window_size"] = (window[0], 0)
    return single_step(
        lambda *qkv: flash_attn_varlen_func(*qkv, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)[0], q, k, v, backward
    )


def torch_varlen_step(q, k, v, cu, max_seqlen, backward: bool, window):
    """torch's ``varlen_attn`` (FlashAttention-2) on whole documents."""
    from torch.nn.attention.varlen import varlen_attn

    return single_step(
        lambda *qkv: varlen_attn(*qkv, cu, cu, max_seqlen, max_seqlen, window_size=window, **VARLEN_GQA),
        q, k, v, backward,
    )  # fmt: skip


@contextlib.contextmanager
def forward_even_balance(on: bool):
    """Inside, balanced lays packs out by forward work alone (``balanced_layout(..., backward=False)``).
    Users get no such switch: this compares the default against the layout it replaced."""
    if not on:
        yield
        return
    default = balanced_op.balanced_layout
    balanced_op.balanced_layout = functools.partial(default, backward=False)
    try:
        yield
    finally:
        balanced_op.balanced_layout = default


def measure(
    lengths: list[int],
    hq: int,
    hkv: int,
    cps: list[int],
    backward: bool,
    names: list[str],
    window: int = -1,
    strategies: list[str] | None = None,
    rounds: int = 1,
    capacities: tuple[float, ...] = (),
    forward_even: bool = False,
    dims: tuple[int, int] = (128, 128),
    softcap: float = 0.0,
    sinks: bool = False,
    profile: bool = False,
) -> tuple[list[dict], dict]:
    """Table rows, and per kernel timed ``(predicted cost, measured ms)`` of every rank for the cost model check;
    ``window``: the left side of a sliding window ``(window, 0)`` (-1: causal); ``strategies``: the layouts timed
    (default all); ``rounds``: the single-GPU calls, and each layout's reference and ranks, timed that many times in
    turn, medians kept; ``capacities``: each layout also timed on the pack padded to a capacity bucket of that
    many times its tokens (and 8 more documents), as ``shard_batch`` pads it; ``forward_even``: balanced also
    laid out by its forward work alone (:func:`forward_even_balance`); ``dims``: the query/key and value head
    dims; ``softcap``: logit soft-capping (0: none); ``sinks``: learnable sinks ``[hq]`` in every call;
    ``profile``: each layout's slowest rank's kernel time by kind against one GPU's over ``cp``, printed
    (:func:`kernel_time_by_kind`). Kernels that cannot run the variant are left out."""
    (d, dv), dev = dims, "cuda"
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    max_len = max(lengths)
    g = torch.Generator(device=dev).manual_seed(0)
    pad_room = 2 * max(cps) * len(lengths)  # enough physical rows for any strategy's padding
    pad_room += int(t * (max(capacities, default=1) - 1)) + 2 * max(cps)  # and for the capacities
    q = torch.randn(t + pad_room, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(t + pad_room, hkv, e, device=dev, dtype=torch.bfloat16, generator=g) for e in (d, dv))
    # GPT-OSS keeps its sinks in the model's dtype; FA4's learnable_sink takes float32. A leaf that requires grad:
    # the single-GPU backward computes its gradient, as the ranks' steps do
    sink = torch.randn(hq, device=dev, generator=g).requires_grad_(backward) if sinks else None
    # QK^T takes d, PV dv: the flops of their mean head dim; backward ~ 2.5x forward
    flops = causal_attention_flops(lengths, hq, (d + dv) // 2, window) * (3.5 if backward else 1.0)
    variant = kernels.contract.variant(q, v, softcap)
    names = [n for n in names if variant is None or n in ("fa4", "auto")]  # only FA4 runs a variant
    band = (window, 0)
    model = cpcompile.cost.CostModel(window=window)
    specs = STRATEGIES + ([cpcompile.StrategySpec("balanced", windows=(window,))] if window >= 0 else [])
    specs = [s for s in specs if strategies is None or s.strategy.value in strategies]
    specs = [(s, None, False) for s in specs] + [(s, f, False) for s in specs for f in capacities]
    if forward_even:
        specs += [(s, f, True) for s, f, _ in specs if s.strategy is cpcompile.Strategy.BALANCED]

    # kernels whose timed code is one function (``auto``'s forward is cuDNN's) are timed once, under the first
    # one's name, as timings of one code move with their place in the run (docs/measurement.md)
    measured, codes = [], set()
    for name in names:
        code = name if backward else kernels.select(q, name, v=v, softcap=softcap).forward
        if code not in codes:
            codes.add(code)
            measured.append(name)
    whole = (q[:t], k[:t], v[:t], cu.to(dev), max_len, backward)
    singles = {} if variant is not None or sinks else {"(torch varlen_attn)": torch_varlen_step(*whole, band)}
    if fa4.available():
        singles["(FA4 flash_attn_varlen_func)"] = fa4_varlen_step(*whole, band, softcap, sink)
    for name in measured:
        singles[f"[{name}]"] = packed_step(*whole, name, band, softcap, sink)
    # in turn, ``rounds`` times, as the ranks: one timing each would set the single-GPU rows (FA4's own
    # call against ``packed_attention``'s) apart by the GPU's state when each ran
    single_ms = dict(zip(singles, in_turn(list(singles.values()), rounds)))
    rows = [{"what": f"single GPU {what}", "ms": ms, "tflops": flops / ms / 1e9} for what, ms in single_ms.items()]
    best = singles[min(single_ms, key=single_ms.get)]
    samples = {name: [] for name in measured}
    single_kinds = None  # with ``profile``: one GPU's kernel time by kind, profiled at the first layout
    for cp, (spec, factor, even), name in ((cp, spec, name) for cp in cps for spec in specs for name in measured):
        with forward_even_balance(even):
            layout_cu = cu
            if factor is not None:  # the capacity's padding after the pack, as shard_batch lays it out
                least = int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)[-1])
                m, _ = padding_multiple(spec, cp)
                spec = dataclasses.replace(spec, capacity=(max(least, -(-int(t * factor) // m) * m), len(lengths) + 8))
                layout_cu = _to_documents(cu, spec.capacity)
            kernel = kernels.select(q, name, v=v, softcap=softcap)
            padded = cpcompile.layouts.pad_for_cp(layout_cu, cp_size=cp, strategy=spec)
            n = int(padded[-1])
            plans = [
                cpcompile.plan.make_plan(layout_cu, padded, cp_size=cp, rank=rank, strategy=spec) for rank in range(cp)
            ]
            short = sum(int(((p.cu_q.diff() > 0) & (p.cu_q.diff() < 128) & (p.k_len_causal > 0)).sum()) for p in plans)
            # uploaded with their host twins, as a training step's plans are (step_plan): metadata reads them
            plans = [cpcompile.plan.AttentionPlan(*(upload(x, dev) for x in p)) for p in plans]
            read = rank_reads(plans, cp, band)
            q_local = q[: n // cp]  # values do not matter, sizes and pieces do
            bound = max_piece_len(spec, cp, max_len)  # as cp_attention launches it
            steps = [
                kernel_step(
                    kernel, q_local, k[:n], v[:n], plan, band, max_len, backward, bound, reads, rank, softcap, sink
                )
                for rank, (plan, reads) in enumerate(zip(plans, read or [None] * cp))
            ]
            # the reference among the ranks, in the GPU's power state of their timings
            reference, *per_rank = in_turn([best, *steps], rounds)
            predicted = cpcompile.cost.predict_rank_costs(
                layout_cu, cp_size=cp, strategy=spec, cu_seqlens_padded=padded, model=model
            )
            # the forward is modelled by kernel tiles; forward+backward by the step cost without its
            # token term (projections and MLP, which this benchmark does not time): tiles and key copies
            attention = predicted.cost - cpcompile.cost.CostModel().token_cost * predicted.tokens
            samples[name] += zip((attention if backward else predicted.tiles).tolist(), per_rank)
            slowest = max(per_rank)
            if profile:
                if single_kinds is None:  # one GPU's call is the same for every layout: profiled once
                    single_kinds = kernel_time_by_kind(best)
                one = {k: ms / cp for k, ms in single_kinds.items()}
                rank = per_rank.index(slowest)
                mine = kernel_time_by_kind(steps[rank])
                print(f"kernel ms by kind, cp={cp} {spec.strategy.value} [{name}], rank {rank}: "
                      + ", ".join(f"{k} {ms:.3f} (one GPU / cp {one.get(k, 0.0):.3f})" for k, ms in mine.items()),
                      file=sys.stderr, flush=True)  # fmt: skip
            rows.append(
                {
                    "what": f"cp={cp} {spec.strategy.value}"
                    + (f" /{spec.stripe_size}" if spec.stripe_size > 1 else "")
                    + (f" windows={spec.windows}" if spec.windows else "")
                    + (" forward-even" if even else "")
                    + (f" capacity {factor}x" if factor is not None else "")
                    + f" [{name}]",
                    "cp": cp,
                    "ms": slowest,
                    "tflops": flops / cp / slowest / 1e9,
                    "efficiency": reference / (cp * slowest),
                    "imbalance": slowest / statistics.mean(per_rank),
                    "short_pieces": short / cp,
                    "padding": n - t,
                    "exchange": float(read is not None),
                }
            )
    return rows, samples


def correlation(samples: list) -> float:
    """Pearson's r of predicted against measured."""
    x, y = (torch.tensor(v, dtype=torch.float64) for v in zip(*samples))
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


TABLE_HEADER = [
    "| layout | ms (slowest rank) | TFLOP/s per GPU | efficiency | max/mean | short pieces/rank | padding | K/V |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
]


def table(title: str, rows: list[dict], fits: dict[str, float], ranks: int, backward: bool) -> list[str]:
    """One head layout and pass: the rows (medians over packs), the cost model's fit, the best layout per cp."""
    lines = [f"### {title}", "", *TABLE_HEADER]
    for row in rows:
        cells = (
            [f"{row['ms']:.2f}", f"{row['tflops']:.0f}"]
            + [f"{row[key]:.3f}" if key in row else "" for key in ("efficiency", "imbalance")]
            + [
                f"{row['short_pieces']:.1f}" if "short_pieces" in row else "",
                f"{row['padding']:.0f}" if "padding" in row else "",
                {1.0: "exchange", 0.0: "all-gather", None: ""}.get(row.get("exchange"), "mixed"),
            ]
        )
        lines.append(f"| {row['what']} | " + " | ".join(cells) + " |")
    model = "step cost without its token term" if backward else "kernel tiles"
    best = {}
    for row in (r for r in rows if "cp" in r):
        if row["efficiency"] > best.get(row["cp"], {"efficiency": -1.0})["efficiency"]:
            best[row["cp"]] = row
    return [
        *lines,
        "",
        f"Cost model (`predict_rank_costs`, {model}) against per-rank times, Pearson's r over {ranks} ranks: "
        + ", ".join(f"{name} {r:.3f}" for name, r in fits.items())
        + ".",
        "Highest efficiency: " + ", ".join(f"{r['what']} {r['efficiency']:.3f}" for r in best.values()) + ".",
        "",
    ]


def intro(tokens: int, source: str, packs: int, rounds: int) -> list[str]:
    """What the tables hold, below the section's header."""
    repeat = f", in {rounds} rounds" if rounds > 1 else ""
    return [
        f"{tokens} tokens per pack from `{source}`; medians over {packs} packs of medians of 5 timed runs{repeat}; "
        "communication not timed. Efficiency = best single-GPU time / (cp x slowest rank); max/mean = slowest rank "
        "over the mean; short = pieces per rank under 128 query rows; K/V = the keys a rank's kernel runs on "
        "(all-gathered or exchanged). Definitions: the script's docstring; analyses: "
        "[docs/attention-kernels.md](docs/attention-kernels.md), [docs/measurement.md](docs/measurement.md).",
        "",
    ]


def pair(text: str) -> tuple[int, int]:
    """``"A/B"`` as ``(A, B)``, two positive ints (``--heads``, ``--head-dims``)."""
    try:
        a, b = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two ints as A/B, got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"expected two positive ints as A/B, got {text!r}")
    return a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doclens", type=Path, required=True, help="JSON list of document lengths")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--packs", type=int, default=3, help="packs sampled; medians are reported")
    default_kernels = ["flash"] + (["cudnn"] if cudnn.available() else []) + (["fa4"] if fa4.available() else [])
    default_kernels += ["auto"] if cudnn.available() else []
    parser.add_argument("--kernels", nargs="+", default=default_kernels, choices=["flash", "cudnn", "fa4", "auto"])
    parser.add_argument("--window", type=int, default=-1, help="a sliding window (W, 0) throughout; -1: causal")
    parser.add_argument("--strategies", nargs="+", choices=[s.strategy.value for s in STRATEGIES], help="the layouts "
                        "timed (default: all; balanced includes balanced told the window)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="the single-GPU calls, and each layout's reference and "
                        "ranks, timed this many times in turn, medians kept (the spread between runs: "
                        "docs/measurement.md)")  # fmt: skip
    parser.add_argument("--capacity", type=float, nargs="+", default=[], help="each layout also on the pack padded "
                        "to capacity buckets of these multiples of its tokens")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print each layout's slowest rank's GPU time by kind "
                        "of kernel (forward, backward and its pre- and postprocessing, the send pass, zero fills) "
                        "against one GPU's over cp, from torch.profiler (stderr, not in the section)")  # fmt: skip
    parser.add_argument("--forward-even", action="store_true", help="balanced also laid out by its forward work "
                        "alone (steps 0-4, docs/balanced-layout.md) beside the default")  # fmt: skip
    parser.add_argument("--heads", type=pair, nargs="+", default=[(32, 8), (16, 16)], metavar="HQ/HKV",
                        help="query/key-value head counts, one table each (default: 32/8 16/16)")  # fmt: skip
    parser.add_argument("--head-dims", type=pair, default=(128, 128), metavar="D/DV", help="query/key and value "
                        "head dims (DeepSeek-V3's multi-head latent attention: 192/128)")  # fmt: skip
    parser.add_argument("--softcap", type=float, default=0.0, help="logit soft-capping c (Gemma 2: 50); 0: none")
    parser.add_argument("--sinks", action="store_true", help="learnable sinks (GPT-OSS) in every call; the "
                        "single-GPU reference is FA4's own call with learnable_sink=")  # fmt: skip
    add_output_argument(parser)
    args = parser.parse_args()
    for hq, hkv in args.heads:
        if hq % hkv:
            parser.error(f"--heads {hq}/{hkv}: the query heads must be a multiple of the key-value heads")
    if args.softcap < 0:
        parser.error(f"--softcap must be 0 (none) or positive, got {args.softcap}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it times the attention kernels")
    lengths_pool = json.loads(args.doclens.read_text())
    # One section whatever the options (its command names them): a run replaces the script's last one.
    lines = [*header(HEADING), *intro(args.tokens, args.doclens.name, args.packs, args.rounds)]
    for backward in (False, True):
        for hq, hkv in args.heads:
            per_pack, samples = [], {}
            for p in range(args.packs):
                lengths = sample_lengths(args.tokens, torch.Generator().manual_seed(p), lengths_pool)
                rows, pack_samples = measure(
                    lengths,
                    hq,
                    hkv,
                    args.cp,
                    backward,
                    args.kernels,
                    args.window,
                    args.strategies,
                    args.rounds,
                    tuple(args.capacity),
                    args.forward_even,
                    args.head_dims,
                    args.softcap,
                    args.sinks,
                    args.profile,
                )
                per_pack.append(rows)
                for name, pairs in pack_samples.items():
                    samples[name] = samples.get(name, []) + pairs
            medians = [
                {key: row[key] if key == "what" else statistics.median(pp[i][key] for pp in per_pack) for key in row}
                for i, row in enumerate(per_pack[0])
            ]
            fits = {name: correlation(pairs) for name, pairs in samples.items()}
            title = f"{'forward+backward' if backward else 'forward'}, heads {hq}/{hkv}"
            if args.head_dims != (128, 128):
                title += ", head dims {}/{}".format(*args.head_dims)
            title += f", softcap {args.softcap:g}" if args.softcap else ""
            title += ", sinks" if args.sinks else ""
            done = table(title, medians, fits, len(next(iter(samples.values()))), backward)
            lines += done
            print("\n".join(done), file=sys.stderr, flush=True)  # progress
    publish(HEADING, lines, args.output)


if __name__ == "__main__":
    main()

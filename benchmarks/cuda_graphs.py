"""CUDA graphs: one CP rank's training step captured once per capacity bucket, replayed for every pack.

For each size of ``--tokens-per-rank``: ``--packs`` packs of ``cp x size`` tokens, less up to a
sixteenth so their lengths vary too, documents drawn from ``--doclens``; all padded to the bucket
that holds them (``cpcompile.layouts.capacity_for``). A ``LlamaForCausalLM`` of ``--layers`` layers (Llama-8B's
shapes unless ``--hidden`` and the rest say otherwise; bf16, random weights,
``attn_implementation="cpcompile"``) runs rank ``--rank``'s share on the fake process group (its
collectives cost nothing: **no communication in these times**; the K/V all-gather path, as the sparse
exchange's sizes would need real ranks). The decoder is compiled with ``dynamic=False`` (``--modes``):
``plain``, without CUDA graphs; ``trees``, with ``mode="reduce-overhead"``, where inductor captures the
forward and the backward each as one CUDA graph, attention included where FA4 runs it
(``cpcompile.attention.captured``; else the attention ops stay outside, between captured parts:
docs/cuda-graphs.md); ``step``, with
``cpcompile.backend(..., captured_step=True)`` inside ``cpcompile.CapturedStep``, which captures the
whole step (forward, loss, backward) as one CUDA graph (on CUDA, with FA4 installed: its attention
must be the captured op).

    python benchmarks/cuda_graphs.py [--layers 8] [--tokens-per-rank 4096,16384,65536] [--packs 50]
                                     [--cp 8] [--rank 0] [--doclens FILE] [--modes plain,trees,step]
                                     [--output BENCHMARKS.md]
                                     [--hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --vocab 32000]
    python benchmarks/cuda_graphs.py --cpu-smoke     # a tiny float32 model on CPU (no graphs there), to check it

A step is the decoder's forward, the loss from the hidden states (``cpcompile.testing.losses``, not
compiled) and the backward; no optimizer step and no gradient reduction (the same with and without
graphs, outside the compiled code). Reported per size:

- compiled graphs: Dynamo's, per compilation (one serves every pack of the bucket);
- step ms: median of ``--steps`` steps run back to back, after one step on every pack, on fresh copies
  of the packs (none of their plans cached, as for a new pack in training; CUDA
  events, each step timed from the end of the one before);
- captures: CUDA graphs recorded (cudagraph trees' recordings, one per captured part of the forward
  and of the backward, so 2 where both are captured whole; ``CapturedStep``'s, one per bucket), in all
  and after the second pack (cudagraph trees run the first call of each part without a graph and
  record on the second: any recording after that is a re-capture; ``CapturedStep`` records one graph per
  count of layers of pieces its packs' attention backward needs, so a later pack may add a second);
- loss, grad: the largest relative difference over the packs between a compilation with graphs and the
  one without, of the loss and of each parameter's gradient norm; noise: the same between two passes
  of the model without graphs over the same packs (the attention backward's atomics make bf16
  gradients differ between runs);
- no host sync: whether a step on a fresh copy of a pack passes ``torch.cuda.set_sync_debug_mode("error")``
  in every compilation;
- GPU busy: the union of GPU activity over one profiled step's wall time (``benchmarks/e2e.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import filled_collectives, profile_step  # noqa: E402
from report import add_output_argument, header, publish  # noqa: E402

import cpcompile  # noqa: E402
import cpcompile.integrations.hf as cphf  # noqa: E402
from cpcompile.advisor.advise import BUILTIN_MIX, cut_pack, length_sampler, positive_int  # noqa: E402
from cpcompile.kernels import fa4  # noqa: E402
from cpcompile.testing import hf_llama, losses, synthetic_pack  # noqa: E402

try:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
except ImportError:  # where the fake backend is built in
    FakeStore = dist.HashStore

HEADING = "## CUDA graphs (benchmarks/cuda_graphs.py)"
SMOKE = dict(layers=1, tokens_per_rank=[64], packs=[3], steps=2, cp=2)
SMOKE_SHAPE = hf_llama.LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128)
SMOKE_MIX = dataclasses.replace(BUILTIN_MIX, median=16, long_min=32, long_max=96)


def int_list(text: str) -> list[int]:
    return [positive_int(word) for word in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=8)
    for name, default in dataclasses.asdict(hf_llama.LLAMA_8B_LAYERS).items():  # a layer's shape: Llama-8B's
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=default)
    p.add_argument("--tokens-per-rank", type=int_list, default=[4096, 16384, 65536])
    p.add_argument("--packs", type=int_list, default=[50], help="packs per size (one number: every size)")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps (their median is reported)")
    p.add_argument("--cp", type=positive_int, default=8)
    p.add_argument("--rank", type=int, default=0)
    modes = "of plain,trees,step (plain runs always; step needs CUDA and FA4)"
    p.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES), help=modes)
    p.add_argument("--strategy", default="balanced", choices=["balanced", "dual_chunk_swap", "no_load_balance"])
    p.add_argument("--doclens", type=Path, metavar="FILE", help="document lengths (default: the built-in mix)")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny float32 model on CPU, to check this script")
    add_output_argument(p)
    args = p.parse_args()
    if args.cpu_smoke:
        smoke = SMOKE | dataclasses.asdict(SMOKE_SHAPE)
        vars(args).update({k: v for k, v in smoke.items() if getattr(args, k) == p.get_default(k)})
    elif not torch.cuda.is_available():
        p.error("needs CUDA (or --cpu-smoke)")
    if not set(args.modes) <= set(MODES):
        p.error(f"--modes: a comma-separated selection of {','.join(MODES)}, got {args.modes}")
    if len(args.packs) == 1:
        args.packs = args.packs * len(args.tokens_per_rank)
    if len(args.packs) != len(args.tokens_per_rank) or not 0 <= args.rank < args.cp or args.cp < 2:
        p.error("--packs: one number or one per size of --tokens-per-rank; --cp at least 2; 0 <= --rank < --cp")
    return args


def layer_shape(args) -> hf_llama.LlamaShape:
    return hf_llama.LlamaShape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(hf_llama.LlamaShape)})


class Captures:
    """Counts cudagraph trees' recordings (``CUDAGraphTreeManager.record_function``) while entered."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.CUDAGraphTreeManager
        self.original = manager.record_function
        captures = self

        def record_function(tree, new_inputs, function_id):
            captures.count += 1
            return captures.original(tree, new_inputs, function_id)

        manager.record_function = record_function
        return self

    def __exit__(self, *exc):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.CUDAGraphTreeManager.record_function = self.original


def make_packs(args, size: int, count: int, seed: int) -> list[torch.Tensor]:
    """``cu_seqlens`` of ``count`` packs of ``cp x size`` tokens less up to a sixteenth."""
    g = torch.Generator().manual_seed(seed)
    draw = (
        length_sampler(args.doclens, g) if args.doclens else (SMOKE_MIX if args.cpu_smoke else BUILTIN_MIX).sampler(g)
    )
    total = args.cp * size
    return [cut_pack(draw, total - int(torch.randint(0, total // 16, (1,), generator=g))) for _ in range(count)]


def run_size(args, size: int, count: int, device: torch.device) -> dict:
    """Both compilations on one size's packs (module docstring)."""
    cuda = device.type == "cuda"
    packs = make_packs(args, size, count, seed=size)
    base = cpcompile.StrategySpec(args.strategy)
    capacity = cpcompile.layouts.capacity_for(packs, cp_size=args.cp, strategy=base)
    # the fake group cannot run the exchange's data-dependent sizes: the all-gather
    spec = dataclasses.replace(base, capacity=capacity, kv="all_gather")
    longest = max(int(cu.diff().max()) for cu in packs)  # the bucket's max_length: fixed, as dynamic=False needs
    shape = layer_shape(args)
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    model = hf_llama.random_llama(shape, args.layers, max_tokens=spec.capacity.tokens, device=device, dtype=dtype)
    losses.fuse_loss(model.lm_head)
    params = list(model.parameters())

    def inputs(seed: int, cu: torch.Tensor):
        pack = synthetic_pack(cu.diff().tolist(), shape.vocab, torch.Generator().manual_seed(seed))
        batch = {"input_ids": pack["input_ids"][None], "position_ids": pack["position_ids"][None], "cu_seq_lens_q": cu}
        batch["labels"] = batch["input_ids"]
        got, sharded = cphf.shard_flattened_batch(
            batch, cp_size=args.cp, rank=args.rank, strategy=spec, device=device, max_length=longest
        )
        return got, sharded.spec

    data = [inputs(i, cu) for i, cu in enumerate(packs)]
    row = {"size": size, "packs": count, "docs": [cu.shape[0] - 1 for cu in packs], "capacity": spec.capacity}
    runs, noise = {}, None
    modes = [m for m in MODES if m in args.modes or m == "plain"]
    for mode in modes if cuda and fa4.available() else [m for m in modes if m != "step"]:  # plain first: reference
        torch._dynamo.reset()
        if cuda:  # what the run before cached, free for the graphs' own memory pool
            torch.cuda.empty_cache()
        decoder = torch.compile(
            model.model,
            backend=cpcompile.backend(inner="inductor", captured_step=mode == "step"),
            dynamic=False,
            **({"mode": "reduce-overhead"} if mode == "trees" else {}),
        )

        def forward_backward(pack_inputs, decoder=decoder):
            loss = hf_llama.causal_lm_loss(decoder, model, pack_inputs)
            loss.backward()
            return loss

        whole = cpcompile.CapturedStep(forward_backward, module=model) if mode == "step" else None

        def step(batch, mode=mode, whole=whole):
            if mode == "trees":
                torch.compiler.cudagraph_mark_step_begin()  # the step before is done with its outputs
            pack_inputs, pack_spec = batch
            with cpcompile.strategy(pack_spec):
                return whole(pack_inputs) if whole is not None else forward_backward(pack_inputs)

        def clear():
            # a replay's gradients are its outputs: never accumulated into (a CapturedStep sets them
            # to None before its own calls and puts its graph's back after each replay)
            model.zero_grad(set_to_none=True)

        def first_pass(captures, whole=whole):
            """Each pack's loss and gradient norms, and the captures made so far after each pack."""
            results, counts = [], []
            for batch in data:
                loss = step(batch).item()
                results.append((loss, [float(p.grad.float().norm()) for p in params]))
                clear()
                counts.append(captures.count + (whole.captures if whole is not None else 0))
            return results, counts

        counters["stats"].clear()
        with Captures() as captures, filled_collectives():
            runs[mode], counts = first_pass(captures)  # cudagraph trees warm up on pack 0, record on pack 1
            if mode == "plain":  # the noise floor: the same model over the same packs once more
                noise = _differences(runs["plain"], first_pass(captures)[0])
            # fresh copies of the packs: the per-plan caches hold none of them, as in training
            fresh = [inputs(i, packs[i % count]) for i in range(args.steps)]
            times = _step_times(step, clear, fresh, args.steps, cuda)
            syncs_ok = _passes_sync_check(step, clear, inputs(count, packs[0])) if cuda else None
            busy = profile_step(lambda b: (step(b), clear()), data[1 % count], cuda)["busy"]
        total = captures.count + (whole.captures if whole is not None else 0)
        row[mode] = {
            "ms": statistics.median(times),
            "captures": total,
            "after_second": total - counts[min(1, count - 1)],
            "syncs_ok": syncs_ok,
            "busy": busy,
            "graphs": counters["stats"]["unique_graphs"],  # Dynamo's: one for every pack of the bucket
        }
        if mode != "plain":
            row[mode]["loss"], row[mode]["grad"] = _differences(runs["plain"], runs[mode])
    row["noise_loss"], row["noise_grad"] = noise
    return row


def _differences(a: list, b: list) -> tuple[float, float]:
    """Largest relative differences of the losses and of the gradient norms, pack by pack."""
    loss = max(abs(x[0] - y[0]) / abs(x[0]) for x, y in zip(a, b))
    grad = max(abs(p - q) / max(p, 1e-30) for x, y in zip(a, b) for p, q in zip(x[1], y[1]))
    return loss, grad


def _step_times(step, clear, data: list, n: int, cuda: bool) -> list[float]:
    """Milliseconds of ``n`` steps back to back over the packs, each from the end of the one before."""

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    marks = [mark()]
    for i in range(n):
        step(data[i % len(data)])
        clear()
        marks.append(mark())
    if not cuda:
        return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


def _passes_sync_check(step, clear, batch) -> bool:
    """Whether a step runs under ``set_sync_debug_mode("error")`` (a host sync raises)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(batch)
        clear()
        return True
    except RuntimeError as e:
        print(f"  host sync: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


#: Without graphs; ``mode="reduce-overhead"`` (cudagraph trees); the whole step in one CapturedStep.
MODES = ("plain", "trees", "step")

COLUMNS = (
    "tokens/rank|packs|documents|compiled graphs|step ms|reduce-overhead|CapturedStep|speedup|captures (after 2nd pack)"
    "|loss diff|grad diff|noise (loss, grad)|no host sync|GPU busy"
).split("|")


def row_cells(row: dict) -> str:
    modes = [m for m in MODES if m in row]
    plain, graphs = row["plain"], [row[m] for m in modes[1:]]

    def each(key, fmt):
        return " / ".join(format(g[key], fmt) for g in graphs)

    syncs = [row[m]["syncs_ok"] for m in modes]
    cells = [
        f"{row['size']:,}",
        row["packs"],
        f"{min(row['docs'])}-{max(row['docs'])}",
        " / ".join(str(row[m]["graphs"]) for m in modes),
        f"{plain['ms']:.1f}",
        f"{row['trees']['ms']:.1f}" if "trees" in row else "-",
        f"{row['step']['ms']:.1f}" if "step" in row else "-",
        " / ".join(f"{plain['ms'] / g['ms']:.2f}" for g in graphs),
        " / ".join(f"{g['captures']} ({g['after_second']})" for g in graphs),
        each("loss", ".1e"),
        each("grad", ".1e"),
        f"{row['noise_loss']:.0e}, {row['noise_grad']:.1e}",
        "-" if None in syncs else "yes" if all(syncs) else "no",
        "-" if plain["busy"] is None else " / ".join(f"{row[m]['busy']:.2f}" for m in modes),
    ]
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if args.cpu_smoke:
        torch.set_flush_denormal(True)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.cp)
    rows = []
    try:
        for size, count in zip(args.tokens_per_rank, args.packs):
            print(f"{size} tokens per rank, {count} packs ...", file=sys.stderr, flush=True)
            rows.append(run_size(args, size, count, device))
            print(f"  {row_cells(rows[-1])}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    source = f"`{args.doclens.name}`" if args.doclens else "the built-in mix of `cpcompile.advisor.advise`"
    shape = layer_shape(args)
    lines = [
        *header(HEADING),
        f"`LlamaForCausalLM`, {args.layers} layers of hidden {shape.hidden}, MLP {shape.intermediate}, heads "
        f"{shape.heads}/{shape.kv_heads}, {'float32 on CPU' if args.cpu_smoke else 'bf16'}; cp={args.cp}, rank "
        f"{args.rank} on the fake process group (**no communication in these times**; K/V all-gathered), "
        f"`{args.strategy}` with each size's packs padded to one capacity bucket; packs from {source}. Step: "
        "forward, loss, backward (no optimizer). `step ms`: compiled with `dynamic=False`; `reduce-overhead`: the "
        'same with `mode="reduce-overhead"` (a CUDA graph for the forward and one for the backward); `CapturedStep`: '
        "the whole step captured as one CUDA graph by `cpcompile.CapturedStep`; pairs of numbers are theirs in that "
        f"order, triples add the step without graphs first; median of {args.steps} steps. Definitions: the "
        "script's docstring.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
        *(row_cells(r) for r in rows),
    ]
    publish(HEADING, lines, args.output)


if __name__ == "__main__":
    main()

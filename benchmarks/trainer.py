"""The trainer integration's cost: one model and its packs trained by the hand-written loop and by ``CPTrainer``.

In one process on one GPU, the same ``LlamaForCausalLM`` (8B layer shapes by default, random weights, bf16,
``attn_implementation="cpcompile"``, each decoder layer compiled with inductor, ``dynamic=True``) trains on the
same packs two ways, one after the other, each from a fresh model:

1. **loop**: ``benchmarks/e2e.py``'s step (its ``measure``, with the model's own loss, ``--loss hf``): the
   batches sharded beforehand, then forward, backward, a fused AdamW step;
2. **trainer**: ``cpcompile.integrations.trainer.CPTrainer.train()`` over a map-style dataset of the same
   flattened packs in the same order (each yielded once, one pack per step), with the same AdamW (passed in
   ``optimizers``, constant learning rate), gradient clipping off (``max_grad_norm=0``: the loop does not clip),
   the model's weights in bf16 without autocast (``bf16=False``: the loop has none), its nan/inf loss filter
   off (``logging_nan_inf_filter=False``: the filter reads each step's loss on the host, a sync after which
   the GPU idles while the host prepares the next step; docs/trainers.md), the Trainer's other defaults
   included (in recent transformers, the gradient norm it logs, computed every step even without
   clipping: one read of every gradient, the GPU work the trainer does beyond the loop's). The Trainer
   shards each step's pack itself (``CPTrainerMixin.training_step``), inside its step: with no host sync
   in the step, the host does it while the GPU still runs the step before, as the loop's sharding
   beforehand is off the GPU's path.

Both run at cp=1: a world of one process, no process group (``CPConfig(cp_size=1)``: the CP trainer's data,
loss and compilation path with nothing to communicate). The fake process group that ``e2e.py`` uses to time
one rank of a larger group is not used here: the Trainer's accelerate sees one process, so its loader is not
sharded and no DDP wraps the model; a trainer "rank 0 of cp=8" on it would not be the run that real ranks do.

    python benchmarks/trainer.py [--layers 8] [--tokens 16384] [--packs 4] [--steps 10] [--output BENCHMARKS.md]
    python benchmarks/trainer.py --cpu-smoke     # a tiny float32 model on CPU, to check the script

Reported per side: step ms (median of ``--steps`` steps back to back, each from the end of the step before:
the loop's by ``e2e.step_times``, the trainer's by a ``TrainerCallback`` recording a CUDA event at each
``on_step_end``, which follows the optimizer step and ``zero_grad``), tokens/s per GPU, MFU (``e2e.py``'s
definition: 6 x matmul params x tokens + causal attention, over 989 TFLOP/s), graphs compiled, peak memory,
host syncs per step (where the host waits for the GPU, which then idles until the host's next launch: the
loop's counted in the profile of one step as ``e2e.py`` counts them; the trainer's, the operations that
``torch.cuda.set_sync_debug_mode("warn")`` flags over the timed steps, divided by their number; 0 is what
keeps the host's per-step work, the Trainer's and the sharding, off the GPU's time); and trainer / loop,
the ratio of their tokens/s. Warm-up: the loop runs one step per pack, ``--warmup`` steps
and one untimed step; the trainer at least as many untimed steps, a whole number of passes over the packs,
so both time the packs in the same order from the first.

The trainer needs transformers and accelerate (the ``trainers`` extra): without them the loop still runs, the
section says why the trainer did not, nothing is written to ``--output``, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import re
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402
from report import add_output_argument, header, publish  # noqa: E402

import cpcompile  # noqa: E402
from cpcompile.advisor.advise import length_sampler, positive_int, spec_name  # noqa: E402
from cpcompile.testing import hf_llama  # noqa: E402

HEADING = "## Trainer integration (benchmarks/trainer.py)"
#: What ``torch.cuda.set_sync_debug_mode("warn")`` says at each operation that makes the host wait for the GPU.
SYNC_WARNING = "called a synchronizing CUDA operation"
SMOKE = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, tokens=256, packs=2, steps=2,
             warmup=0)  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = dict(layers=8, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, tokens=16384, packs=4)
    for name, default in sizes.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=default)
    p.add_argument("--doclens", type=Path, metavar="FILE", help="document lengths (default: the built-in mix)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (their median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, after one step on every pack")
    p.add_argument("--whole", action="store_true", help="compile the whole model (CPConfig(regional=False)), not "
                   "each decoder layer")  # fmt: skip
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny float32 model on CPU through aot_eager: "
                   + ", ".join(f"{k} {v}" for k, v in SMOKE.items()))  # fmt: skip
    add_output_argument(p)
    args = p.parse_args()
    if args.cpu_smoke:
        vars(args).update({k: v for k, v in SMOKE.items() if getattr(args, k) == p.get_default(k)})
    elif not torch.cuda.is_available():
        p.error("needs CUDA (or --cpu-smoke, a tiny configuration on CPU)")
    # What e2e.py's functions read: its step with the model's loss and AdamW at cp=1, nothing else.
    vars(args).update(inner="aot_eager" if args.cpu_smoke else "inductor", regional=not args.whole, loss="hf",
                      optimizer="adamw", fsdp=False, checkpointing=False, real=False,
                      spec=cpcompile.StrategySpec(cpcompile.Strategy.BALANCED))  # fmt: skip
    try:
        args.draw = length_sampler(args.doclens, torch.Generator().manual_seed(0)) if args.doclens else None
    except ValueError as e:
        p.error(str(e))
    return args


def release(device: torch.device) -> None:
    """Free what one side held before the other builds its model."""
    torch._dynamo.reset()
    cpcompile.attention.release_grad_buffers()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_trainer(args, packs: list[torch.Tensor], device: torch.device) -> dict:
    """``CPTrainer.train()`` over the packs (module docstring); its timed steps' milliseconds and the rest."""
    from torch._dynamo.utils import counters
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback, TrainingArguments

    from cpcompile.integrations.trainer import CPConfig, CPTrainer

    cuda = device.type == "cuda"
    untimed = len(packs) * math.ceil((len(packs) + args.warmup + 1) / len(packs))  # whole passes over the packs

    class StepEnds(TrainerCallback):
        """A mark at the end of every optimizer step; peak memory and host syncs counted from the last untimed
        one to the last step's (before the Trainer logs it: its loss is read on the host once per logging)."""

        def __init__(self):
            self.marks = []

        def on_step_end(self, training_args, state, control, **kwargs):
            self.marks.append(e2e.mark(cuda))
            if cuda and len(self.marks) == untimed:
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.set_sync_debug_mode("warn")
            if cuda and len(self.marks) == total:
                torch.cuda.set_sync_debug_mode(0)

    class InOrder(CPTrainer):
        """The packs in the dataset's order, as the loop takes them (the Trainer's default sampler shuffles)."""

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    torch._dynamo.reset()
    counters.clear()
    model = e2e.build_model(args, device, torch.float32 if args.cpu_smoke else torch.bfloat16)
    params = hf_llama.matmul_params(model)
    optimizer = e2e.make_optimizer("adamw", model, 1, cuda)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    batches = [e2e.flattened_batch(cu, seed, args.vocab) for seed, cu in enumerate(packs)]
    total = untimed + args.steps
    dataset = [batches[i % len(batches)] for i in range(total)]  # one epoch: no epoch boundary inside the timing
    ends = StepEnds()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, max_steps=total, learning_rate=1e-5,
            lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=total, save_strategy="no",
            report_to="none", use_cpu=not cuda, bf16=False, disable_tqdm=True, remove_unused_columns=False,
            dataloader_num_workers=0, logging_nan_inf_filter=False,
        )  # fmt: skip
        trainer = InOrder(
            model=model,
            args=training,
            train_dataset=dataset,
            data_collator=lambda items: items[0],  # each item is a whole flattened pack
            optimizers=(optimizer, scheduler),
            callbacks=[ends],
            cp=CPConfig(cp_size=1, strategy=args.spec, inner=args.inner, regional=args.regional),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=SYNC_WARNING)
            trainer.train()
    syncs = [w for w in caught if re.match(SYNC_WARNING, str(w.message))]
    for site, n in collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs).most_common():
        print(f"  host sync in the timed steps: {n} x {site}", file=sys.stderr, flush=True)
    for w in caught:  # the others, as they would have been shown
        if w not in syncs:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if cuda:
        torch.cuda.synchronize()
    marks = ends.marks[untimed - 1 :]
    if cuda:
        times = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        times = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    flops = statistics.mean(e2e.pack_flops(cu, params, args) for cu in packs)
    graphs = counters["stats"]["unique_graphs"]
    return dict(side="trainer", ms=statistics.median(times), flops=flops, params=params, graphs=graphs, peak=peak,
                untimed=untimed, syncs=len(syncs) / args.steps if cuda else None)  # fmt: skip


def row_cells(row: dict, tokens: int, loop: dict | None) -> str:
    if row.get("missing"):
        return f"| {row['side']} | not run: {row['missing']} |" + " |" * 6
    s = row["ms"] / 1e3
    ratio = "1" if row is loop else f"{loop['ms'] / row['ms']:.3f}" if loop else "-"
    peak = "-" if row["peak"] is None else f"{row['peak']:.1f}"
    syncs = "-" if row.get("syncs") is None else f"{row['syncs']:g}"
    cells = [row["side"], f"{row['ms']:.1f}", f"{tokens / s:,.0f}", f"{row['flops'] / s / e2e.PEAK_FLOPS:.3f}",
             ratio, row["graphs"], peak, syncs]  # fmt: skip
    return "| " + " | ".join(map(str, cells)) + " |"


def intro(args, rows: list[dict], packs: list[torch.Tensor]) -> list[str]:
    done = [r for r in rows if not r.get("missing")]
    docs = statistics.mean(cu.shape[0] - 1 for cu in packs)
    source = f"`{args.doclens.name}`" if args.doclens else "the built-in mix of `cpcompile.advisor.advise`"
    params = f"{done[0]['params'] / 1e9:.2f}B matmul parameters, " if done else ""
    untimed = next((r["untimed"] for r in rows if "untimed" in r), None)
    return [
        f"`LlamaForCausalLM`: {args.layers} layers of hidden {args.hidden}, MLP {args.intermediate}, heads "
        f"{args.heads}/{args.kv_heads} x {args.hidden // args.heads}, vocab {args.vocab} ({params}random "
        f"{'float32, CPU' if args.cpu_smoke else 'bf16'} weights, {args.inner}"
        f"{', each decoder layer compiled on its own' if args.regional else ', compiled whole'}), "
        f'`attn_implementation="cpcompile"`, the model\'s own loss. {args.packs} packs x {args.tokens} tokens from '
        f"{source} ({docs:.0f} documents on average), `{spec_name(args.spec)}`, cp=1 (one process, no process "
        "group). Step: forward, backward, AdamW"
        f"{'' if args.cpu_smoke else ' (fused)'}; median of {args.steps} steps after "
        f"{untimed if untimed else 'the'} untimed ones. loop: `benchmarks/e2e.py`'s step; trainer: "
        "`CPTrainer.train()` (no clipping, autocast or nan/inf filter). Definitions: the script's docstring.",
        "",
    ]


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if not args.cpu_smoke else torch.device("cpu")
    if args.cpu_smoke:
        torch.set_num_threads(1)
    packs = e2e.make_packs(args)
    print("loop ...", file=sys.stderr, flush=True)
    loop = {"side": "loop", **e2e.measure(args, 1, 0, packs, device)}
    release(device)
    print(f"  {row_cells(loop, args.tokens, loop)}", file=sys.stderr, flush=True)
    print("trainer ...", file=sys.stderr, flush=True)
    try:
        import accelerate  # noqa: F401  (the Trainer's own dependency: say so before building anything)
        import transformers  # noqa: F401
    except ImportError as e:
        trainer = {"side": "trainer", "missing": f'{e.name} is not installed (pip install "cpcompile[trainers]")'}
    else:
        trainer = measure_trainer(args, packs, device)
        release(device)
    rows = [loop, trainer]
    columns = "run|step ms|tokens/s per GPU|MFU|tokens/s vs loop|graphs|peak GiB|host syncs per step".split("|")
    table = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    table += [row_cells(r, args.tokens, loop) for r in rows]
    lines = [*header(HEADING), *intro(args, rows, packs), *table]
    if not trainer.get("missing"):
        cost = 1 - loop["ms"] / trainer["ms"]
        lines += ["", f"The integration's cost: trainer / loop tokens/s = {loop['ms'] / trainer['ms']:.3f} "
                  f"({100 * cost:+.1f} % of the trainer's step).".replace("+-", "-")]  # fmt: skip
    publish(HEADING, lines, None if trainer.get("missing") else args.output)
    if trainer.get("missing"):
        sys.exit(f"trainer not run: {trainer['missing']}")


if __name__ == "__main__":
    main()

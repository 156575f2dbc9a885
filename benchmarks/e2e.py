"""End to end: a Hugging Face Llama training step through the compiler, at cp=1 and per CP rank.

``LlamaForCausalLM`` (8B layer shapes by default, random weights, bf16) with
``attn_implementation="cpcompile"`` takes packed (flattened) batches as
``cpcompile.integrations.hf.shard_flattened_batch`` makes them. At cp=1 it runs under
plain ``torch.compile(dynamic=True)`` (inductor, no CP pass; attention is
``cpcompile.packed_attention``, whose CUDA kernel is the default (``StrategySpec.kernel`` None): cuDNN's
via ``auto`` with the ``gpu`` extra, else FlashAttention-4 where installed, else torch's flash).
At cp=N it runs under ``torch.compile(backend=cpcompile.backend())``: on one GPU every rank in
turn on the fake process group, whose collectives cost nothing (their outputs filled once with
the bytes NCCL would write: ``filled_collectives``; per-rank times exclude all communication; the
sparse K/V exchange, which sends data-dependent sizes, is turned off), or under ``torchrun`` on
real ranks (NCCL).

    python benchmarks/e2e.py [--layers 8] [--tokens 131072] [--cp 1,2,8] [--doclens FILE] [--output BENCHMARKS.md]
    torchrun --nproc-per-node 8 benchmarks/e2e.py --cp 1,8
    torchrun --nproc-per-node 2 benchmarks/e2e.py --cp 1,2 --overlap-kv   # transfers as graph nodes
    python benchmarks/e2e.py --cpu-smoke [--cp 1,2]      # a tiny float32 model on CPU, to check the script

A step is forward, backward, the gradient all-reduce over the CP group (or FSDP2's
reduce-scatter with ``--fsdp``) and an AdamW step (fused on CUDA; ``--optimizer zero``: sharded over
the CP ranks, ZeRO-1; ``none``: without it). The loss
is computed from the hidden states chunk by chunk (``cpcompile.testing.losses``: at 128K
tokens the model's own ``[T, vocab]`` float32 logits take more memory than several layers),
except with ``--loss hf``.
Definitions of the reported numbers:

- step: median of ``--steps`` steps run back to back over the packs after ``--warmup``,
  each timed from the end of the step before (CUDA events, one untimed step first);
- MFU = model FLOPs / (cp x step x 989e12), model FLOPs = 6 x matmul params (every
  ``nn.Linear``, ``lm_head`` included, embeddings not) x tokens + 3 x layers x
  4 x heads x head_dim x sum over documents of n (n + 1) / 2 (causal attention's QK^T and
  PV forward, times 3 for forward + backward), averaged over the packs;
- GPU busy: the union of GPU activity (kernels, copies, memsets) over the wall time of one
  profiled step (from its first host instruction to its last GPU activity); the profiler
  slows the host, so the idle share is an upper bound;
- attention: GPU time of kernels whose names contain attention, fmha, flash or cudnn
  (the attention kernels only; the gathers and dK/dV sums around them not); the kernel
  column names the family found (cudnn, flash, or both: ``auto``'s forward and backward);
- host syncs: cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize and
  blocking cudaMemcpy calls inside the profiled step;
- cold: the first step's seconds (compilation included), 2nd pack: the first step on the
  second pack (other document counts), graphs: graphs compiled over every pack once;
- peak: ``torch.cuda.max_memory_allocated`` over the timed steps;
- fills: on the fake group, the GPU time of the profiled step's fills of collective outputs
  (:func:`filled_collectives`): the bytes NCCL would write into the gathered and
  reduce-scattered buffers, so communication's, which these times otherwise exclude; each
  CP size's line also gives its slowest rank without them;
- CP efficiency = cp=1 step / (cp x slowest rank's step), both from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import add_output_argument, header, publish  # noqa: E402

import cpcompile  # noqa: E402
import cpcompile.integrations.hf as cphf  # noqa: E402
from cpcompile.advisor.advise import BUILTIN_MIX, cut_pack, length_sampler, positive_int, spec_name  # noqa: E402
from cpcompile.comm import collectives  # noqa: E402
from cpcompile.cost.flops import training_flops  # noqa: E402
from cpcompile.testing import hf_llama, losses, synthetic_pack  # noqa: E402

HEADING = "## End to end (benchmarks/e2e.py)"
PEAK_FLOPS = 989e12  # H200 dense bf16
ATTENTION_WORDS = ("attention", "fmha", "flash", "cudnn")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
FILL_RANGE = "e2e.fake_collective_fill"  # the profiler range around each fill (the fills column)
SMOKE = dict(
    layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, tokens=256, packs=2, steps=2, warmup=0
)
SMOKE_MIX = dataclasses.replace(BUILTIN_MIX, median=32, long_min=64, long_max=256)  # several documents per pack


def int_list(text: str) -> list[int]:
    return [int(word) for word in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = dict(layers=8, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, tokens=131072, packs=8)
    for name, default in sizes.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=default)
    p.add_argument("--doclens", type=Path, metavar="FILE", help="document lengths, as python -m cpcompile.advisor "
                   "reads them (default: its built-in mix)")  # fmt: skip
    p.add_argument("--strategy", default="balanced", choices=[s.value for s in cpcompile.Strategy])
    p.add_argument("--stripe-size", type=positive_int, default=128, help="with --strategy striped")
    p.add_argument("--cp", type=int_list, help="CP sizes, e.g. 1,2,8 (the default; smoke: 2)")
    p.add_argument("--ranks", type=int_list, help="the ranks to time on one GPU, e.g. 0,7 (default: all)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (their median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, after one step on every pack")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "zero", "none"], help="adamw: every rank updates "
                   "every parameter; zero: AdamW sharded over the CP ranks (ZeroRedundancyOptimizer: each rank updates "
                   "its share, then broadcasts it); none: no optimizer step")  # fmt: skip
    p.add_argument("--checkpointing", action="store_true", help="HF activation checkpointing of every layer")
    p.add_argument("--memory-budget", type=float, help="inductor's activation_memory_budget (recompute below 1)")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 fully_shard per decoder layer, the output projection and the decoder stack (cp > 1)",
    )
    p.add_argument("--overlap-kv", action="store_true", help="cpcompile.backend(overlap_kv=True): K/V transfers "
                   "(all-gathers, or the sparse exchange where kv picks it) and the dK/dV reduce-scatters or returns "
                   "as graph nodes, overlapped with the Q projection and the dQ path and weight gradients "
                   "(docs/communication.md); on the fake group the functional collectives' outputs and the "
                   "exchange's all-to-alls are not filled (filled_collectives)")  # fmt: skip
    p.add_argument("--regional", action="store_true", help="compile each decoder layer on its own (one graph for all)")
    p.add_argument("--loss", default="fused", choices=["fused", "hf"], help="fused: the loss from hidden states "
                   "chunk by chunk, without whole-pack logits (cpcompile.testing.losses; the default); "
                   "hf: the model's own (logits, then transformers' loss)")  # fmt: skip
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny float32 model on CPU through aot_eager, to check "
                   "this script: " + ", ".join(f"{k} {v}" for k, v in SMOKE.items()))  # fmt: skip
    add_output_argument(p)
    args = p.parse_args()
    if args.cpu_smoke:  # the smoke sizes, where the command line left the defaults
        vars(args).update({k: v for k, v in SMOKE.items() if getattr(args, k) == p.get_default(k)})
    elif not torch.cuda.is_available():
        p.error("needs CUDA (or --cpu-smoke, a tiny configuration on CPU)")
    if args.fsdp and args.optimizer == "zero":
        p.error("--optimizer zero shards the optimizer over whole parameters; with --fsdp they are sharded already")
    args.inner = "aot_eager" if args.cpu_smoke else "inductor"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.real = world > 1  # under torchrun: real ranks, one GPU each
    args.cp = args.cp or ([world] if args.real else [2] if args.cpu_smoke else [1, 2, 8])
    if min(args.cp) < 1 or (args.real and set(args.cp) - {1, world}) or min(args.ranks or [0]) < 0:
        p.error(f"--cp: sizes >= 1{f', under torchrun 1 or the world size {world}' if args.real else ''}; --ranks >= 0")
    stripe = args.stripe_size if args.strategy == "striped" else 1
    # the fake group: without the sparse K/V exchange (make_backend)
    kv = {} if args.real else {"kv": "all_gather"}
    args.spec = cpcompile.StrategySpec(cpcompile.Strategy(args.strategy), stripe_size=stripe, **kv)
    try:
        args.draw = length_sampler(args.doclens, torch.Generator().manual_seed(0)) if args.doclens else None
    except ValueError as e:
        p.error(str(e))
    return args


# --- model, data, step -------------------------------------------------------------


def build_model(args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight LlamaForCausalLM with cpcompile's attention, seeded alike on every rank."""
    shape = hf_llama.LlamaShape(args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    return hf_llama.random_llama(
        shape, args.layers, max_tokens=args.tokens, device=device, dtype=dtype, checkpointing=args.checkpointing
    )


def make_packs(args) -> list[torch.Tensor]:
    """``cu_seqlens`` of each pack, the same on every rank."""
    draw = args.draw or (SMOKE_MIX if args.cpu_smoke else BUILTIN_MIX).sampler(torch.Generator().manual_seed(0))
    return [cut_pack(draw, args.tokens) for _ in range(args.packs)]


def pack_flops(cu: torch.Tensor, params: int, args) -> float:
    """Model FLOPs of one pack's forward + backward (module docstring)."""
    return training_flops(cu.diff().tolist(), params, args.layers, args.heads, args.hidden // args.heads)


def flattened_batch(cu: torch.Tensor, seed: int, vocab: int) -> dict:
    """The whole pack ``cu`` as ``DataCollatorWithFlattening`` gives it, on the host: ``input_ids``,
    ``position_ids``, ``labels`` ``[1, T]`` (labels unshifted) and ``cu_seq_lens_q``; random tokens from ``seed``."""
    pack = synthetic_pack(cu.diff().tolist(), vocab, torch.Generator().manual_seed(seed))
    batch = {"input_ids": pack["input_ids"][None], "position_ids": pack["position_ids"][None], "cu_seq_lens_q": cu}
    batch["labels"] = batch["input_ids"]
    return batch


def model_inputs(cu: torch.Tensor, seed: int, cp: int, rank: int, args, device) -> tuple[dict, object]:
    """Rank ``rank``'s share of a flattened batch over pack ``cu``, on ``device``, and its strategy spec."""
    batch = flattened_batch(cu, seed, args.vocab)
    inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=cp, rank=rank, strategy=args.spec, device=device)
    return inputs, sharded.spec


class CountingBackend:
    """The backend, counting the graphs it compiles and the packed attention calls it left unsharded."""

    def __init__(self, inner):
        self.inner, self.graphs, self.unsharded = inner, 0, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        compiled = self.inner(gm, example_inputs)  # cpcompile's pass rewrites gm in place first
        self.graphs += 1
        graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
        self.unsharded += sum("packed_attention" in str(n.target) for g in graphs for n in g.nodes)
        return compiled


def make_backend(args, cp: int) -> CountingBackend:
    """cp=1: the inner compiler alone; else cpcompile's backend over the default group, on the fake group without
    the sparse K/V exchange (``args.spec``'s ``kv``: the fake group fills an all-to-all's output with its input,
    and fails where a rank receives rows but sends none)."""
    if cp == 1:
        from torch._dynamo.backends.registry import lookup_backend

        return CountingBackend(lookup_backend(args.inner))
    return CountingBackend(cpcompile.backend(inner=args.inner, overlap_kv=args.overlap_kv))


# --- measurements ------------------------------------------------------------------


def mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def step_times(step, packs: list, n: int, cuda: bool) -> list[float]:
    """Milliseconds of ``n`` steps run back to back, each from the end of the one before."""
    step(packs[-1])  # untimed: the GPU is busy when the first timing starts, as in training
    marks = [mark(cuda)]
    for i in range(n):
        step(packs[i % len(packs)])
        marks.append(mark(cuda))
    if cuda:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]


def wall_s(step, inputs, cuda: bool) -> float:
    start = time.perf_counter()
    step(inputs)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _family(kernel: str) -> str:
    """Which backend a (lower-cased) attention kernel name belongs to; FA4's CuTe kernels are named after it."""
    if "flash_attncute" in kernel or "flashattention" in kernel:
        return "fa4"
    return "cudnn" if "cudnn" in kernel else "flash" if "flash" in kernel else "other"


def profile_step(step, inputs, cuda: bool) -> dict:
    """GPU busy share, attention kernel ms and family, and host syncs of one step (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function("e2e_step"):
            step(inputs)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    span = next(e.time_range for e in events if e.name == "e2e_step" and e.device_type == DeviceType.CPU)
    inside = [e for e in events if span.start <= e.time_range.start <= span.end]
    device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    busy, covered = 0.0, span.start  # union of [start, end) intervals, in microseconds
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in device):
        busy += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    attention = [e for e in device if any(word in e.name.lower() for word in ATTENTION_WORDS)]
    fills = [e for e in events if e.name == FILL_RANGE and e.device_type == DeviceType.CPU]
    names = sorted({e.name[:80] for e in attention})
    print(f"  attention kernels: {names or 'none'}", file=sys.stderr, flush=True)
    families = {_family(n.lower()) for n in names}
    kernel = "+".join(sorted(families)) or "none"
    return {
        "busy": busy / (max(covered, span.end) - span.start) if cuda else None,
        "attention_ms": sum(e.time_range.elapsed_us() for e in attention) / 1e3 if cuda else None,
        "kernel": kernel if cuda else "reference",
        "syncs": sum(e.name in SYNC_CALLS for e in inside if e.device_type == DeviceType.CPU) if cuda else None,
        "fills_ms": sum(e.device_time_total for e in fills) / 1e3 if cuda else None,  # kernels under the ranges
    }


def measure(args, cp: int, rank: int, packs: list[torch.Tensor], device: torch.device) -> dict:
    """One configuration on this process: compile, one step on every pack, then the timings."""
    cuda = device.type == "cuda"
    torch._dynamo.reset()
    model = build_model(args, device, torch.float32 if args.cpu_smoke else torch.bfloat16)
    params = hf_llama.matmul_params(model)
    if args.loss == "fused":
        losses.fuse_loss(model.lm_head)  # before fully_shard: the loss runs in its forward
    if args.fsdp and cp > 1:
        hf_llama.fully_shard_llama(model)
    backend = make_backend(args, cp)
    compiled = hf_llama.compile_llama(model, backend, regional=args.regional, base=args.loss == "fused")
    optimizer = make_optimizer(args.optimizer, model, cp, cuda)
    reduce_grads = cp > 1 and not args.fsdp  # the loss is a sum over ranks: so are its gradients

    def step(inputs_and_spec):
        inputs, spec = inputs_and_spec
        with cpcompile.strategy(spec):
            loss = hf_llama.causal_lm_loss(compiled, model, inputs) if args.loss == "fused" else compiled(**inputs).loss
        loss.backward()
        if reduce_grads:
            for work in [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]:
                work.wait()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    inputs = [model_inputs(cu, seed, cp, rank, args, device) for seed, cu in enumerate(packs)]
    cold = wall_s(step, inputs[0], cuda)
    if cp > 1 and backend.unsharded:
        raise SystemExit(
            f"cp={cp}: {backend.unsharded} packed attention call(s) were left unsharded by cpcompile's pass: "
            "the step would not be context-parallel"
        )
    second = wall_s(step, inputs[1 % len(inputs)], cuda)
    for pack in inputs[2:]:
        step(pack)
    graphs = backend.graphs
    for i in range(args.warmup):
        step(inputs[i % len(inputs)])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = step_times(step, inputs, args.steps, cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    profiled = profile_step(step, inputs[0], cuda)
    flops = statistics.mean(pack_flops(cu, params, args) for cu in packs)
    return dict(cp=cp, rank=rank, ms=statistics.median(times), flops=flops, params=params, cold=cold, second=second,
                graphs=graphs, peak=peak, **profiled)  # fmt: skip


def run_config(args, cp: int, ranks: list[int], packs, device) -> list[dict]:
    """Every rank of one CP size: this process's rank on real ranks, else each in turn on the fake group."""
    if cp == 1 or args.real:
        return [attempt(args, cp, dist.get_rank() if args.real and cp > 1 else 0, packs, device)]
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    except ImportError:  # where the fake backend is built in
        FakeStore = dist.HashStore

    rows = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        try:
            with filled_collectives():
                rows.append(attempt(args, cp, rank, packs, device))
        finally:
            dist.destroy_process_group()
    return rows


def make_optimizer(kind: str, model: torch.nn.Module, cp: int, cuda: bool):
    """``--optimizer``'s AdamW (``None`` for none), fused on CUDA: one pass over each parameter and
    its state (foreach makes several). ``zero`` at cp > 1 shards it over the CP group (ZeRO-1:
    parameters and gradients stay whole)."""
    if kind == "none":
        return None
    adamw = {"lr": 1e-5, **({"fused": True} if cuda else {"foreach": True})}
    if kind == "zero" and cp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    return torch.optim.AdamW(model.parameters(), **adamw)


@contextlib.contextmanager
def filled_collectives():
    """All-gathers and reduce-scatters on the fake group (cpcompile's, and FSDP2's through
    ``torch.distributed``) fill their outputs with this rank's own rows, where the fake group
    leaves them as allocated (uninitialised memory, often zeros): its reduce-scatters, and its
    all-gathers in torch versions whose fake group does not copy the input into every slot
    itself (:func:`_fake_group_gathers`; a second copy would count twice the bytes).

    A GPU's power draw depends on the values its matmuls multiply, and under the H200's power cap
    so does its clock: with the reduce-scattered gradients left as memory happened to hold, the
    ranks' matmuls ran at different clocks for the same shapes (docs/end-to-end.md, "Fake data,
    real power"). With every value a real one (FSDP2's gathered weights: copies of this rank's
    shard), a rank's step draws the power it would on real ranks. Each collective's output is
    written once, as NCCL would write it; the profiler range :data:`FILL_RANGE` around the writes
    (the fake group's own included) gives the fills column.
    """
    copies_itself = _fake_group_gathers()

    def filling_gather(gather):
        def all_gather(*args, **kwargs):  # FSDP2 passes output_tensor=, input_tensor=
            with record_function(FILL_RANGE):
                work = gather(*args, **kwargs)
                if not copies_itself:
                    out, x = _arguments(args, kwargs, "output_tensor", "input_tensor")
                    for slot in out.view(-1, *x.shape):  # contiguous copies (a broadcast copy is several times slower)
                        slot.copy_(x)
            return work

        return all_gather

    def filling_scatter(scatter):
        def reduce_scatter(*args, **kwargs):  # FSDP2 passes output=, input=
            work = scatter(*args, **kwargs)
            out, x = _arguments(args, kwargs, "output", "input")
            with record_function(FILL_RANGE):  # one rank's partial sums: values of the sum's kind
                out.copy_(x.flatten()[: out.numel()].view(out.shape))
            return work

        return reduce_scatter

    saved = [
        (collectives, "_all_gather", filling_gather),
        (collectives, "_reduce_scatter", filling_scatter),
        (dist, _NEWER["all_gather_into_tensor"], filling_gather),  # the names FSDP2 calls
        (dist, _NEWER["reduce_scatter_tensor"], filling_scatter),
    ]
    saved = [(module, name, getattr(module, name), fill) for module, name, fill in saved]
    for module, name, original, fill in saved:
        setattr(module, name, fill(original))
    try:
        yield
    finally:
        for module, name, original, _ in saved:
            setattr(module, name, original)


#: torch.distributed's collectives under the names of the running torch (2.13 renamed them).
_NEWER = {
    name: new if hasattr(dist, new) else name
    for name, new in (
        ("all_gather_into_tensor", "all_gather_single"),
        ("reduce_scatter_tensor", "reduce_scatter_single"),
    )
}


def _fake_group_gathers() -> bool:
    """Whether the default (fake) group's all-gather writes the input into every slot itself, as
    recent torch's ``FakeProcessGroup`` does (probed on a tiny tensor)."""
    x = torch.ones(1)
    out = torch.zeros(dist.get_world_size())
    getattr(dist, _NEWER["all_gather_into_tensor"])(out, x)
    return bool((out == 1).all())


def _arguments(args: tuple, kwargs: dict, *names: str) -> list:
    """A collective's leading arguments ``names``, given by position or by name."""
    return [args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names)]


def attempt(args, cp: int, rank: int, packs, device) -> dict:
    """``measure``, or a row that says it ran out of memory; then everything it held is freed."""
    print(f"cp={cp} rank {rank} ...", file=sys.stderr, flush=True)
    try:
        row = measure(args, cp, rank, packs, device)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or one raised while compiling
        if "out of memory" not in str(e):
            raise
        print(f"  out of memory: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        row = {"cp": cp, "rank": rank, "oom": True}
    torch._dynamo.reset()
    cpcompile.attention.release_grad_buffers()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"  {row_cells(row, args.tokens)}", file=sys.stderr, flush=True)
    return row


# --- report ------------------------------------------------------------------------

COLUMNS = (
    "cp|rank|step ms|tokens/s per GPU|MFU|GPU busy|attention ms|kernel|host syncs|cold s|2nd pack s|graphs|peak GiB"
    "|fills ms"
).split("|")


def row_cells(row: dict, tokens: int) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    if row.get("oom"):
        return f"| {row['cp']} | {row['rank']} | out of memory |" + " |" * (len(COLUMNS) - 3)
    s, cp = row["ms"] / 1e3, row["cp"]
    mfu = row["flops"] / cp / s / PEAK_FLOPS
    cells = [cp, row["rank"], f"{row['ms']:.1f}", f"{tokens / cp / s:,.0f}", f"{mfu:.3f}",
             fmt(row["busy"], ".2f"), fmt(row["attention_ms"], ".1f"), row["kernel"], fmt(row["syncs"], "d"),
             f"{row['cold']:.1f}", f"{row['second']:.2f}", row["graphs"], fmt(row["peak"], ".1f"),
             fmt(row.get("fills_ms"), ".1f")]  # fmt: skip
    return "| " + " | ".join(map(str, cells)) + " |"


def intro(args, rows: list[dict], packs: list[torch.Tensor]) -> list[str]:
    """The lines above the table: what ran, and whether communication is in the times."""
    done = [r for r in rows if not r.get("oom")]
    docs = statistics.mean(cu.shape[0] - 1 for cu in packs)
    source = f"`{args.doclens.name}`" if args.doclens else "the built-in mix of `cpcompile.advisor.advise`"
    params = f"{done[0]['params'] / 1e9:.2f}B matmul parameters, " if done else ""
    step = "forward, backward, " + ("FSDP2's reduce-scatter" if args.fsdp else "gradient all-reduce over CP")
    fused = "" if args.cpu_smoke else " (fused)"
    zero = f", AdamW{fused} (at cp > 1 sharded over CP, ZeRO-1)"
    adamw = {"none": "", "adamw": f", AdamW{fused}", "zero": zero}[args.optimizer]
    return [
        f"`LlamaForCausalLM`: {args.layers} layers of hidden {args.hidden}, MLP {args.intermediate}, heads "
        f"{args.heads}/{args.kv_heads} x {args.hidden // args.heads}, vocab {args.vocab} ({params}random "
        f'{"float32, CPU" if args.cpu_smoke else "bf16"} weights, {args.inner}), `attn_implementation="cpcompile"`'
        f"{', HF checkpointing' if args.checkpointing else ''}"
        f"{', each decoder layer compiled on its own' if args.regional else ''}"
        f"{f', memory budget {args.memory_budget}' if args.memory_budget is not None else ''}"
        f"{', loss from hidden states in 8192-token chunks (no whole-pack logits)' if args.loss == 'fused' else ''}. "
        f"{args.packs} packs x {args.tokens} tokens from {source} ({docs:.0f} documents on average), "
        f"`{spec_name(args.spec)}`. Step: {step}{' (cp > 1)' if args.fsdp else ''}"
        f"{adamw}; median of {args.steps} steps ({args.warmup} warm-up "
        "and one per pack first). Definitions: `benchmarks/e2e.py`'s docstring.",
        "",
        f"cp=1: plain `torch.compile`{' per layer' if args.regional else ''}. cp > 1: "
        + (
            "real ranks; times include communication."
            if args.real
            else "each rank timed alone on this GPU on the fake process group: **no communication in these "
            "times** (K/V gathers, dK/dV reduce-scatters, gradient reduction); sparse K/V exchange off; "
            "gathered and reduce-scattered rows hold copies of the rank's own (real values: the GPU's power, "
            "and so its clock, depends on them)."
        ),
        "",
    ]


def efficiency(rows: list[dict]) -> list[str]:
    """One line per CP size: its slowest rank and, with cp=1 in the run, the CP efficiency."""
    done = [r for r in rows if not r.get("oom")]
    single = next((r["ms"] for r in done if r["cp"] == 1), None)
    lines = []
    for cp in sorted({r["cp"] for r in done} - {1}):
        mine = [r for r in done if r["cp"] == cp]
        slowest = max(mine, key=lambda r: r["ms"])
        measured = "" if len(mine) == cp else f" (of ranks {','.join(str(r['rank']) for r in mine)} only)"
        line = f"cp={cp}: slowest rank {slowest['rank']}{measured}, {slowest['ms']:.1f} ms"
        if single is not None:
            line += f"; CP efficiency = cp=1 step / (cp x slowest) = {single / (cp * slowest['ms']):.3f}"
        if any(r.get("fills_ms") for r in mine):  # the fake group's stand-ins for NCCL's writes
            bare = max(mine, key=lambda r: r["ms"] - r["fills_ms"])
            ms = bare["ms"] - bare["fills_ms"]
            line += f"; without the fills (communication's writes), slowest rank {bare['rank']}, {ms:.1f} ms"
            if single is not None:
                line += f", efficiency {single / (cp * ms):.3f}"
        lines.append(line + ".")
    return ["", *lines] if lines else []


def main() -> None:
    args = parse_args()
    if args.memory_budget is not None:
        torch._functorch.config.activation_memory_budget = args.memory_budget
    device = torch.device("cpu")
    if args.cpu_smoke:  # the fake group's garbage holds denormals, which slow CPUs down many times over
        torch.set_flush_denormal(True)
        torch.set_num_threads(1)  # the flag is per thread
    if args.real:
        dist.init_process_group("gloo" if args.cpu_smoke else "nccl")
        if not args.cpu_smoke:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    elif not args.cpu_smoke:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    packs = make_packs(args)
    rows = []
    for cp in args.cp:
        rows += run_config(args, cp, [r for r in (args.ranks or range(cp)) if r < cp], packs, device)
    if args.real:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        rows = [r for i, part in enumerate(gathered) for r in part if r["cp"] > 1 or i == 0]
    if not args.real or dist.get_rank() == 0:
        table = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        table += [row_cells(r, args.tokens) for r in rows]
        lines = [*header(HEADING), *intro(args, rows, packs), *table, *efficiency(rows)]
        publish(HEADING, lines, args.output)
    if args.real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

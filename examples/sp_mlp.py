"""A sequence-parallel MLP compiled with the TP overlap pass equals the eager block.

``--tp`` gloo processes each hold ``t`` tokens of a batch (``t`` changes every step) and
their shards of a column-parallel ``fc1`` and a row-parallel ``fc2``, written as Megatron
writes them with torch's functional collectives. ``torch.compile`` with
``cpcompile.backend`` (its TP overlap pass) turns all-gather -> fc1 into
``cpcompile.tp.ag_gemm`` and fc2 -> reduce-scatter into ``cpcompile.tp.gemm_rs``; output and
gradients match the eager block for every ``t``, with one compilation.

    python examples/sp_mlp.py [--tp 2] [--hidden 64] [--steps 6] [--capacity 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

import cpcompile

# torch 2.13 renamed the wrappers (same ops underneath); 2.11 and 2.12 only have the old names.
all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
reduce_scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor


class SequenceParallelMLP(nn.Module):
    """``[t, H]`` -> ``[t, H]`` on each TP rank; the hidden ``[tp * t, F / tp]`` exists only inside."""

    def __init__(self, hidden: int, ffn: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.fc1 = nn.Linear(hidden, ffn // group.size())  # column-parallel: weight [F/tp, H]
        self.fc2 = nn.Linear(ffn // group.size(), hidden, bias=False)  # row-parallel: weight [H, F/tp]
        self.bias2 = nn.Parameter(torch.zeros(hidden))  # added once, after the reduce-scatter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = all_gather(x, 0, self.group)  # [tp * t, H]
        h = F.gelu(self.fc1(h))  # [tp * t, F/tp]
        return reduce_scatter(self.fc2(h), "sum", 0, self.group) + self.bias2  # [t, H]


class CountingInner:
    """The compiler after ``cpcompile.backend``'s passes (aot_eager); records, per compilation,
    how many matmuls the pass turned into ``ag_gemm`` / ``gemm_rs``."""

    def __init__(self) -> None:
        self.rewrites: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        names = ("cpcompile.tp.ag_gemm", "cpcompile.tp.gemm_rs")
        self.rewrites.append(sum(str(n.target).startswith(names) for n in gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def run(rank: int, tp: int, init_file: str, hidden: int, steps: int, capacity: int, failed) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    torch.manual_seed(rank)  # each rank's own weight shards
    block = SequenceParallelMLP(hidden, 4 * hidden, dist.group.WORLD)
    inner = CountingInner()
    # no attention here, so the CP pass (group: the default) has nothing to do
    backend = cpcompile.backend(inner=inner, tp_capacity_tokens=capacity)
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    lengths = torch.randint(2, capacity + 1, (steps,), generator=torch.Generator().manual_seed(0)).tolist()
    worst = 0.0
    for step, t in enumerate(lengths):  # every rank draws the same t
        x, dout = torch.randn(t, hidden), torch.randn(t, hidden)
        results = []
        for fn in (block, compiled):
            leaf = x.clone().requires_grad_()
            if step == 0 and fn is compiled:
                torch._dynamo.mark_dynamic(leaf, 0)  # t is symbolic from the first compilation
            out = fn(leaf)
            grads = torch.autograd.grad(out, [leaf, *block.parameters()], dout)
            results.append([out, *grads])
        errors = [relative_error(c, e) for e, c in zip(*results, strict=True)]
        worst = max(worst, *errors)
        if rank == 0:
            print(f"step {step}: t = {t:4d}  max relative error (out, dx, dW1, db1, dW2, db2) {max(errors):.1e}")
    if rank == 0:
        print(f"compilations: {len(inner.rewrites)}, matmuls rewritten: {inner.rewrites}")
    if worst > 1e-5 or inner.rewrites != [2]:
        failed.value = 1
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--capacity", type=int, default=512, help="most tokens per rank per step")
    args = parser.parse_args()
    failed = mp.get_context("spawn").Value("i", 0)
    with tempfile.TemporaryDirectory() as tmp:
        run_args = (args.tp, os.path.join(tmp, "init"), args.hidden, args.steps, args.capacity, failed)
        mp.start_processes(run, args=run_args, nprocs=args.tp, start_method="spawn")
    print("compiled block matches eager" if not failed.value else "MISMATCH between compiled and eager block")
    sys.exit(failed.value)


if __name__ == "__main__":
    main()

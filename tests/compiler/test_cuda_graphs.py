"""A CP rank's compiled step under CUDA graphs.

``benchmarks/cuda_graphs.py`` on small sizes: packs of varying composition padded to one capacity
bucket run one compiled graph; with ``mode="reduce-overhead"`` the first pass over them captures
the forward and the backward once each, attention included where FA4 runs it (``ops.captured``),
on the second pack; ``cpcompile.CapturedStep`` captures the whole step once; no later pack
captures again; each loss and gradient norm agrees with the model compiled without graphs within
rounding, and a replayed step makes no host sync. (The CPU half: ``tests/layouts/test_capacity.py``,
``tests/attention/test_captured.py``.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpcompile.kernels import fa4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def _run(modes: str) -> dict[str, str]:
    """The benchmark's row for small sizes (12 packs, cp=4 rank 1, 2 layers), column name -> cell."""
    sizes = ["--layers", "2", "--cp", "4", "--rank", "1", "--tokens-per-rank", "1024", "--packs", "12", "--steps", "2"]
    command = [sys.executable, str(ROOT / "benchmarks" / "cuda_graphs.py"), *sizes, "--modes", modes]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| 1,024 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in run.stdout.splitlines() if line.startswith("| tokens/rank |"))
    got = dict(zip([c.strip() for c in header.strip("|").split("|")], cells))
    assert got["compiled graphs"] == "1 / 1", got
    assert float(got["loss diff"]) < 1e-3, got  # two compilations of one model: equal up to kernel rounding
    assert float(got["grad diff"]) < 1e-2, got  # bf16 gradients through the backward's atomics
    assert got["no host sync"] == "yes", got
    return got


def _captures(got: dict) -> tuple[int, int]:
    """``(captures, captures after the second pack)``."""
    total, later = got["captures (after 2nd pack)"].replace("(", "").replace(")", "").split()
    return int(total), int(later)


def test_packs_of_a_bucket_replay_the_forward_and_the_backward_graph():
    """``mode="reduce-overhead"``: with FA4 the attention is captured too (``ops.captured``), so the
    forward is one graph and the backward one; without it the attention ops run between the
    captured parts, one graph each. None recorded after the second pack."""
    total, later = _captures(_run("plain,trees"))
    assert later == 0 and (total == 2 if fa4.available() else total > 2), (total, later)


@pytest.mark.skipif(not fa4.available(), reason="CapturedStep's attention is FA4's")
def test_packs_of_a_bucket_replay_one_graph_of_the_whole_step():
    """``cpcompile.CapturedStep``: forward, loss and backward, one graph per bucket, replayed for every
    pack with its plan copied into the graph's plan slots."""
    assert _captures(_run("plain,step")) == (1, 0)


@pytest.mark.skipif(not fa4.available(), reason="CapturedStep's attention is FA4's")
def test_each_call_of_a_captured_step_is_one_training_step_on_its_own_pack():
    """``CapturedStep`` with the optimizer inside the step (Adam, ``capturable=True``): every call,
    the warm-up's included, is one step on its own pack (Adam's step count follows the calls), and
    the bucket is captured once per count of layers its packs need; with the optimizer outside, the
    loop's ``zero_grad()`` between steps leaves each replay's gradients on the parameters for it.
    Rank 1 of 2 on the fake group, whose collectives return garbage: counts, not values (those: the
    benchmark's tests above)."""
    import dataclasses

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile
    from cpcompile.testing.packed_gpt import GPTConfig, PackedGPT, summed_loss, synthetic_pack

    cfg = GPTConfig(vocab=64, dim=256, heads=4, kv_heads=2, layers=1, max_position=1024)
    mixes = ([100, 3, 200], [7, 7, 7, 250], [1, 300], [150, 150], [64, 9])
    packs = [synthetic_pack(m, cfg.vocab, torch.Generator().manual_seed(i)) for i, m in enumerate(mixes)]
    base = cpcompile.StrategySpec("balanced")
    capacity = cpcompile.layouts.capacity_for([p["cu_seqlens"] for p in packs], cp_size=2, strategy=base)
    # the fake group: no exchange
    spec = dataclasses.replace(base, capacity=capacity, kv="all_gather")
    names = ("input_ids", "position_ids", "labels")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        for inside in (True, False):
            torch._dynamo.reset()
            model = PackedGPT(cfg).to("cuda", torch.bfloat16)
            backend = cpcompile.backend(captured_step=True)
            compiled = torch.compile(model, backend=backend, dynamic=False)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)

            def step(ids, positions, labels, cu, compiled=compiled, opt=opt, inside=inside):
                loss = summed_loss(compiled(ids, positions, cu, 512), labels)
                loss.backward()
                if inside:
                    opt.step()
                return loss

            captured = cpcompile.CapturedStep(step, module=model)
            for calls, pack in enumerate(packs, 1):
                batch = cpcompile.shard_batch({n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=2, rank=1,
                                              strategy=spec, device="cuda")  # fmt: skip
                with cpcompile.strategy(batch):
                    captured(*(batch.tensors[n] for n in names), batch.cu_seqlens)
                if inside:
                    assert {int(opt.state[p]["step"]) for p in model.parameters()} == {calls}, (inside, calls)
                else:
                    assert all(p.grad is not None for p in model.parameters()), calls
                    opt.step()
                    opt.zero_grad()
            # a graph per count of layers of pieces the packs need (balanced: one or two)
            assert 1 <= captured.captures <= 2, inside
    finally:
        dist.destroy_process_group()

"""Tier 5's script checked on CPU: ``benchmarks/e2e.py --cpu-smoke`` end to end (a subprocess, ~35 s on 2 idle cores).

A tiny float32 Llama through ``aot_eager`` at cp=1 and one rank of cp=2 on the fake process
group: the script's table and CP-efficiency line come out, one graph per configuration.
No timing is checked (CPU numbers mean nothing here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason='needs the hf extra: pip install "cpcompile[hf]"')

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_script(*args: str) -> subprocess.CompletedProcess:
    """The script as a user runs it, with this checkout's cpcompile first on the path and no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    script = str(ROOT / "benchmarks" / "e2e.py")
    return subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170
    )


def test_cpu_smoke_prints_and_writes_its_section(tmp_path):
    output = tmp_path / "BENCHMARKS.md"
    run = run_script("--cpu-smoke", "--cp", "1,2", "--ranks", "1", "--optimizer", "zero", "--output", str(output))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [(r[0], r[1]) for r in rows] == [("| 1", "0"), ("| 2", "1")], run.stdout
    assert all(r[11] == "1" for r in rows), "one graph per configuration over packs of different document counts"
    assert "cp=2: slowest rank 1 (of ranks 1 only)" in run.stdout and "CP efficiency" in run.stdout
    assert "no communication in these times" in run.stdout
    assert "AdamW (at cp > 1 sharded over CP, ZeRO-1)" in run.stdout  # ZeroRedundancyOptimizer on the fake group
    assert output.read_text().startswith("# Benchmarks\n\n## End to end (benchmarks/e2e.py)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_asks_for_cuda_or_the_smoke_run():
    run = run_script()
    assert run.returncode == 2 and "needs CUDA (or --cpu-smoke" in run.stderr


def _e2e_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_script", ROOT / "benchmarks" / "e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(e2e)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return e2e


def test_efficiency_lines_give_the_slowest_rank_with_and_without_the_fills():
    """The fills stand in for communication's writes: each CP size's line gives the slowest rank
    with them and, apart, without them (which may be another rank)."""
    e2e = _e2e_module()
    rows = [
        {"cp": 1, "rank": 0, "ms": 800.0, "fills_ms": 0.0},
        {"cp": 8, "rank": 0, "ms": 110.0, "fills_ms": 10.0},
        {"cp": 8, "rank": 7, "ms": 108.0, "fills_ms": 2.0},
    ]
    (_, line) = e2e.efficiency(rows)
    assert line == (
        "cp=8: slowest rank 0 (of ranks 0,7 only), 110.0 ms; CP efficiency = cp=1 step / (cp x slowest) = 0.909; "
        "without the fills (communication's writes), slowest rank 7, 106.0 ms, efficiency 0.943."
    )
    rows = [{**r, "fills_ms": None} for r in rows]  # off the GPU: not measured
    assert "without the fills" not in e2e.efficiency(rows)[1]


@pytest.mark.parametrize("copies_itself", [True, False])
def test_fake_group_collectives_carry_real_values(copies_itself, monkeypatch):
    # The fake group leaves a collective's output as allocated; the benchmark fills it with the rank's
    # own rows, so that a rank's matmuls multiply values of the kinds real ranks would (power, clocks).
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpcompile.comm import collectives

    e2e = _e2e_module()
    x = torch.arange(12.0).view(3, 4)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        # this torch's fake group writes every slot of an all-gather itself, so the fill leaves them;
        # where it would not, the fill's own copies write them
        assert e2e._fake_group_gathers()
        if not copies_itself:
            monkeypatch.setattr(e2e, "_fake_group_gathers", lambda: False)
        with e2e.filled_collectives():
            gathered, work = collectives.all_gather_rows(x, dist.group.WORLD, async_op=True)
            work.wait()
            scattered = collectives.reduce_scatter_rows(gathered, dist.group.WORLD)
            # FSDP2's, through torch.distributed, by keyword
            flat, out = x.flatten(), torch.zeros(48)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # looked up in the fill
            gather(output_tensor=out, input_tensor=flat, group=dist.group.WORLD)
            shard = torch.zeros(12)
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            scatter(output=shard, input=out, group=dist.group.WORLD)
        assert torch.equal(gathered, x.repeat(4, 1)) and torch.equal(scattered, x)
        assert torch.equal(out, flat.repeat(4)) and torch.equal(shard, flat)
        assert collectives._all_gather in (dist.all_gather_into_tensor, getattr(dist, "all_gather_single", None))
    finally:
        dist.destroy_process_group()

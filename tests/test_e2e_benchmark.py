"""The GPU script checked on CPU: ``benchmarks/e2e.py --cpu-smoke`` end to end (a subprocess, ~35 s on 2 idle cores).

A tiny float32 Llama through ``aot_eager`` at cp=1 and one rank of cp=2 on the fake process
group: the script's table and CP-efficiency line come out, one graph per configuration, the
efficiency line consistent with the table. No timing is checked (CPU numbers mean nothing here).
The script is only run, never imported: what a test checks is what its command line prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason='needs the hf extra: pip install "cpcompile[hf]"')

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_script(*args: str, script: str = "e2e.py") -> subprocess.CompletedProcess:
    """``benchmarks/<script>`` as a user runs it, with this checkout's cpcompile first on the path and no torchrun
    variables."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    script = str(ROOT / "benchmarks" / script)
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
    assert "no communication in these times" in run.stdout
    assert "AdamW (at cp > 1 sharded over CP, ZeRO-1)" in run.stdout  # ZeroRedundancyOptimizer on the fake group
    assert output.read_text().startswith("# Benchmarks\n\n## End to end (benchmarks/e2e.py)\n")
    # The efficiency line: the slowest measured rank, named as one of the ranks asked for, and cp=1's step over
    # cp times its step, from the table's times (printed to 0.1 ms, the efficiency to 0.001).
    single, slowest = (float(r[2]) for r in rows)
    line = re.search(r"cp=2: slowest rank 1 \(of ranks 1 only\), ([\d.]+) ms; CP efficiency = cp=1 step / \(cp x "
                     r"slowest\) = ([\d.]+)\.", run.stdout)  # fmt: skip
    assert line, run.stdout
    assert float(line[1]) == slowest
    low, high = (single - 0.05) / (2 * (slowest + 0.05)), (single + 0.05) / (2 * max(slowest - 0.05, 1e-9))
    assert low - 5e-4 <= float(line[2]) <= high + 5e-4, (line[0], single, slowest)
    # Off the GPU the fills (the fake group's stand-ins for communication's writes) are not measured:
    # their column is empty and the line gives no time without them.
    assert all(r[13] == "- |" for r in rows), rows
    assert "without the fills" not in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_asks_for_cuda_or_the_smoke_run():
    run = run_script()
    assert run.returncode == 2 and "needs CUDA (or --cpu-smoke" in run.stderr

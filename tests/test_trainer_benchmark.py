"""The GPU script checked on CPU: ``benchmarks/trainer.py --cpu-smoke`` end to end (a subprocess, ~20 s).

A tiny float32 Llama through ``aot_eager``, trained by ``benchmarks/e2e.py``'s loop and by ``CPTrainer.train()``
on the same packs: both rows and the ratio line come out, one graph per side over packs of different document
counts, the ratio consistent with the table. No timing is checked (CPU numbers mean nothing here).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_e2e_benchmark import run_script

pytest.importorskip("accelerate", reason='needs the trainers extra: pip install "cpcompile[trainers]"')


def test_cpu_smoke_prints_and_writes_its_section(tmp_path):
    output = tmp_path / "BENCHMARKS.md"
    run = run_script("--cpu-smoke", "--output", str(output), script="trainer.py")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith(("| loop |", "| trainer |"))]
    assert [r[0] for r in rows] == ["| loop", "| trainer"], run.stdout
    assert all(r[5] == "1" for r in rows), "one graph per side over packs of different document counts"
    assert rows[0][4] == "1"
    loop_ms, trainer_ms = (float(r[1]) for r in rows)
    ratio = float(rows[1][4])
    low, high = (loop_ms - 0.05) / (trainer_ms + 0.05), (loop_ms + 0.05) / (trainer_ms - 0.05)
    assert low - 5e-4 <= ratio <= high + 5e-4, (ratio, loop_ms, trainer_ms)
    line = re.search(r"The integration's cost: trainer / loop tokens/s = ([\d.]+) ", run.stdout)
    assert line and float(line[1]) == ratio, run.stdout
    assert "cp=1 (one process, no process group)" in run.stdout
    assert output.read_text().startswith("# Benchmarks\n\n## Trainer integration (benchmarks/trainer.py)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_asks_for_cuda_or_the_smoke_run():
    run = run_script(script="trainer.py")
    assert run.returncode == 2 and "needs CUDA (or --cpu-smoke" in run.stderr

"""Tier 5 (CUDA only, skipped elsewhere): a CP rank's compiled step under CUDA graphs.

``benchmarks/cuda_graphs.py`` on small sizes: packs of varying composition padded to one capacity
bucket run one compiled graph; with ``mode="reduce-overhead"`` the first pass over them captures
every captured part once (on the second pack) and no later pack captures again; each loss and
gradient norm agrees with the model compiled without graphs within rounding, and a replayed step
makes no host sync. (The CPU half: ``tests/test_capacity.py``.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parent.parent


def test_packs_of_a_bucket_replay_one_capture_like_the_step_without_graphs():
    command = [sys.executable, str(ROOT / "benchmarks" / "cuda_graphs.py"), "--layers", "2", "--cp", "4",
               "--rank", "1", "--tokens-per-rank", "1024", "--packs", "12", "--steps", "2"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| 1,024 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in run.stdout.splitlines() if line.startswith("| tokens/rank |"))
    got = dict(zip([c.strip() for c in header.strip("|").split("|")], cells))
    assert got["compiled graphs"] == "1 / 1", got
    captures, later = got["captures (after 2nd pack)"].replace("(", "").replace(")", "").split()
    assert int(captures) > 0 and int(later) == 0, got  # recorded on the second pack, replayed after
    assert float(got["loss diff"]) < 1e-3, got  # two compilations of one model: equal up to kernel rounding
    assert float(got["grad diff"]) < 1e-2, got  # bf16 gradients through the backward's atomics
    assert got["no host sync"] == "yes", got

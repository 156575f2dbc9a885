"""Tier 5 (CUDA only, skipped elsewhere): a CP rank's compiled step under CUDA graphs.

``benchmarks/cuda_graphs.py`` on small sizes: packs of varying composition padded to one capacity
bucket run one compiled graph; with ``mode="reduce-overhead"`` the first pass over them captures
the forward and the backward once each, attention included where FA4 runs it (``ops.captured``),
on the second pack; ``cpcompile.CapturedStep`` captures the whole step once; no later pack
captures again; each loss and gradient norm agrees with the model compiled without graphs within
rounding, and a replayed step makes no host sync. (The CPU half: ``tests/test_capacity.py``,
``tests/test_captured.py``.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpcompile.kernels import fa4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parent.parent


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
    pack with its plan copied into the graph's plan slots. (Written without a GPU run yet.)"""
    assert _captures(_run("plain,step")) == (1, 0)

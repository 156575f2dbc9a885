"""Benchmark scripts as a fresh clone runs them: without ``../shared``'s length files and without
``--output``, they print their section and write no file; GPU scripts without CUDA refuse, or
with ``--dry-run`` print what they would measure. Tests run the scripts; none imports one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_balance_without_length_files_prints_its_section_and_writes_nothing(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "balance.py"), "--doclens", str(tmp_path), "--packs", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "## Balance (benchmarks/balance.py)" in run.stdout
    assert "no real mix" in run.stdout
    assert list(tmp_path.iterdir()) == [] and (ROOT / "BENCHMARKS.md").read_bytes() == before


def _heads_gpu(tmp_path, *args):
    script = ROOT / "benchmarks" / "heads_gpu.py"
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_heads_gpu_refuses_without_cuda_before_any_work(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    run = _heads_gpu(tmp_path, "--output", "BENCHMARKS.md")
    assert run.returncode == 2 and run.stdout == ""
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith("error: needs CUDA (or --dry-run: the plans and bytes of the same cases on CPU, nothing timed)")
    )
    assert list(tmp_path.iterdir()) == [] and (ROOT / "BENCHMARKS.md").read_bytes() == before


def test_heads_gpu_dry_run_counts_the_bytes_of_every_u_and_writes_nothing(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    run = _heads_gpu(
        tmp_path, "--dry-run", "--tokens", "8192", "--packs", "1", "--doclens", str(tmp_path / "none.json")
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("## Head parallelism on one GPU (benchmarks/heads_gpu.py)")
    assert "synthetic ProLong-like lengths" in run.stdout
    for heads in ("32/8", "16/16"):
        table = run.stdout.split(f"### forward+backward, heads {heads}")[1].split("###")[0]
        rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
        assert [(r[0][2:], r[1], r[2]) for r in rows] == [
            ("1", "dual_chunk_swap", "all-gather"),
            ("1", "balanced", rows[1][2]),  # the exchange or the all-gather, as cp_attention would choose
            ("2", "dual_chunk_swap", "all-to-all + all-gather"),
            ("2", "balanced", "all-to-all + all-gather"),
            ("4", "dual_chunk_swap", "all-to-all + all-gather"),
            ("4", "balanced", "all-to-all + all-gather"),
            ("8", "no_load_balance", "all-to-all"),
        ]
        assert all(float(r[8]) > 0 for r in rows)  # MB per layer
    assert list(tmp_path.iterdir()) == [] and (ROOT / "BENCHMARKS.md").read_bytes() == before
    refused = _heads_gpu(tmp_path, "--dry-run", "--output", "BENCHMARKS.md")
    assert refused.returncode == 2 and "--dry-run times nothing" in refused.stderr


def test_no_test_imports_a_benchmark_script():
    """A benchmark script is tested through its command line (as here, and tests/test_e2e_benchmark.py),
    so that a test pins what a user sees and a script's internals stay free to change."""
    loaders = {"spec_from_file_location", "run_path", "import_module", "SourceFileLoader"}
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in loaders:
                names = ["benchmarks" if "benchmarks" in ast.unparse(node) else ""]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not found, f"tests import benchmark scripts (run them as a subprocess instead): {found}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_attention_gpu_takes_the_variants_switches_and_refuses_without_cuda(tmp_path):
    """``--heads``, ``--head-dims``, ``--softcap`` (the MLA and soft-capping rows) and ``--profile`` parse, bad
    values are named, and without CUDA the script refuses after parsing them."""

    def run(*args):
        script = ROOT / "benchmarks" / "attention_gpu.py"
        return subprocess.run(
            [sys.executable, str(script), "--doclens", str(tmp_path), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    mla = run("--heads", "128/128", "--head-dims", "192/128", "--softcap", "50", "--kernels", "fa4", "--cp", "8",
              "--profile")  # fmt: skip
    assert mla.returncode == 2 and "needs a CUDA GPU" in mla.stderr, mla.stderr
    bad = run("--heads", "32/8", "12/5")  # each run starts Python and imports torch: one of the checks
    assert bad.returncode == 2 and "--heads 12/5: the query heads must be a multiple of" in bad.stderr, bad.stderr

"""Benchmark scripts as a fresh clone runs them: without ``../shared``'s length files and without
``--output``, they print their section and write no file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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

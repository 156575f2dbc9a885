"""``benchmarks/scale.py --cpu-smoke`` as CI runs it (a subprocess, seconds): the synthetic mix, its three
tables, each row consistent with itself, nothing written without ``--output``; and without a length file the
full mode refuses with the option's name. The script is only run, never imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    script = str(ROOT / "benchmarks" / "scale.py")
    return subprocess.run(
        [sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _rows(table: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]


def test_cpu_smoke_prints_every_table_and_writes_nothing(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    run = run_script("--cpu-smoke", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.startswith("## Scale on paper (benchmarks/scale.py)\n")
    assert "from the built-in synthetic mix" in out and "Model " not in out  # no calibration in smoke
    rows = _rows(out.split("Left 2K tokens per rank, right 32K per pack:")[1].split("dp x cp over")[0])
    assert [r[0] for r in rows] == ["8", "16"]
    for _, pick, eff, ovl, mb, gather, host, fixed_pick, fixed_eff, fixed_ovl, fixed_mb, plan in rows:
        # the pick is at least as fast as the best all-gather, and hiding its traffic never slows it
        assert 0 < float(gather) <= float(eff) <= float(ovl) <= 1.0, pick
        assert 0 < float(fixed_eff) <= float(fixed_ovl) <= 1.0, fixed_pick
        assert float(mb) > 0 and float(fixed_mb) > 0 and float(plan) >= 0
        assert all(float(ms) >= 0 for ms in host.split(" / "))
        assert {pick.split()[0], fixed_pick.split()[0]} <= {"dcs", "bal", "nlb"}
    dp = _rows(out.split("dp x cp over 16 GPUs")[1])
    assert [r[0] for r in dp] == ["1 x 16", "2 x 8"]
    assert dp[0][4] == "1.000" and float(dp[1][4]) <= 1  # cut packs keep at most one group's attention
    assert list(tmp_path.iterdir()) == [] and (ROOT / "BENCHMARKS.md").read_bytes() == before


def test_cpu_smoke_writes_its_section(tmp_path):
    output = tmp_path / "BENCHMARKS.md"
    output.write_text("# Benchmarks\n\n## Other (benchmarks/other.py)\n\nkept\n")
    run = run_script("--cpu-smoke", "--output", str(output), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    text = output.read_text()
    assert "## Other (benchmarks/other.py)\n\nkept\n" in text
    assert text.count("## Scale on paper (benchmarks/scale.py)") == 1


def test_full_mode_needs_the_length_file(tmp_path):
    run = run_script("--doclens", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2 and "--doclens must hold prolong.json (or use --cpu-smoke)" in run.stderr

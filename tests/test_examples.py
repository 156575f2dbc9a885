"""The example scripts' command lines, run as a user runs them (subprocesses, a few seconds each).

Nothing is imported from ``examples/``: the scripts are run, the way a newcomer meets them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import cpcompile

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_packed.py"
DEMO = ROOT / "examples" / "cp_attention_demo.py"
TRAIN_HF = ROOT / "examples" / "train_hf.py"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
TORCHRUN_2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def run_example(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run an example with this checkout's cpcompile first on the path and no torchrun variables but ``env``."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        capture_output=True,  # stdout is a pipe, as in CI logs
        text=True,
        timeout=180,
    )


def test_help_names_no_path_outside_the_repository():
    run = run_example(str(TRAIN), "--help")
    assert run.returncode == 0, run.stderr
    assert "../shared" not in run.stdout
    assert "--doclens FILE" in run.stdout and "upper_bound_tokens,cumulative_percent" in run.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--strategy", "foo"], "argument --strategy: invalid choice: 'foo' (choose from 'dual_chunk_swap', "),
        (["--inner", "foo"], "--inner: inner must be 'inductor', 'aot_eager', another registered backend"),
    ],
)
def test_bad_arguments_fail_before_any_process_group(args, expected):
    # rank 0 of 2 as torchrun starts it: checked after init_process_group, this would wait for rank 1
    run = run_example(str(TRAIN), *args, env=TORCHRUN_2)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("train_packed.py: error: ") and expected in lines[-1]
    assert len(lines) < 10 and "Traceback" not in run.stderr


def test_without_torchrun_says_how_to_start_it():
    run = run_example(str(TRAIN), "--steps", "1")
    assert run.returncode == 1
    assert run.stderr.strip() == (
        "train_packed.py: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: this example runs one process "
        "per CP rank; start it with torchrun --nproc-per-node 2 examples/train_packed.py"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_env() -> dict[str, str]:
    """What torchrun sets for a world of one process."""
    return {**TORCHRUN_2, "WORLD_SIZE": "1", "MASTER_PORT": str(free_port())}


def test_progress_is_one_line_per_step_in_a_log(tmp_path):
    # one rank (no torchrun needed), a CDF length file, the eager inner compiler: a few seconds;
    # the default dual_chunk_swap, whose padding one rank must not get (the backend leaves cp=1 alone)
    cdf = tmp_path / "lengths.csv"
    cdf.write_text("upper_bound_tokens,cumulative_percent\n32,50\n256,100\n")
    env = one_rank_env()
    args = ["--steps", "3", "--tokens", "256", "--inner", "eager", "--no-check", "--doclens", str(cdf)]
    run = run_example(str(TRAIN), *args, env=env)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stdout
    steps = [line for line in run.stdout.splitlines() if " step " in line]
    assert [line.split(" step ")[1].split()[0] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(line.startswith("cp=1 dual_chunk_swap auto") for line in steps)


@pytest.mark.distributed
def test_demo_runs_every_strategy():
    run = run_example(str(DEMO), "--tokens", "512")
    assert run.returncode == 0, run.stderr
    rows = [line.split()[0] for line in run.stdout.splitlines()[2:-1]]
    assert rows == [s.value for s in cpcompile.Strategy]
    assert "auto -> " in run.stdout


@pytest.mark.parametrize("loss", ["fused", "hf"])
def test_hf_main_job_reports_rates_and_compiles_its_layer_once(loss):
    # one rank (no torchrun needed), each decoder layer compiled on its own, the eager inner compiler
    args = ["--steps", "5", "--layers", "3", "--regional", "--inner", "eager", "--loss", loss]
    run = run_example(str(TRAIN_HF), *args, env=one_rank_env())
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/5", "5/5"]
    assert "compiled" in lines[0] and "tok/s per GPU" in lines[1]
    assert lines[-1] == "compiled graphs: 1 over 5 packs"


def test_hf_main_job_without_torchrun_says_how_to_start_it():
    run = run_example(str(TRAIN_HF), "--steps", "1")
    assert run.returncode == 1 and "start it with torchrun --nproc-per-node 2 examples/train_hf.py" in run.stderr


TRAIN_TRAINER = ROOT / "examples" / "train_trainer.py"
TRAIN_SFT = ROOT / "examples" / "train_sft.py"


def _logged_losses(stdout: str) -> list[str]:
    """The Trainer's per-step log lines (rank 0 prints them as dicts)."""
    return [line for line in stdout.splitlines() if line.startswith("{'loss'")]


@pytest.mark.distributed
def test_trainer_example_trains_at_cp2_with_one_graph(tmp_path):
    pytest.importorskip("accelerate", reason='needs the trainers extra: pip install "cpcompile[trainers]"')
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    args = ["--steps", "3", "--inner", "eager", "--docs-per-pack", "4", "--output-dir", str(tmp_path)]
    run = run_example(*torchrun, str(TRAIN_TRAINER), *args)
    assert run.returncode == 0, run.stderr
    assert len(_logged_losses(run.stdout)) == 3, run.stdout
    assert run.stdout.splitlines()[-1] == "compiled graphs: 1"


def test_sft_example_trains_on_one_process(tmp_path):
    pytest.importorskip("trl", reason='needs the trainers extra: pip install "cpcompile[trainers]"')
    args = ["--steps", "2", "--inner", "eager", "--docs-per-pack", "4", "--output-dir", str(tmp_path)]
    run = run_example(str(TRAIN_SFT), *args)
    assert run.returncode == 0, run.stderr
    assert len(_logged_losses(run.stdout)) == 2 and "'mean_token_accuracy'" in run.stdout, run.stdout

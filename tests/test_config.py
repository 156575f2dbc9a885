"""The defaults the environment seeds, in one module (``cpcompile.config``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cpcompile
from cpcompile.config import DEFAULTS, Defaults, _from_environment


def test_the_defaults_are_the_specs_and_the_backends():
    assert DEFAULTS == Defaults(kernel=None, kv="auto", kv_chunks=1, tp_comm="symm_mem")  # the test runs unseeded
    spec = cpcompile.StrategySpec()
    assert (spec.kernel, spec.kv, spec.kv_chunks) == (DEFAULTS.kernel, DEFAULTS.kv, DEFAULTS.kv_chunks)
    assert "Config" not in cpcompile.__all__


def test_environment_seeds_the_defaults_once_with_errors_that_name_the_variable():
    env = {"CPCOMPILE_KERNEL": "reference", "CPCOMPILE_KV": "all_gather", "CPCOMPILE_KV_CHUNKS": "2"}
    assert _from_environment(env) == Defaults(kernel="reference", kv="all_gather", kv_chunks=2)
    assert _from_environment({"CPCOMPILE_KERNEL": ""}) == Defaults()
    for variable, value, message in (
        ("CPCOMPILE_KV_CHUNKS", "two", "kv_chunks must be an int >= 1, got 'two'"),
        ("CPCOMPILE_KV_EXCHANGE", "always", "no longer read; use CPCOMPILE_KV"),
        ("CPCOMPILE_KV_CHUNKS", "0", "kv_chunks must be an int >= 1"),
        ("CPCOMPILE_TP_COMM", "p3p", "tp_comm must be one of"),
        ("CPCOMPILE_KERNEL", "x", "kernel must be one of"),
        ("CPCOMPILE_KV", "heads", r"kv must be one of \('auto', 'all_gather', 'exchange', 'ring'\)"),  # u: a spec's
    ):
        with pytest.raises(ValueError, match=f"environment variable {variable}='{value}': {message}"):
            _from_environment({variable: value})


def test_a_seeded_default_reaches_the_spec_and_a_bad_one_fails_at_import():
    code = "import cpcompile; print(cpcompile.StrategySpec().kv, cpcompile.StrategySpec().kernel)"
    for env, out in (({"CPCOMPILE_KV": "ring", "CPCOMPILE_KERNEL": "reference"}, "ring reference"),):
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip() == out, run.stderr
    env = {"CPCOMPILE_KV": "sometimes", "PATH": ""}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # the import's ValueError, not a crash (a signal, an abort)
    assert "terminate called" not in run.stderr
    assert "environment variable CPCOMPILE_KV='sometimes': kv must be one of" in run.stderr


def test_the_backend_takes_tp_comm_alone():
    with pytest.raises(ValueError, match=r"tp_comm must be one of \('symm_mem', 'p2p'\), got 'nccl'"):
        cpcompile.backend(tp_comm="nccl")
    for removed in ("comm", "config"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{removed}'"):
            cpcompile.backend(**{removed: None})


def test_no_other_module_reads_the_environment():
    import pathlib

    package = pathlib.Path(cpcompile.__file__).parent
    readers = [p.relative_to(package) for p in package.rglob("*.py") if "os.environ" in p.read_text()]
    assert [str(p) for p in readers] == ["config.py"]

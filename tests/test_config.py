"""The typed configuration and how the environment seeds it (``cpcompile.config``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cpcompile
from cpcompile.config import Config, _from_environment, default_config, resolve_config


def test_defaults_and_validation():
    assert Config() == Config(kernel=None, kv_exchange="auto", kv_chunks=1, tp_comm="symm_mem")
    assert resolve_config(None) is default_config()
    for field, value, message in (
        ("kernel", "fa9", r"kernel must be one of \(None, 'reference', 'flash', 'cudnn', 'fa4', 'auto'\), got 'fa9'"),
        ("kv_exchange", "sometimes", "kv_exchange must be one of .*got 'sometimes'"),
        ("kv_chunks", 0, "kv_chunks must be an int >= 1, got 0"),
        ("kv_chunks", "2", "kv_chunks must be an int >= 1, got '2'"),
        ("tp_comm", "nvshmem", "tp_comm must be one of .*got 'nvshmem'"),
    ):
        with pytest.raises(ValueError, match=message):
            Config(**{field: value})
    with pytest.raises(TypeError, match="config must be a cpcompile.Config or None, got dict"):
        resolve_config({"kernel": "reference"})


def test_environment_seeds_the_defaults_once_with_errors_that_name_the_variable():
    env = {"CPCOMPILE_KERNEL": "reference", "CPCOMPILE_KV_EXCHANGE": "never", "CPCOMPILE_KV_CHUNKS": "2"}
    assert _from_environment(env) == Config(kernel="reference", kv_exchange="never", kv_chunks=2)
    assert _from_environment({"CPCOMPILE_KERNEL": ""}) == Config()
    for variable, value in (("CPCOMPILE_KV_CHUNKS", "two"), ("CPCOMPILE_TP_COMM", "p3p"), ("CPCOMPILE_KERNEL", "x")):
        with pytest.raises(ValueError, match=f"environment variable {variable}='{value}'"):
            _from_environment({variable: value})


def test_a_bad_variable_fails_at_import():
    code = "import cpcompile"
    env = {"CPCOMPILE_KV_EXCHANGE": "sometimes", "PATH": ""}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # the import's ValueError, not a crash (a signal, an abort)
    assert "terminate called" not in run.stderr
    assert "environment variable CPCOMPILE_KV_EXCHANGE='sometimes': kv_exchange must be one of" in run.stderr


def test_backend_takes_a_config():
    with pytest.raises(TypeError, match="config must be a cpcompile.Config"):
        cpcompile.backend(config="reference")

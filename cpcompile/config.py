"""Typed configuration of the ops: which kernel, how K/V travel, how TP rings move chunks.

A :class:`Config` is passed in (``cpcompile.backend(config=...)``,
``cp_attention(..., config=...)``) and reaches the ops as arguments, so a compiled graph
holds its values as constants: a graph compiled under one configuration is never run
under another, and nothing an op does depends on the process environment.

Environment variables only seed :func:`default_config`, read once, when this module is
first imported, and validated then (a bad value is an error naming the variable):
``CPCOMPILE_KERNEL``, ``CPCOMPILE_KV_EXCHANGE``, ``CPCOMPILE_KV_CHUNKS``,
``CPCOMPILE_TP_COMM``; ``CPCOMPILE_VALIDATE=1`` is a debug switch for the checks that read
tensor values on CUDA (:data:`VALIDATE`). This is the one module that reads the environment.
"""

from __future__ import annotations

import dataclasses
import os

#: Attention kernels (``cpcompile.kernels``); ``None`` picks by what is installed.
KERNELS = ("reference", "flash", "cudnn", "fa4", "auto")
#: K/V for the all-gather comm: exchange only the rows read where it pays, always, or never.
KV_EXCHANGE = ("auto", "always", "never")
#: How the TP overlap's rings move chunks on CUDA with NCCL (``cpcompile.comm.ring``).
TP_COMMS = ("symm_mem", "p2p")


@dataclasses.dataclass(frozen=True)
class Config:
    """How the CP and TP ops run; every field is validated on construction.

    - ``kernel``: one of :data:`KERNELS`, or ``None``: on CUDA fp16/bf16 ``auto`` where
      cudnn-frontend is installed, else ``fa4`` where FlashAttention-4 is, else ``flash``;
      the exact ``reference`` elsewhere.
    - ``kv_exchange``: one of :data:`KV_EXCHANGE` (``comm="all_gather"`` only).
    - ``kv_chunks``: K/V head groups whose all-gathers are pipelined with attention
      (lowered to a divisor of the K/V head count; 1: one collective each of K and V).
    - ``tp_comm``: one of :data:`TP_COMMS`.
    """

    kernel: str | None = None
    kv_exchange: str = "auto"
    kv_chunks: int = 1
    tp_comm: str = "symm_mem"

    def __post_init__(self) -> None:
        _check_choice("kernel", self.kernel, (None, *KERNELS))
        _check_choice("kv_exchange", self.kv_exchange, KV_EXCHANGE)
        _check_choice("tp_comm", self.tp_comm, TP_COMMS)
        if not isinstance(self.kv_chunks, int) or isinstance(self.kv_chunks, bool) or self.kv_chunks < 1:
            raise ValueError(f"kv_chunks must be an int >= 1, got {self.kv_chunks!r}")


def _check_choice(name: str, value: object, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {accepted}, got {value!r}")


def _from_environment(env: dict[str, str]) -> Config:
    """The defaults as the environment seeds them; errors name the variable."""
    fields = {
        "kernel": ("CPCOMPILE_KERNEL", lambda s: s or None),
        "kv_exchange": ("CPCOMPILE_KV_EXCHANGE", str),
        "kv_chunks": ("CPCOMPILE_KV_CHUNKS", int),
        "tp_comm": ("CPCOMPILE_TP_COMM", str),
    }
    values = {}
    for field, (variable, parse) in fields.items():
        if variable in env:
            try:
                values[field] = parse(env[variable])
                Config(**{field: values[field]})
            except ValueError as e:
                raise ValueError(f"environment variable {variable}={env[variable]!r}: {e}") from None
    return Config(**values)


_DEFAULT = _from_environment(dict(os.environ))
#: ``CPCOMPILE_VALIDATE=1``: also run the checks that read tensor values (and the cross-rank
#: agreement) where they cost a host sync, i.e. on CUDA. A debug switch, read once.
VALIDATE = os.environ.get("CPCOMPILE_VALIDATE", "0") == "1"


def default_config() -> Config:
    """The configuration used where none is passed: :class:`Config`'s defaults, as seeded by
    the environment when cpcompile was imported."""
    return _DEFAULT


def resolve_config(config: Config | None) -> Config:
    if config is None:
        return _DEFAULT
    if not isinstance(config, Config):
        raise TypeError(f"config must be a cpcompile.Config or None, got {type(config).__name__}")
    return config

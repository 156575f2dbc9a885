"""The accepted values of the user's choices, and the defaults the environment seeds.

Every choice of how CP runs lives in one object, :class:`cpcompile.StrategySpec` (the layout,
how K/V move, the kernel, ...), set for a compiled model by ``with cpcompile.strategy(...)``;
TP's transport is the backend's (``cpcompile.backend(tp_comm=...)``). Their values reach the
ops as arguments, so a compiled graph holds them as constants, guarded on the spec: a graph
compiled under one choice is never run under another, and nothing an op does depends on the
process environment.

Environment variables only seed the defaults (:data:`DEFAULTS`), read once, when this module
is first imported, and validated then (a bad value is an error naming the variable):
``CPCOMPILE_KERNEL``, ``CPCOMPILE_KV``, ``CPCOMPILE_KV_CHUNKS``, ``CPCOMPILE_TP_COMM`` (the removed
``CPCOMPILE_KV_EXCHANGE`` raises, naming ``CPCOMPILE_KV``: :data:`REMOVED`);
``CPCOMPILE_VALIDATE=1`` is a debug switch for the checks that read tensor values on CUDA
(:data:`VALIDATE`). This is the one module that reads the environment.
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: Attention kernels (``cpcompile.kernels``); ``None`` picks by what is installed.
KERNELS = ("reference", "flash", "cudnn", "fa4", "auto")
#: How CP attention moves K/V (``StrategySpec.kv``): ``"auto"`` all-gathers, or exchanges only the
#: rows read where that pays; ``"all_gather"`` and ``"exchange"`` always do the one; ``"ring"``
#: passes K/V blocks around the ring; ``"heads"`` splits heads over ``head_parallel`` ranks.
KV = ("auto", "all_gather", "exchange", "ring", "heads")
#: How the TP overlap's rings move chunks on CUDA with NCCL (``cpcompile.comm.ring``).
TP_COMMS = ("symm_mem", "p2p")


def check_choice(name: str, value: object, accepted: tuple) -> object:
    """``value``, or ``ValueError`` naming ``name``, the value and what is accepted."""
    if value not in accepted:
        raise ValueError(f"{name} must be one of {accepted}, got {value!r}")
    return value


def check_kv_chunks(value: object) -> int:
    """``value``, or ``ValueError`` naming ``kv_chunks`` and what is accepted (an int >= 1)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"kv_chunks must be an int >= 1, got {value!r}")
    return value


class Defaults(NamedTuple):
    """The defaults of ``StrategySpec.kernel``, ``.kv`` and ``.kv_chunks`` and of ``backend(tp_comm=...)``."""

    kernel: str | None = None
    kv: str = "auto"
    kv_chunks: int = 1
    tp_comm: str = "symm_mem"


#: Variables cpcompile no longer reads, and what took their place: set, they raise rather than be ignored.
REMOVED = {"CPCOMPILE_KV_EXCHANGE": "CPCOMPILE_KV (one of 'auto', 'all_gather', 'exchange', 'ring')"}


def _int(text: str) -> int | str:
    """``text`` as an int, or itself (for the check to refuse, naming what is accepted)."""
    try:
        return int(text)
    except ValueError:
        return text


def _from_environment(env) -> Defaults:
    """The defaults as ``env`` seeds them; errors name the variable. ``"heads"`` is no default of
    ``kv``: it needs ``head_parallel``, a spec's."""
    for variable, instead in REMOVED.items():
        if variable in env:
            raise ValueError(f"environment variable {variable}={env[variable]!r}: no longer read; use {instead}")
    default_kvs = tuple(kv for kv in KV if kv != "heads")
    fields = {
        "kernel": ("CPCOMPILE_KERNEL", lambda s: check_choice("kernel", s or None, (None, *KERNELS))),
        "kv": ("CPCOMPILE_KV", lambda s: check_choice("kv", s, default_kvs)),
        "kv_chunks": ("CPCOMPILE_KV_CHUNKS", lambda s: check_kv_chunks(_int(s))),
        "tp_comm": ("CPCOMPILE_TP_COMM", lambda s: check_choice("tp_comm", s, TP_COMMS)),
    }
    values = {}
    for field, (variable, parse) in fields.items():
        if variable in env:
            try:
                values[field] = parse(env[variable])
            except ValueError as e:
                raise ValueError(f"environment variable {variable}={env[variable]!r}: {e}") from None
    return Defaults(**values)


#: What a :class:`cpcompile.StrategySpec` and ``cpcompile.backend`` take where not told, as the
#: environment seeded it when cpcompile was imported.
DEFAULTS = _from_environment(os.environ)
#: ``CPCOMPILE_VALIDATE=1``: also run the checks that read tensor values (and the cross-rank
#: agreement) where they cost a host sync, i.e. on CUDA. A debug switch, read once.
VALIDATE = os.environ.get("CPCOMPILE_VALIDATE", "0") == "1"

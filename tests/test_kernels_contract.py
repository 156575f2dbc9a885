"""Tier 1: every backend states the kernel contract's signatures (no GPU needed).

The GPU backends import without CUDA or cudnn-frontend, so their signatures are
checked here; what they compute is checked in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from cpcompile import kernels
from cpcompile.kernels import contract, reference


def _parameters(function, skip: int = 0):
    """Name, kind and default of each parameter: what a caller's arguments bind to."""
    parameters = list(inspect.signature(function).parameters.values())[skip:]
    return [(p.name, p.kind, p.default) for p in parameters]


@pytest.mark.parametrize("name", kernels.KERNELS)
def test_every_backend_has_the_contracts_signatures(name):
    backend = importlib.import_module(f"cpcompile.kernels.{name}")
    assert isinstance(backend, contract.AttentionKernel)
    for function in ("forward", "backward"):
        want = _parameters(getattr(contract.AttentionKernel, function), skip=1)  # less ``self``
        assert _parameters(getattr(backend, function)) == want, (name, function)


def test_backward_takes_known_options_and_rejects_others():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    pieces, kw = (cu, cu[:-1], cu[1:] - cu[:-1]), {"causal": True, "scale": 0.5}
    out, lse = reference.forward(q, q, q, *pieces, **kw)
    plain = reference.backward(q, q, q, q, out, lse, *pieces, **kw)
    with_option = reference.backward(q, q, q, q, out, lse, *pieces, pack_keys=6, **kw)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_option))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['pack_key'\]; backend options are"):
        reference.backward(q, q, q, q, out, lse, *pieces, pack_key=6, **kw)

"""Every backend states the kernel contract's signatures, and every plan keeps the contract's promises.

The GPU backends import without CUDA or cudnn-frontend, so their signatures are
checked here; what they compute is checked in tests/kernels/test_accuracy.py.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import cpcompile
from cpcompile import kernels
from cpcompile.kernels import contract, reference
from cpcompile.plan.ring import make_ring_plan


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
    # the call's pieces and the gradients' destination travel whole: the parameters stay few
    names = ["q", "k", "v", "pieces", "causal", "scale", "window", "softcap", "sinks"]
    assert [p[0] for p in _parameters(backend.forward)] == names


def test_backward_takes_known_options_and_rejects_others():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    pieces, kw = contract.Pieces(cu, cu[:-1], cu[1:] - cu[:-1]), {"causal": True, "scale": 0.5}
    out, lse = reference.forward(q, q, q, pieces, **kw)
    plain = reference.backward(q, q, q, q, out, lse, pieces, **kw)
    with_option = reference.backward(q, q, q, q, out, lse, pieces, pack_keys=6, **kw)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_option))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['pack_key'\]; backend options are"):
        reference.backward(q, q, q, q, out, lse, pieces, pack_key=6, **kw)


def test_pieces_bound_launches_by_the_buffers_rows():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q, k = torch.empty(5, 1, 4), torch.empty(9, 1, 4)
    assert contract.Pieces(cu, cu[:-1], cu[1:] - cu[:-1]).bounds(q, k) == (5, 9)
    assert contract.Pieces(cu, cu[:-1], cu[1:] - cu[:-1], max_q=3, max_k=20).bounds(q, k) == (3, 9)


def test_key_grads_take_both_buffers_or_neither():
    dk = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match="dk and dv together"):
        contract.KeyGrads(dk=dk)
    into = contract.KeyGrads(torch.arange(4).flip(0), dk, torch.zeros_like(dk))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q = torch.randn(4, 2, 2)
    pieces, kw = contract.Pieces(cu, cu[:-1], cu[1:] - cu[:-1]), {"causal": True, "scale": 0.5}
    out, lse = reference.forward(q, q[:, :1], q[:, :1], pieces, **kw)
    _, want_dk, want_dv = reference.backward(q, q, q[:, :1], q[:, :1], out, lse, pieces, **kw)
    _, got_dk, got_dv = reference.backward(q, q, q[:, :1], q[:, :1], out, lse, pieces, grads=into, **kw)
    assert got_dk is into.dk and got_dv is into.dv
    assert torch.equal(got_dk, want_dk.flip(0)) and torch.equal(got_dv, want_dv.flip(0))


def test_every_plan_reads_disjoint_or_same_start_key_ranges():
    """The contract the scratch layers rely on, for every strategy, all-gather and ring."""
    cu = torch.tensor([0, 1, 700, 829, 2877, 2941], dtype=torch.int32)
    specs = [
        "dual_chunk_swap",
        "no_load_balance",
        "balanced",
        cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, stripe_size=16),
    ]
    for spec, cp, causal in ((s, cp, c) for s in specs for cp in (2, 4) for c in (True, False)):
        padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
        for rank in range(cp):
            plan = cpcompile.plan.make_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
            ring = make_ring_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
            blocks = [(plan.k_start, plan.k_len(causal)), *zip(ring.k_start, ring.k_len(causal))]
            for k_start, k_len in blocks:
                ranges = [(a, a + n) for a, n in zip(k_start.tolist(), k_len.tolist()) if n > 0]
                for a0, a1 in ranges:
                    assert all(b0 == a0 or a1 <= b0 or b1 <= a0 for b0, b1 in ranges), (spec, cp, rank)


def test_sinks_given_to_the_kernel_equal_sinks_applied_after_it():
    """A kernel given ``sinks`` returns what ``kernels.sinks.apply`` makes of its plain ``(out, lse)``, rows
    of no key included (out 0, lse the sink's logit): what the ops rely on when they hand sinks down."""
    from cpcompile.kernels import sinks as kernel_sinks

    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    k_len = torch.tensor([3, 0, 4], dtype=torch.int32)  # the second piece sees no key
    pieces = contract.Pieces(torch.tensor([0, 3, 5, 9], dtype=torch.int32), cu[:-1], k_len)
    sinks = torch.randn(4, dtype=torch.float64, generator=g)
    kw = {"causal": False, "scale": 0.3}
    want = kernel_sinks.apply(*reference.forward(q, k, v, pieces, **kw), sinks)
    got = reference.forward(q, k, v, pieces, sinks=sinks, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not got[0][3:5].any() and torch.equal(got[1][:, 3:5], sinks[:, None].expand(4, 2))

"""``cp_attention`` on real gloo processes against a float64 single-device reference.

One spawn per world size runs every strategy, causal and not, GQA and MHA, on both K/V
paths, and the other checks of that world size: process start-up is the expensive part,
so cases share it.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import cpcompile
from tests.dist import run_ranks
from tests.fixtures import KINDS, SOFTCAPS, VALUE_DIMS, attention_case, doc_lengths, random_pack, strategy_specs
from tests.reference import attention_fp64, attention_fp64_on_rank, relative_error

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
# auto included: shard_batch resolves it and records the pick; cp_attention resolves it again, alike on every rank
SPECS = strategy_specs(stripe_size=4)


def _check_rank(rank: int, world: int, choice: dict) -> None:
    """Every spec of :data:`SPECS` with ``choice`` (how attention runs: ``kv``, ``kv_chunks``) on top."""
    for case, (spec, causal, (hq, hkv)) in enumerate(
        (s, c, h) for s in SPECS for c in (True, False) for h in ((4, 2), (2, 2))
    ):
        if hq == hkv and not causal:
            continue  # MHA once per strategy is enough; GQA covers both masks
        dv = VALUE_DIMS[case % len(VALUE_DIMS)]  # each layout with every value head dim
        softcap = SOFTCAPS[case % 2]  # and with soft-capping and without
        cu, _, q, k, v, dout = attention_case(doc_lengths(world, case), hq, hkv, 8, dv=dv, seed=case)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        spec = dataclasses.replace(spec, **choice)
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        ref, *ref_grads = attention_fp64_on_rank(cu, sharded, tensors, causal=causal, softcap=softcap)
        local = {name: sharded.tensors[name].clone().requires_grad_() for name in ("q", "k", "v")}
        out = cpcompile.cp_attention(
            local["q"],
            local["k"],
            local["v"],
            cu,
            cu_seqlens_padded=sharded.cu_seqlens_padded,
            strategy=sharded,
            causal=causal,
            softcap=softcap,
        )
        grads = torch.autograd.grad(out, list(local.values()), sharded.tensors["dout"])
        label = f"rank {rank}/{world} {spec} causal={causal} heads={hq}/{hkv} dv={dv} softcap={softcap}"
        assert relative_error(out, ref) < TOLERANCE, f"out {label}"
        for name, got, want in zip("qkv", grads, ref_grads):
            assert relative_error(got, want) < TOLERANCE, f"d{name} {label}"
        # unshard puts every rank's rows back in physical order
        assert torch.equal(cpcompile.unshard(out.detach(), sharded), _gathered_reference(out.detach(), sharded))


def _gathered_reference(local: torch.Tensor, sharded) -> torch.Tensor:
    """Physical-order buffer built from all ranks' rows with plain all_gather (independent of unshard)."""
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(sharded.cp_size)]
    dist.all_gather(parts, local)
    out = torch.empty((local.shape[0] * sharded.cp_size, *local.shape[1:]), dtype=local.dtype)
    for r, part in enumerate(parts):
        idx = cpcompile.layouts.partition_indices(
            sharded.cu_seqlens_padded, cp_size=sharded.cp_size, rank=r, strategy=sharded.spec
        )
        out[idx] = part
    return out


def _masks_share_a_plan(rank: int, world: int, choice: dict) -> None:
    """A causal and a full layer on one plan, in both orders: they read different keys, so their
    backwards write different rows of the same kept dK/dV buffers (all-gather) or exchange
    different rows (float64 reference on one device)."""
    cu = torch.tensor([0, 3, 24, 32], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(32, 2, 8, generator=g) for _ in range(4))
    spec = cpcompile.StrategySpec(cpcompile.Strategy.NO_LOAD_BALANCE, **choice)  # no padding: physical = global rows
    sharded = cpcompile.shard_batch({"q": q, "k": k, "v": v, "dout": dout}, cu, cp_size=world, rank=rank, strategy=spec)
    plan = cpcompile.plan.make_plan(cu, sharded.cu_seqlens_padded, cp_size=world, rank=rank, strategy=spec)
    for causal_first in (True, False):
        local = [sharded.tensors[name].clone().requires_grad_() for name in "qkv"]
        kw = {"strategy": sharded, "plan": plan}
        x = cpcompile.cp_attention(*local, cu, causal=causal_first, **kw)
        out = cpcompile.cp_attention(x, *local[1:], cu, causal=not causal_first, **kw)
        grads = torch.autograd.grad(out, local, sharded.tensors["dout"])
        full = [t.double().requires_grad_() for t in (q, k, v)]
        y = attention_fp64(*full, cu, causal=causal_first)
        ref_grads = torch.autograd.grad(attention_fp64(y, *full[1:], cu, causal=not causal_first), full, dout.double())
        for name, got, want in zip("qkv", grads, ref_grads):
            label = f"d{name} causal first: {causal_first} {spec}"
            assert relative_error(got, want[sharded.indices]) < TOLERANCE, label


def _ranks_that_read_nothing(rank: int, world: int) -> None:
    """Packs where some ranks hold only padding (their pieces read no key), through the
    sparse exchange: those ranks still take part, with zero gradients for their rows."""
    cases = [("no_load_balance", [1]), ("no_load_balance", [2]), ("balanced", [1]), ("dual_chunk_swap", [1, 1, 1])]
    for case, (name, lengths) in enumerate(cases):
        spec = cpcompile.StrategySpec(cpcompile.Strategy(name))
        cu, _, q, k, v, dout = attention_case(lengths, 4, 2, 8, seed=case)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        for causal in (True, False):
            sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
            local = [sharded.tensors[n].clone().requires_grad_() for n in "qkv"]
            out = cpcompile.cp_attention(
                *local, cu, cu_seqlens_padded=sharded.cu_seqlens_padded, strategy=sharded, causal=causal
            )
            grads = torch.autograd.grad(out, local, sharded.tensors["dout"])
            want, *want_grads = attention_fp64_on_rank(cu, sharded, tensors, causal=causal)
            label = f"rank {rank}/{world} {name} {lengths} causal={causal}"
            assert relative_error(out, want) < TOLERANCE, f"out {label}"
            for n, got, w in zip("qkv", grads, want_grads):
                assert relative_error(got, w) < TOLERANCE, f"d{n} {label}"


def check_compiled_variant(rank: int, world: int, spec, *, window=None, overlap_kv=False, heads=(4, 2)) -> None:
    """``packed_attention`` with values of their own head dim (12 over keys of 8) and soft-capping, compiled
    under ``spec`` (its ``kv``: all-gather, exchange, ring, head-parallel, hybrid; ``window``: a sliding
    window), against float64 at this rank's rows: the pass carries both to the CP op it makes."""

    def attend(q, k, v, cu, m):
        return cpcompile.packed_attention(q, k, v, cu, max_seqlen=m, window_size=window, softcap=1.5)

    cu, _, q, k, v, dout = attention_case(doc_lengths(world, 7), *heads, 8, dv=12, seed=7, dtype=torch.float64)
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
    torch._dynamo.reset()
    backend = cpcompile.backend(inner="aot_eager", overlap_kv=overlap_kv)
    compiled = torch.compile(attend, backend=backend, dynamic=True, fullgraph=True)
    local = [sharded.tensors[n].clone().requires_grad_() for n in "qkv"]
    with cpcompile.strategy(sharded):
        out = compiled(*local, cu, int((cu[1:] - cu[:-1]).max()))
    got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
    want = attention_fp64_on_rank(cu, sharded, tensors, causal=True, window=window, softcap=1.5)
    label = f"compiled rank {rank}/{world} {spec} window={window} overlap_kv={overlap_kv}"
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(a, b) < 1e-10, f"{name} {label}"


def _every_case(rank: int, world: int, kv_env: str) -> None:
    """Both K/V paths forced, the all-gather and the sparse exchange of the rows that are read: ``kv_env``
    through the environment the ranks imported cpcompile with, the other through the spec."""
    assert cpcompile.config.DEFAULTS.kv == cpcompile.StrategySpec().kv == kv_env
    other = {"kv": "exchange" if kv_env == "all_gather" else "all_gather"}
    for choice in ({}, other):
        _check_rank(rank, world, choice)
    # compiled, values of their own head dim and soft-capping: every path but the heads' (tests/attention/test_heads.py)
    spec = cpcompile.StrategySpec
    check_compiled_variant(rank, world, spec("dual_chunk_swap", kv="exchange"))
    check_compiled_variant(rank, world, spec("balanced", kv="exchange"), window=(3, 0))
    check_compiled_variant(rank, world, spec("striped", stripe_size=2, kv="ring"), window=(2, 0))
    check_compiled_variant(rank, world, spec("no_load_balance", kv="all_gather"), overlap_kv=True)
    check_compiled_variant(rank, world, spec("balanced", kv="exchange"), window=(3, 0), overlap_kv=True)
    if world == 2:
        # the K/V gather pipelined over two head groups (opt-in)
        _check_rank(rank, world, {"kv": "all_gather", "kv_chunks": 2})
        for choice in ({}, other):
            _masks_share_a_plan(rank, world, choice)
    else:
        _ranks_that_read_nothing(rank, world)  # through the exchange, from the environment


def _parts_through_the_exchange(rank: int, world: int) -> None:
    """The exchange's backward on a kernel arranged as FA4 (``tests.emulated``, float64), whose
    parts are its layers' rows in place (one or two layers: no_load_balance, balanced and
    dual_chunk_swap) or the copies' rows, not the one layer of a whole dK/dV that the reference
    gives: own parts and returned sums added per local row, other ranks' rows sent. Fixed packs
    with one-token and empty documents and ranks holding only padding, then a random pack of
    every kind (``tests.fixtures.KINDS``, one seeded generator: every rank draws the same)."""
    from cpcompile import kernels
    from cpcompile.kernels import varlen
    from cpcompile.kernels.metadata import order
    from tests import emulated

    kernel = emulated.fa4()
    kernels.select = lambda *args, **kw: kernel  # this spawned process's own module
    order.ROWS = 4  # forward entries in chunks of 4 rows
    rng = random.Random(world)
    cases = [[1, 13, 1, 7, 2], [0, 9, 1], [2, 0, 1], [23]] + [random_pack(rng, world, kind) for kind in KINDS]
    for copies, (case, lengths), name, causal in itertools.product(
        (False, True), enumerate(cases), ("balanced", "no_load_balance", "dual_chunk_swap"), (True, False)
    ):
        varlen.IN_PLACE_LAYERS = varlen.IN_PLACE_LAYERS_GQA = 0 if copies else 2
        hq, hkv = (4, 2) if causal else (2, 2)
        spec = cpcompile.StrategySpec(cpcompile.Strategy(name), kv="exchange")
        dv, softcap = VALUE_DIMS[case % len(VALUE_DIMS)], SOFTCAPS[copies]  # FA4 runs both
        cu, _, q, k, v, dout = attention_case(lengths, hq, hkv, 8, dv=dv, seed=case)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        local = [sharded.tensors[n].double().requires_grad_() for n in "qkv"]
        kw = {"cu_seqlens_padded": sharded.cu_seqlens_padded, "strategy": sharded, "causal": causal}
        out = cpcompile.cp_attention(*local, cu, softcap=softcap, **kw)
        grads = torch.autograd.grad(out, local, sharded.tensors["dout"].double())
        want, *want_grads = attention_fp64_on_rank(cu, sharded, tensors, causal=causal, softcap=softcap)
        label = f"rank {rank}/{world} {name} {lengths} causal={causal} copies={copies} dv={dv} softcap={softcap}"
        assert relative_error(out, want) < TOLERANCE, f"out {label}"
        for n, got, w in zip("qkv", grads, want_grads):
            assert relative_error(got, w) < TOLERANCE, f"d{n} {label}"


@pytest.mark.parametrize("world", [2, 4])
def test_kernel_parts_through_the_exchange_match_fp64_reference(world):
    run_ranks(_parts_through_the_exchange, world)


@pytest.mark.parametrize(("world", "kv_env"), [(2, "all_gather"), (3, "exchange")])
def test_cp_attention_matches_fp64_reference(world, kv_env, monkeypatch):
    monkeypatch.setenv("CPCOMPILE_KV", kv_env)  # spawned ranks inherit it
    run_ranks(_every_case, world, kv_env)

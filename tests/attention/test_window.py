"""Sliding-window cp_attention on real gloo processes, against float64 with a dense window mask.

One spawn per world size (2, 3) runs every layout with windows ``(w, 0)`` and ``(w, w)``
over the all-gather, the sparse exchange and the ring, in float64, on packs with 1-token
documents, documents shorter than the window and one spanning every rank, then seeded random
cases (:func:`random_cases`: every pack kind of ``tests.fixtures.KINDS``, windows of 0, 1, a
few tokens and longer than the documents); forward and every gradient are checked against
``tests.reference.attention_fp64`` with the window's dense mask (built independently of
``cpcompile.plan.window``). The same spawn checks that the exchange moves fewer rows under a
window, that bad windows fail before any communication, and that a compiled model calling
``varlen_attn`` with windows equals one device.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.batch import physical_positions
from cpcompile.plan.exchange import exchange_plan
from cpcompile.plan.pieces import step_plan
from cpcompile.plan.window import window_keys
from cpcompile.testing import VARLEN_GQA
from tests.dist import run_ranks
from tests.fixtures import KINDS, SOFTCAPS, VALUE_DIMS, attention_case, doc_lengths, random_pack, strategy_specs
from tests.reference import assert_attention_matches, attention_fp64, attention_fp64_on_rank

EXACT = 1e-10  # float64 throughout: only the summation order differs
WINDOWS = [(3, 0), (2, 2), (0, 1)]
#: ``StrategySpec.kv``: the all-gather, the sparse exchange, the ring
PATHS = ["all_gather", "exchange", "ring"]


def _run(sharded, cu, spec, window, kv, softcap=None):
    local = [sharded.tensors[name].clone().requires_grad_() for name in "qkv"]
    with cpcompile.strategy(sharded, kv=kv, kernel="reference"):  # the batch's layout and rows
        out = cpcompile.cp_attention(
            *local, cu, cu_seqlens_padded=sharded.cu_seqlens_padded, causal=False, window_size=window, softcap=softcap
        )
    return [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]


#: every layout, balanced evening the work of windowed and global layers (``StrategySpec.windows``), and
#: auto weighing them (resolved by the loader and, from the same spec, by the attention's plan ops)
TOLD = [StrategySpec(Strategy.BALANCED, windows=(3, -1)), StrategySpec(Strategy.AUTO, windows=(3, -1))]
SPECS = [*strategy_specs(stripe_size=2, auto=False), *TOLD]


def _check_rank(rank: int, world: int) -> None:
    for case, spec in enumerate(SPECS):
        lengths = doc_lengths(world, case)
        dv, softcap = VALUE_DIMS[case % len(VALUE_DIMS)], SOFTCAPS[case % 2]
        cu, _, q, k, v, dout = attention_case(lengths, 4, 2, 8, dv=dv, seed=case, dtype=torch.float64)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        for window in WINDOWS:
            want = attention_fp64_on_rank(cu, sharded, tensors, causal=False, window=window, softcap=softcap)
            for kv in PATHS:
                got = _run(sharded, cu, spec, window, kv, softcap)
                label = f"rank {rank}/{world} {spec} window={window} kv={kv} dv={dv} softcap={softcap}"
                assert_attention_matches(got, want, EXACT, label, dtype=torch.float64)
    _check_random_packs(rank, world)
    _check_exchange_rows(rank, world)
    _check_bad_windows(world)
    _check_compiled(rank, world)


#: window sides drawn by the random cases: none, 0, 1, a few tokens, longer than any document
SIDES = (-1, 0, 1, 3, 100)


def random_cases(cp: int, seed: int, count: int = 48):
    """Seeded cases (every rank draws the same): ``(spec, kv, window, lengths, seed)`` over
    every layout and path, each pack kind of ``tests.fixtures.KINDS`` in turn, window sides cycling
    through :data:`SIDES` (left) and drawn from them (right)."""
    rng = random.Random(seed)
    specs, paths = [*strategy_specs(), *TOLD], [*PATHS, "auto"]
    for i in range(count):
        window = (SIDES[i % len(SIDES)], rng.choice(SIDES))
        pack = random_pack(rng, cp, KINDS[i % len(KINDS)])
        yield rng.choice(specs), rng.choice(paths), window, pack, rng.randrange(1 << 30)


def _check_random_packs(rank: int, world: int) -> None:
    """Random packs of every kind (1-token documents, one document, one token per rank, zero-length
    documents, many documents), random windows, every layout and path: float64-exact."""
    for spec, kv, window, lengths, seed in random_cases(world, 2000 + world):
        dv, softcap = (None, 8)[seed % 2], SOFTCAPS[seed // 2 % 2]  # each in half the cases
        cu, _, q, k, v, dout = attention_case(lengths, 2, 1, 4, dv=dv, seed=seed, dtype=torch.float64)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
        got = _run(sharded, cu, sharded.spec, window, kv, softcap)
        want = attention_fp64_on_rank(cu, sharded, tensors, causal=False, window=window, softcap=softcap)
        label = f"rank {rank}/{world} {spec} window={window} kv={kv} dv={dv} softcap={softcap} docs {lengths}"
        assert_attention_matches(got, want, EXACT, label, dtype=torch.float64)


def _windowed_model(q, k, v, cu_seqlens, max_seqlen):
    """Two layers as a model writes them with varlen_attn: a sliding window, then a local one."""
    o = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(3, 0), **VARLEN_GQA)
    return varlen_attn(o, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(2, 2), **VARLEN_GQA)


def _model_fp64(tensors, cu, padded):
    """:func:`_windowed_model` on one device, in float64 with dense window masks (varlen_attn has no CPU kernel)."""
    q, k, v = (tensors[name].double().requires_grad_() for name in "qkv")
    o = attention_fp64(q, k, v, cu, causal=True, window=(3, 0), cu_seqlens_padded=padded)
    out = attention_fp64(o, k, v, cu, causal=False, window=(2, 2), cu_seqlens_padded=padded)
    return [out, *torch.autograd.grad(out, (q, k, v), tensors["dout"].double())]


def _check_compiled(rank: int, world: int) -> None:
    """A compiled model calling varlen_attn with windows equals one device, one compilation for packs of
    any composition, under every layout."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_windowed_model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
    for spec in ("dual_chunk_swap", SPECS[-1]):
        for seed in range(2):
            lengths = doc_lengths(world, 10 + seed)
            cu, _, q, k, v, dout = attention_case(lengths, 4, 2, 8, seed=seed)
            tensors = {"q": q, "k": k, "v": v, "dout": dout}
            with cpcompile.strategy(spec):
                sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank)
                local = [sharded.tensors[name].clone().requires_grad_() for name in "qkv"]
                out = compiled(*local, cu, max(lengths))
                got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
            whole = _model_fp64(_physical(tensors, cu, sharded), cu, sharded.cu_seqlens_padded)
            want = [t[sharded.indices] for t in whole]
            assert_attention_matches(got, want, 1e-5, f"compiled, rank {rank}/{world} {spec} seed {seed}")
    assert counters["stats"]["unique_graphs"] <= 2, counters["stats"]  # one per strategy


def _physical(tensors, cu, sharded):
    """The pack's tensors at their padded positions (zeros between), for the reference on the padded pack."""
    phys = physical_positions(cu, sharded.cu_seqlens_padded)
    n = int(sharded.cu_seqlens_padded[-1])
    return {name: t.new_zeros((n, *t.shape[1:])).index_copy_(0, phys, t) for name, t in tensors.items()}


def _check_exchange_rows(rank: int, world: int) -> None:
    """A window's exchange receives only the rows within its pieces' windows: fewer than causal's."""
    cu = torch.tensor([0, 40 * world], dtype=torch.int32)  # one long document: causal reads its prefix
    plan = step_plan(cu, None, 40 * world, world, rank, "no_load_balance", 1)
    received = {}
    for window in ((-1, 0), (2, 0)):
        k_start, k_len, _ = window_keys(*plan.pieces, window)
        ex = exchange_plan(
            plan.gather_index, k_start, k_len, plan.cu_seqlens, plan.cu_seqlens_padded, window, "0", "always"
        )
        received[window] = sum(ex.recv_counts)
    # no_load_balance: rank r reads all of ranks < r causally, and 2 rows of rank r - 1 with the window
    assert received == {(-1, 0): 40 * rank, (2, 0): 2 * min(rank, 1)}, received


def _check_bad_windows(world: int) -> None:
    q = torch.randn(4, 2, 4, dtype=torch.float64)
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)
    cases = [
        ((-2, 0), ValueError, r"window_size left must be -1 \(unbounded\) or >= 0, got \(-2, 0\)"),
        ((1,), TypeError, r"window_size must be a \(left, right\) pair of ints, got \(1,\)"),
        ((1.5, 0), TypeError, r"left = 1.5"),
    ]
    for window, error, message in cases:
        with pytest.raises(error, match=message):
            cpcompile.cp_attention(q, q, q, cu, causal=False, window_size=window)
    with pytest.raises(ValueError, match=r"causal=True needs window_size with right = 0, got \(2, 2\)"):
        cpcompile.cp_attention(q, q, q, cu, window_size=(2, 2))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_window_attention_matches_fp64(world):
    run_ranks(_check_rank, world)


def test_random_cases_cover_the_edge_cases():
    """The cases do hold what ``_check_random_packs`` promises, at every cp tested."""
    for cp in (2, 3):
        drawn = list(random_cases(cp, 2000 + cp))
        packs = [lengths for *_, lengths, _ in drawn]
        windows = [window for _, _, window, _, _ in drawn]
        assert any(len(p) == 1 for p in packs) and any(0 in p for p in packs) and any(sum(p) <= cp for p in packs)
        assert any(all(n == 1 for n in p) and len(p) > 1 for p in packs)
        assert {0, 1, 100} <= {w[0] for w in windows} and {0, 1, 100} <= {w[1] for w in windows}
        assert any(w[1] == 0 and w[0] >= 0 for w in windows) and any(w[0] >= 0 and w[1] > 0 for w in windows)

"""Attention under CP is told its layout and whose rows it gets, or refuses, on every rank.

Attention reads only a rank's rows and the pack's ``cu_seqlens``. Rows laid out by another layout or for
another rank, with the same token count, would attend wrongly without an error; so under CP there is no
default layout, and attention must know what the rows were laid out for: ``with cpcompile.strategy(batch)``
(or ``strategy=batch``) gives it as a value, which no copy of the offsets loses; anything else is refused
(offsets alone say nothing of whose rows they describe). Random packs and random copies of a sharded
batch's tensors, with and without the block, at cp 2-4: each call is exact against float64, or refused on
every rank.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

import cpcompile
from tests.dist import run_ranks
from tests.fixtures import KINDS, attention_case, random_pack
from tests.reference import attention_fp64_on_rank, relative_error

EXACT = 1e-9  # float64 throughout

#: How a loader or a user may copy ``cu_seqlens`` on its way to the model ("none" keeps the tensor).
COPIES = {
    "none": lambda t: t,
    "clone": lambda t: t.clone(),
    "to": lambda t: t.to(torch.int64).to(torch.int32),
    "numpy": lambda t: torch.from_numpy(np.array(t.numpy())),
    "list": lambda t: torch.tensor(t.tolist(), dtype=torch.int32),
    "worker": lambda t: pickle.loads(pickle.dumps(t)),  # a DataLoader worker handing back the tensor alone
}
#: How the call is told the layout: a block with the batch, with its spec only, ``strategy=batch``, nothing.
TOLD = ("block(batch)", "block(spec)", "argument(batch)", "argument(spec)", "nothing")


def _outcome(told: str, copy: str, other_rank: bool) -> str | None:
    """The error a call must raise (a regex), or ``None`` where it must be exact."""
    if told == "nothing":
        return "cp_attention has no layout"
    if told.endswith("(batch)"):
        return "laid out for rank" if other_rank else None
    return "cannot tell which rank's rows it got"


def _call(sharded, cu, told, *, causal):
    local = [sharded.tensors[n].clone().requires_grad_() for n in "qkv"]
    kw = {"cu_seqlens_padded": sharded.cu_seqlens_padded, "causal": causal}
    if told == "argument(batch)":
        kw["strategy"] = sharded
    elif told == "argument(spec)":
        kw["strategy"] = sharded.spec
    block = {"block(batch)": sharded, "block(spec)": sharded.spec}.get(told)
    if block is None:
        out = cpcompile.cp_attention(*local, cu, **kw)
    else:
        with cpcompile.strategy(block):
            out = cpcompile.cp_attention(*local, cu, **kw)
    return [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]


def _random_calls(rank: int, world: int) -> None:
    rng = random.Random(54 + world)  # the same cases on every rank
    specs = ["balanced", "dual_chunk_swap", "striped", "no_load_balance"]
    for case in range(14):
        lengths = random_pack(rng, world, rng.choice(KINDS))
        spec, causal = cpcompile.StrategySpec(rng.choice(specs)), rng.random() < 0.7
        copy, told = rng.choice(list(COPIES)), rng.choice(TOLD)
        other_rank = rng.random() < 0.3  # another rank's batch: a loader's mistake
        cu, _, q, k, v, dout = attention_case(lengths, 2, 1, 4, seed=case, dtype=torch.float64)
        tensors = {"q": q, "k": k, "v": v, "dout": dout}
        holder = (rank + 1) % world if other_rank else rank
        sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=holder, strategy=spec)
        label = f"rank {rank}/{world} {lengths} {spec.strategy.value} copy={copy} told={told} other={other_rank}"
        expected = _outcome(told, copy, other_rank)
        if expected is None:
            got = _call(sharded, COPIES[copy](sharded.cu_seqlens), told, causal=causal)
            want = attention_fp64_on_rank(cu, sharded, tensors, causal=causal)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert relative_error(a, b) < EXACT, f"{name} {label}"
        else:  # every rank refuses: its own error, or the other rank's named
            with pytest.raises(ValueError, match=f"{expected}|rank [0-9] rejected its arguments"):
                _call(sharded, COPIES[copy](sharded.cu_seqlens), told, causal=causal)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_copies_are_exact_or_refused_on_every_rank(world):
    run_ranks(_random_calls, world)


def _reported_cases(rank: int, world: int) -> None:
    """The silent-wrong cases found by probes: the block not entered and the offsets cloned; one rank's
    batch on another, offsets cloned; each eager and compiled."""
    lengths = [5, 2, 1, 9]
    cu, _, q, k, v, dout = attention_case(lengths, 2, 1, 4, seed=0, dtype=torch.float64)
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    batch = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy="balanced")
    other = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=1 - rank, strategy="balanced")

    def model(q, k, v, cu):
        return cpcompile.packed_attention(q, k, v, cu, cu_seqlens_padded=batch.cu_seqlens_padded)

    compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
    local = [batch.tensors[n] for n in "qkv"]
    # 1. no block: the default layout would be read over balanced's rows
    with pytest.raises(ValueError, match="cp_attention has no layout"):
        cpcompile.cp_attention(*local, batch.cu_seqlens.clone(), cu_seqlens_padded=batch.cu_seqlens_padded)
    with pytest.raises(Exception, match="has no layout"):  # compile time: Dynamo wraps the backend's error
        compiled(*local, batch.cu_seqlens.clone())
    # 2. the other rank's batch, its offsets cloned: refused given the batch, or given only its layout
    theirs = [other.tensors[n] for n in "qkv"]
    refused = r"laid out for rank \d, but this is rank|rank \d rejected its arguments"
    unknown = "cannot tell which rank's rows it got|rank \\d rejected its arguments"
    with cpcompile.strategy(other):
        with pytest.raises(ValueError, match=refused):
            cpcompile.cp_attention(*theirs, other.cu_seqlens.clone(), cu_seqlens_padded=other.cu_seqlens_padded)
        with pytest.raises(ValueError, match=refused):
            compiled(*theirs, other.cu_seqlens.clone())
    with cpcompile.strategy(other.spec):
        with pytest.raises(ValueError, match=unknown):
            cpcompile.cp_attention(*theirs, other.cu_seqlens.clone(), cu_seqlens_padded=other.cu_seqlens_padded)
        with pytest.raises(ValueError, match=unknown):
            compiled(*theirs, other.cu_seqlens.clone())
    # and exact with the rank's own batch, given as a value, its offsets cloned
    want = attention_fp64_on_rank(cu, batch, tensors, causal=True)[0]
    with cpcompile.strategy(batch):
        got = compiled(*local, batch.cu_seqlens.clone())
        assert relative_error(got, want) < EXACT
        got = cpcompile.cp_attention(*local, batch.cu_seqlens.clone(), cu_seqlens_padded=batch.cu_seqlens_padded)
        assert relative_error(got, want) < EXACT


@pytest.mark.distributed
def test_reported_silent_cases_are_refused_on_every_rank():
    run_ranks(_reported_cases, 2)


def test_uncompiled_model_on_a_rank_share_is_refused():
    """``packed_attention`` (what ``attn_implementation="cpcompile"`` calls) not made context-parallel by the
    backend, on one rank's share of a CP batch: refused, even where the share's padded rows equal the pack's
    real tokens (lengths [5, 2, 1] at cp=2 under dual_chunk_swap), where the row count cannot tell."""
    cu = torch.tensor([0, 5, 7, 8], dtype=torch.int32)
    batch = cpcompile.shard_batch({"x": torch.randn(8, 2, 4)}, cu, cp_size=2, rank=0, strategy="dual_chunk_swap")
    x = batch.tensors["x"]
    assert x.shape[0] == int(cu[-1])  # the count check alone would pass it
    with cpcompile.strategy(batch), pytest.raises(ValueError, match="packed_attention ran single-device"):
        cpcompile.packed_attention(x, x, x, batch.cu_seqlens)
    with cpcompile.strategy(batch.spec):  # a block given the layout learns the batch sharded in it
        learned = cpcompile.shard_batch({"x": x}, cu, cp_size=2, rank=0)
        with pytest.raises(ValueError, match="packed_attention ran single-device"):
            cpcompile.packed_attention(x, x, x, learned.cu_seqlens)
    with pytest.raises(ValueError, match="packed_attention ran single-device"):  # the op itself, as a graph runs it
        with cpcompile.strategy(batch):
            torch.ops.cpcompile.packed_attention(x, x, x, cu, None, None, True, None)
    whole = cpcompile.shard_batch({"x": torch.randn(8, 2, 4)}, cu, cp_size=1, rank=0, strategy="dual_chunk_swap")
    with cpcompile.strategy(whole):  # one rank holds the whole pack: single-device attention is exact
        cpcompile.packed_attention(whole.tensors["x"], whole.tensors["x"], whole.tensors["x"], whole.cu_seqlens)
    # copied offsets in a block that learned the batch: refused too; a reference over the whole pack runs
    cu11 = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    with cpcompile.strategy("balanced"):
        share = cpcompile.shard_batch({"x": torch.randn(11, 2, 4)}, cu11, cp_size=2, rank=1)
        y = share.tensors["x"]
        with pytest.raises(ValueError, match="packed_attention ran single-device on q of 6 rows"):
            cpcompile.packed_attention(y, y, y, cu11.clone(), cu_seqlens_padded=share.cu_seqlens_padded)
        full = torch.randn(11, 2, 4)
        cpcompile.packed_attention(full, full, full, cu11.clone())

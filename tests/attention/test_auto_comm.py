"""``auto`` decided with communication at run time: ``shard_batch(..., strategy="auto", topology=..., heads=...)``.

On 4 gloo ranks, each case shards one pack with ``auto`` given a topology (and for some the heads, or a ``kv``
that fixes the path), then runs ``cp_attention`` under the batch. Every rank must hold the same decision, made
without communication, equal to :func:`cpcompile.cost.timing.decide`'s (or :func:`~cpcompile.cost.timing.resolve`'s
where the path is fixed); attention must run it (the bytes its collectives move are the decision's,
``cost.comm.layer_bytes``) and match the float64 reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile.cost.comm import Heads, layer_bytes
from cpcompile.cost.timing import ASSUMED_HEADS, H200, SEQUENCE_PATHS, decide, parse_topology, resolve
from tests.advisor.test_comm_model import Received
from tests.dist import run_ranks
from tests.fixtures import attention_case
from tests.reference import attention_fp64_on_rank, relative_error

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
LENGTHS = [300, 5, 17, 1, 90, 40, 2, 61]
HEADS = Heads(8, 2, 8, 4)  # float32
#: links so fast that compute alone decides (another layout and path than over H200's NVLink)
FREE = dataclasses.replace(H200, intra_gbps=1e9, call_us=0.0, intra_latency_us=0.0)
#: (requested, heads given, topology, the decide() arguments the choice must match, or None: resolve's alone)
CASES = [
    ("auto", None, H200, dict(heads=ASSUMED_HEADS, paths=SEQUENCE_PATHS)),
    ("auto", HEADS, FREE, dict(heads=HEADS)),
    ("auto", HEADS, "h200,gpus_per_node=2", dict(heads=HEADS, topology=parse_topology("h200,gpus_per_node=2"))),
    (cpcompile.StrategySpec("auto", kv="ring"), None, H200, None),
    (cpcompile.StrategySpec("auto", kv="heads", head_parallel=2), HEADS, H200, None),
]


def _run_cases(rank: int, world: int) -> None:
    kinds = set()
    with pytest.MonkeyPatch.context() as monkeypatch:
        received = Received(monkeypatch)
        for requested, heads, topology, decided in CASES:
            cu, _, q, k, v, dout = attention_case(LENGTHS, HEADS.q, HEADS.kv, HEADS.dim)
            tensors = {"q": q, "k": k, "v": v, "dout": dout}
            batch = cpcompile.shard_batch(
                tensors, cu, cp_size=world, rank=rank, strategy=requested, heads=heads, topology=topology
            )
            label = f"rank {rank} {requested} heads={heads} {topology}: {batch.spec}"
            specs = [None] * world
            dist.all_gather_object(specs, batch.spec)
            assert all(s == batch.spec for s in specs), f"ranks decided differently: {specs}"
            assert batch.spec == resolve(requested, cu, cp_size=world, heads=heads, topology=topology), label
            if decided is not None:
                assert batch.spec == decide(cu, cp_size=world, **{"topology": topology, **decided}).spec, label
            assert batch.sharded_for.requested == batch.spec, "the batch runs the decision, its path included"
            kinds.add((batch.spec.kv, batch.spec.head_parallel))
            ref, *ref_grads = attention_fp64_on_rank(cu, batch, tensors, causal=True)
            local = [batch.tensors[n].clone().requires_grad_() for n in "qkv"]
            received.take()
            out = cpcompile.cp_attention(*local, cu, cu_seqlens_padded=batch.cu_seqlens_padded, strategy=batch)
            grads = torch.autograd.grad(out, local, batch.tensors["dout"])
            moved = received.take()
            assert relative_error(out, ref) < TOLERANCE, f"out {label}"
            for name, got, want in zip("qkv", grads, ref_grads):
                assert relative_error(got, want) < TOLERANCE, f"d{name} {label}"
            if batch.spec.kv != "ring":  # the ring's point-to-point steps are not counted here
                want = layer_bytes(cu, cp_size=world, strategy=batch.spec, heads=HEADS)
                assert moved == int(want.total[rank]), f"attention ran another path than {label}"
    # the cases reach attention on several paths: the sparse exchange, the all-gather, the ring, the hybrid
    assert {("exchange", 1), ("all_gather", 1), ("ring", 1), ("heads", 2)} <= kinds, kinds


def test_auto_decides_with_communication_alike_on_every_rank_and_attention_runs_it():
    run_ranks(_run_cases, 4)


def test_bad_topology_and_heads_are_refused_before_anything():
    cu, _, q, *_ = attention_case(LENGTHS)
    tensors = {"q": q}
    with pytest.raises(ValueError, match="topology must start with one of"):
        cpcompile.shard_batch(tensors, cu, cp_size=2, rank=0, strategy="auto", topology="h100")
    with pytest.raises(ValueError, match=r"topology must be a cpcompile.cost.timing.Topology"):
        cpcompile.shard_batch(tensors, cu, cp_size=2, rank=0, strategy="auto", topology=8)
    with pytest.raises(ValueError, match=r"heads must be Heads"):
        cpcompile.shard_batch(tensors, cu, cp_size=2, rank=0, strategy="balanced", heads=8)
    with pytest.raises(ValueError, match="head parallelism is weighed only given the heads"):
        spec = cpcompile.StrategySpec("auto", kv="heads", head_parallel=2)
        cpcompile.shard_batch(tensors, cu, cp_size=2, rank=0, strategy=spec, topology="h200")

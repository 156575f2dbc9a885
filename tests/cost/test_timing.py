"""The step-time model (``cpcompile.cost.timing``): its per-peer bytes against the communication
model's totals and, for the ring, against what the ring's point-to-point steps receive on gloo; its
phase times over a topology by hand; and its compute and overlap rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.cost import predict_rank_costs, timing
from cpcompile.cost.comm import Heads, Phase, check_heads, layer_bytes, peer_bytes
from cpcompile.cost.model import auto_candidates, resolve_auto
from cpcompile.cost.timing import (
    ASSUMED_HEADS,
    H200,
    SEQUENCE_PATHS,
    KernelSpeed,
    Topology,
    _phase_us,
    decide,
    evaluate,
    layer_terms,
    option_name,
    options,
    parse_topology,
    predict_time,
    resolve,
    ring_step_tiles,
)
from cpcompile.layouts.balanced import causal_tiles
from cpcompile.plan.ring import make_ring_plan
from tests.advisor.test_comm_model import CASES, LENGTHS
from tests.dist import run_ranks
from tests.fixtures import attention_case, cu_seqlens

RING = StrategySpec(Strategy.DUAL_CHUNK_SWAP, kv="ring")


@pytest.mark.parametrize("spec, heads, path", CASES)
@pytest.mark.parametrize("kv", ["auto", "all_gather"])
def test_peer_bytes_add_up_to_layer_bytes(spec, heads, path, kv):
    cu = cu_seqlens(LENGTHS)
    spec = spec if spec.kv == "heads" else dataclasses.replace(spec, kv=kv)
    layer = peer_bytes(cu, cp_size=4, strategy=spec, heads=heads)
    want = layer_bytes(cu, cp_size=4, strategy=spec, heads=heads)
    names = {"all-to-all": "heads", "all-to-all + all-gather": "hybrid"}
    assert layer.path == names.get(want.path, want.path)
    for passes, total in (("forward", want.forward), ("backward", want.backward)):
        got = [sum(sum(p.recv[r]) for p in layer.phases if p.direction == passes) for r in range(4)]
        assert got == total.tolist(), (spec, passes)
    assert all(p.recv[r][r] == 0 for p in layer.phases for r in range(4))  # nothing from itself


def _count_ring(rank: int, world: int) -> None:
    """What each ring step's receive brings this rank, forward and backward, against the model's."""
    heads = Heads(4, 2, 8)
    with pytest.MonkeyPatch.context() as monkeypatch:
        received = [0]
        batch_isend_irecv = torch.distributed.batch_isend_irecv

        def counted(ops):
            received[0] += sum(op.tensor.nbytes for op in ops if op.op is torch.distributed.irecv)
            return batch_isend_irecv(ops)

        monkeypatch.setattr(torch.distributed, "batch_isend_irecv", counted)
        cu, _, q, k, v, dout = attention_case(LENGTHS, heads.q, heads.kv, heads.dim, dtype=torch.bfloat16)
        batch = cpcompile.shard_batch(
            {"q": q, "k": k, "v": v, "dout": dout}, cu, cp_size=world, rank=rank, strategy=RING
        )
        local = [batch.tensors[n].clone().requires_grad_() for n in "qkv"]
        out = cpcompile.cp_attention(*local, cu, cu_seqlens_padded=batch.cu_seqlens_padded, strategy=batch)
        forward, received[0] = received[0], 0
        torch.autograd.grad(out, local, batch.tensors["dout"])
        layer = peer_bytes(cu, cp_size=world, strategy=RING, heads=heads)
        assert layer.path == "ring"
        want = [sum(sum(p.recv[rank]) for p in layer.phases if p.direction == s) for s in ("forward", "backward")]
        assert [forward, received[0]] == want, f"rank {rank}: {[forward, received[0]]} against {want}"
        assert {s for p in layer.phases for s, n in enumerate(p.recv[rank]) if n} == {(rank - 1) % world}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ring_bytes_are_what_the_ring_receives(world):
    run_ranks(_count_ring, world)


def test_phase_times_by_hand():
    topo = Topology(gpus_per_node=2, intra_gbps=100, inter_gbps=10, intra_latency_us=1, inter_latency_us=5, call_us=7)
    mb = 10**6  # 1 MB at 100 GB/s is 10 us, at 10 GB/s 100 us
    a2a = [[0, mb, 2 * mb, 0], [0] * 4, [0] * 4, [0] * 4]
    # rank 0: 1 MB from rank 1 on its node, 2 MB from rank 2 on the other: the NIC's 200 us
    assert _phase_us(Phase("forward", "all-to-all", a2a), 0, topo) == pytest.approx(7 + 5 + 200)
    assert _phase_us(Phase("forward", "all-to-all", a2a), 1, topo) == 0  # receives nothing
    gather = [[0 if s == r else mb for s in range(4)] for r in range(4)]
    # 3 MB over NVLink (30 us), the 2 MB from the other node entering it through 2 NICs (100 us); 3 hops
    assert _phase_us(Phase("forward", "gather", gather, 2), 0, topo) == pytest.approx(2 * (7 + 3 * 5) + 100)
    one_node = dataclasses.replace(topo, gpus_per_node=4)
    assert _phase_us(Phase("forward", "gather", gather), 3, one_node) == pytest.approx(7 + 3 * 1 + 30)
    ring = [[0, 0, 0, 3 * mb], [3 * mb, 0, 0, 0], [0] * 4, [0] * 4]  # 3 steps of 1 MB from the previous rank
    assert _phase_us(Phase("forward", "ring", ring, 3), 0, topo) == pytest.approx(3 * (7 + 5) + 300)
    assert _phase_us(Phase("forward", "ring", ring, 3), 1, topo) == pytest.approx(3 * (7 + 1) + 30)


def test_as_run_is_compute_plus_comm_and_overlapped_their_max():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    heads = Heads(16, 16)
    for spec in ("balanced", "dual_chunk_swap", StrategySpec(Strategy.BALANCED, kv="heads", head_parallel=2)):
        t = predict_time(cu, cp_size=4, strategy=spec, heads=heads)
        assert t.as_run == pytest.approx(max(c + m for c, m in zip(t.compute, t.comm)))
        assert t.overlapped == pytest.approx(max(max(c, m) for c, m in zip(t.compute, t.comm)))
        assert t.overlapped < t.as_run
    # compute: the cost model's tiles at the kernel's speed; no communication at cp=1
    one = predict_time(cu, cp_size=1, strategy="no_load_balance", heads=heads, passes="forward")
    tiles = predict_rank_costs(cu, cp_size=1, strategy="no_load_balance").tiles
    speed = KernelSpeed()
    pieces = 8 * speed.piece_ps * heads.kv
    assert one.compute == [pytest.approx((int(tiles[0]) * speed.forward_ps * heads.q + pieces) / 1e6)]
    assert one.comm == [0.0] and one.received == [0]
    # the token term adds the same to every rank; the backward adds its tiles
    terms = layer_terms(cu, cp_size=4, strategy="balanced", heads=heads)
    plain, mlp = evaluate(terms), evaluate(terms, speed=KernelSpeed(token_ns=1000))
    rows = terms.tokens
    assert [m - p for m, p in zip(mlp.compute, plain.compute)] == pytest.approx([rows * 1.0] * 4)


def test_ring_as_run_waits_for_each_steps_slowest_rank():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    ring = predict_time(cu, cp_size=4, strategy=RING, heads=Heads(8, 8))
    assert ring.path == "ring"
    # each step waits for its slowest rank, so the ring is no faster than its busiest rank's compute
    assert ring.as_run >= max(ring.compute)
    slow = predict_time(cu, cp_size=4, strategy=RING, heads=Heads(8, 8), topology=Topology(intra_gbps=0.01))
    assert slow.as_run > ring.as_run  # a slow link is not hidden


def test_inter_node_links_cost_more_and_the_model_is_deterministic():
    cu = cu_seqlens([30000, 400, 7, 9000, 1, 2600, 50000, 120])
    heads = Heads(32, 8)
    kw = {"cp_size": 16, "strategy": "dual_chunk_swap", "heads": heads}
    one_node = predict_time(cu, topology=dataclasses.replace(H200, gpus_per_node=16), **kw)
    two = predict_time(cu, **kw)
    assert two.as_run > one_node.as_run and two.received == one_node.received
    again = predict_time(cu.clone(), **kw)
    assert again == two  # same floats, bit for bit


def test_parse_topology():
    assert parse_topology("h200") == H200
    assert parse_topology("h200,inter_gbps=25,gpus_per_node=4") == dataclasses.replace(
        H200, inter_gbps=25.0, gpus_per_node=4
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("dgx", r"topology must start with one of \['h200', 'h200-200g', 'h200-4'\], got 'dgx'"),
        ("h200,speed=3", r"topology fields are \[.*'inter_gbps'.*\] as field=value, got 'speed=3'"),
        ("h200,inter_gbps=fast", "topology field inter_gbps needs a number, got 'fast'"),
        ("h200,inter_gbps=0", "Topology.inter_gbps must be a number > 0, got 0.0"),
        ("h200,gpus_per_node=0", "gpus_per_node must be"),
    ],
)
def test_bad_topologies_name_themselves(text, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(text)


def test_bad_arguments():
    cu = cu_seqlens([64])
    with pytest.raises(ValueError, match="passes must be one of"):
        predict_time(cu, cp_size=2, strategy="balanced", heads=Heads(4, 4), passes="backward")
    with pytest.raises(ValueError, match="KernelSpeed.memory_gbps must be a number > 0"):
        KernelSpeed(memory_gbps=0)


def test_decide_takes_the_lowest_layer_as_run_first_on_ties():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    heads = Heads(8, 2, 64)
    decision = decide(cu, cp_size=4, heads=heads)
    assert decision.options == options(4, heads)
    names = [option_name(o, 4) for o in decision.options]
    assert names[:4] == [f"{s} all-gather" for s in ("no_load_balance", "dual_chunk_swap", "striped_128", "balanced")]
    assert names[4:12] == [n.replace("all-gather", p) for p in ("exchange", "ring") for n in names[:4]]
    assert names[12:] == [n.replace("all-gather", "hybrid u=2") for n in names[:4]] + ["no_load_balance heads u=4"]
    steps = [t.as_run for t in decision.times]
    assert decision.spec == decision.options[steps.index(min(steps))]
    want = predict_time(cu, cp_size=4, strategy=decision.spec, heads=heads)
    assert decision.time == want
    # restricted paths; one rank has one option
    assert {o.kv for o in options(4, heads, ("ring",))} == {"ring"}
    assert option_name(decide(cu, cp_size=1, heads=heads).spec, 1) == "no_load_balance all-gather"
    with pytest.raises(ValueError, match=r"paths must be among .*, got \['tree'\]"):
        options(4, heads, ("tree",))


def test_decide_weighs_communication():
    """Over a link slow enough that bytes decide, the choice receives the fewest bytes on its busiest rank."""
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12, 700, 64])
    heads = Heads(8, 8, 64)
    slow = Topology(intra_gbps=0.001, inter_gbps=0.001, intra_latency_us=0, inter_latency_us=0, call_us=0)
    decision = decide(cu, cp_size=4, heads=heads, topology=slow)
    least = min(max(t.received) for t in decision.times)
    assert max(decision.time.received) == least
    # and over a fast link compute decides: not necessarily the same option
    fast = decide(cu, cp_size=4, heads=heads, topology=dataclasses.replace(slow, intra_gbps=1e6, inter_gbps=1e6))
    assert max(fast.time.compute) == pytest.approx(min(max(t.compute) for t in fast.times), rel=1e-3)


def _decide_on_rank(rank: int, world: int) -> None:
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    picked = decide(cu, cp_size=4, heads=Heads(8, 2, 64), topology=parse_topology("h200,gpus_per_node=2"))
    found = [None] * world
    torch.distributed.all_gather_object(found, (picked.spec, [t.as_run for t in picked.times]))
    assert all(f == found[0] for f in found), f"rank {rank}: {found}"


@pytest.mark.distributed
def test_decide_is_the_same_on_every_rank():
    run_ranks(_decide_on_rank, 2)


def test_ring_step_tiles_match_the_ring_plans():
    """Every rank's tiles per ring step, from one pack, against each rank's ring plan."""
    cu = cu_seqlens([2230, 2026, 39, 92, 190, 147, 2268, 136, 18, 104, 12])
    for cp, causal in ((2, True), (3, True), (4, False)):
        for spec in auto_candidates():
            want = []
            for rank in range(cp):
                plan = make_ring_plan(cu, None, cp_size=cp, rank=rank, strategy=spec)
                n, keys = plan.cu_q.diff().long(), plan.k_len(causal).long()
                tiles = (n + 127) // 128 * ((keys + 127) // 128)
                if causal:
                    tiles[rank] = torch.where(keys[rank] > 0, causal_tiles(n, (keys[rank] - n).clamp(min=0)), 0)
                per_block = tiles.sum(1).tolist()
                want.append([per_block[(rank - i) % cp] for i in range(cp)])
            assert ring_step_tiles(cu, cp, spec, causal) == want, (cp, spec, causal)


def test_resolve_decides_auto_and_keeps_everything_else():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    heads = Heads(8, 2, 64)
    assert resolve("auto", cu, cp_size=4, heads=heads) == decide(cu, cp_size=4, heads=heads).spec
    chosen = resolve(StrategySpec("auto", kernel="reference", kv_chunks=2), cu, cp_size=4, heads=heads)
    assert (chosen.kernel, chosen.kv_chunks) == ("reference", 2)  # decide picks how K/V move, not the kernel
    fixed = StrategySpec(Strategy.DUAL_CHUNK_SWAP, kv="ring")
    assert resolve(fixed, cu, cp_size=4, heads=heads) == fixed
    # windows: the cost model's layout, the topology's sequence path for it, never head parallelism (which
    # attention refuses under windows), even where the links make it the fastest option without windows
    heads, free_calls = Heads(8, 8, 64), dataclasses.replace(H200, call_us=0.0, intra_latency_us=0.0)
    assert decide(cu, cp_size=4, heads=heads, topology=free_calls).spec.head_parallel > 1
    for windows in ((64,), (1024, -1)):
        windowed = StrategySpec(Strategy.AUTO, windows=windows)
        layout = resolve_auto(windowed, cu, cp_size=4)
        for topology in (H200, free_calls):
            picked = resolve(windowed, cu, cp_size=4, heads=heads, topology=topology)
            paths = [dataclasses.replace(layout, kv=kv) for kv in ("all_gather", "exchange", "ring")]
            assert picked == decide(cu, cp_size=4, heads=heads, topology=topology, choices=paths).spec
            assert picked.head_parallel == 1 and picked.kv != "auto"
        ring = resolve(dataclasses.replace(windowed, kv="ring"), cu, cp_size=4, heads=heads)
        assert ring == dataclasses.replace(layout, kv="ring")


def test_resolve_at_one_rank_keeps_the_requested_path():
    cu = cu_seqlens([40, 24])
    for kv in ("ring", "exchange", "all_gather"):
        spec = StrategySpec("auto", kv=kv)
        assert resolve(spec, cu, cp_size=1, heads=Heads(8, 2, 64), topology="h200") == resolve_auto(spec, cu, cp_size=1)


def test_resolve_without_heads_fixed_paths_and_kept_decisions():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    # without heads: the sequence paths at the assumed head shape, u 1
    sequence = decide(cu, cp_size=4, heads=ASSUMED_HEADS, paths=SEQUENCE_PATHS).spec
    assert resolve("auto", cu, cp_size=4) == sequence and sequence.head_parallel == 1
    # a requested kv keeps the path (and heads its u): auto picks the layout for it
    ring = [o for o in options(4, ASSUMED_HEADS) if o.kv == "ring"]
    assert resolve(StrategySpec("auto", kv="ring"), cu, cp_size=4) == decide(cu, cp_size=4, heads=ASSUMED_HEADS,
                                                                              choices=ring).spec  # fmt: skip
    hybrid = resolve(StrategySpec("auto", kv="heads", head_parallel=2), cu, cp_size=4, heads=Heads(8, 2, 64))
    assert (hybrid.kv, hybrid.head_parallel) == ("heads", 2)
    # kept per pack and arguments: the same values again are not decided again, others are
    kept = len(timing._decisions)
    assert resolve("auto", cu.clone(), cp_size=4) == sequence and len(timing._decisions) == kept
    resolve("auto", cu, cp_size=4, topology="h200,gpus_per_node=2")
    assert len(timing._decisions) == kept + 1


@pytest.mark.parametrize(
    ("spec", "kw", "message"),
    [
        (StrategySpec("auto", kv="heads", head_parallel=2), {}, "head parallelism is weighed only given the heads"),
        (StrategySpec("auto", kv="heads", head_parallel=4), {"heads": Heads(2, 2, 8)}, "no such option"),
        ("auto", {"topology": "h100"}, "topology must start with one of"),
        ("balanced", {"topology": 3}, "topology must be a cpcompile.cost.timing.Topology"),
        ("balanced", {"heads": (8,)}, "heads must be Heads"),
    ],
)
def test_resolve_refuses_what_it_cannot_decide(spec, kw, message):
    with pytest.raises(ValueError, match=message):
        resolve(spec, cu_seqlens([40, 24]), cp_size=4, **kw)


def test_value_heads_of_their_own_dimension_move_their_bytes():
    """``Heads.v_dim`` (MLA's value heads): K/V bytes are ``kv x (dim + v_dim)`` per token, and with
    ``v_dim == dim`` every path's bytes are those of ``v_dim=None``."""
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    for spec in options(4, Heads(8, 8, 64)):  # the ring's too: peer_bytes
        same = peer_bytes(cu, cp_size=4, strategy=spec, heads=Heads(8, 8, 64, 2, 64)).phases
        assert same == peer_bytes(cu, cp_size=4, strategy=spec, heads=Heads(8, 8, 64)).phases, spec
    gather = StrategySpec("no_load_balance", kv="all_gather")
    small_v = layer_bytes(cu, cp_size=4, strategy=gather, heads=Heads(8, 8, 64, 2, 32)).forward
    full = layer_bytes(cu, cp_size=4, strategy=gather, heads=Heads(8, 8, 64)).forward
    assert torch.equal(small_v * 4, full * 3)  # (64 + 32) / (64 + 64)
    with pytest.raises(ValueError, match="heads.v_dim must be"):
        check_heads(Heads(8, 8, 64, 2, 0))

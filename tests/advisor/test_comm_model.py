"""The communication model (``cpcompile.advisor.comm_model``) against the bytes that
``cp_attention``'s collectives move on real gloo ranks, and the opt-in choice that weighs them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.advisor.comm_model import Link, candidates_with_heads, choose_spec, comm_pairs, predict_step
from cpcompile.comm import collectives
from cpcompile.cost.comm import Heads, head_parallel_options, layer_bytes
from cpcompile.cost.model import auto_candidates
from tests.dist import run_ranks
from tests.fixtures import attention_case, cu_seqlens


class Received:
    """Counts the bytes this rank receives from the others through every data collective of
    ``cp_attention``: all-to-alls (heads, exchange), all-gathers and reduce-scatters."""

    def __init__(self, monkeypatch):
        self.bytes = 0
        dist = torch.distributed
        all_to_all, gather, scatter = dist.all_to_all_single, collectives._all_gather, collectives._reduce_scatter

        def a2a(out, x, out_splits=None, in_splits=None, group=None, **kw):
            me, size = dist.get_rank(group), dist.get_world_size(group)
            own = out.nbytes // size if out_splits is None else out_splits[me] * out[0].nbytes if len(out) else 0
            self.bytes += out.nbytes - own
            return all_to_all(out, x, out_splits, in_splits, group=group, **kw)

        def all_gather(out, x, group=None, **kw):
            self.bytes += out.nbytes - x.nbytes
            return gather(out, x, group=group, **kw)

        def reduce_scatter(out, x, group=None, **kw):
            self.bytes += (dist.get_world_size(group) - 1) * out.nbytes
            return scatter(out, x, group=group, **kw)

        monkeypatch.setattr(dist, "all_to_all_single", a2a)
        monkeypatch.setattr(collectives, "_all_gather", all_gather)
        monkeypatch.setattr(collectives, "_reduce_scatter", reduce_scatter)

    def take(self) -> int:
        taken, self.bytes = self.bytes, 0
        return taken


#: (spec, heads, the path the model must name): every path, K/V copies (u=4 > Hkv=2) and none
CASES = [
    (StrategySpec(Strategy.DUAL_CHUNK_SWAP), Heads(8, 2, 8), "all-gather"),
    (StrategySpec(Strategy.NO_LOAD_BALANCE), Heads(4, 4, 8), "exchange"),
    (StrategySpec(Strategy.BALANCED), Heads(8, 2, 8), "exchange"),
    (StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=4), Heads(8, 2, 8), "all-to-all"),
    (StrategySpec(Strategy.DUAL_CHUNK_SWAP, kv="heads", head_parallel=4), Heads(4, 4, 8), "all-to-all"),
    (StrategySpec(Strategy.DUAL_CHUNK_SWAP, kv="heads", head_parallel=2), Heads(8, 2, 8), "all-to-all + all-gather"),
    (StrategySpec(Strategy.BALANCED, kv="heads", head_parallel=2), Heads(4, 1, 8), "all-to-all + all-gather"),
]
LENGTHS = [300, 5, 17, 1, 90, 40, 2, 61]


def _count_rank(rank: int, world: int) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        received = Received(monkeypatch)
        for spec, heads, path in CASES:
            cu, _, q, k, v, dout = attention_case(LENGTHS, heads.q, heads.kv, heads.dim, dtype=torch.bfloat16)
            tensors = {"q": q, "k": k, "v": v, "dout": dout}
            batch = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
            local = [batch.tensors[n].clone().requires_grad_() for n in "qkv"]
            received.take()
            out = cpcompile.cp_attention(*local, cu, cu_seqlens_padded=batch.cu_seqlens_padded, strategy=batch)
            forward = received.take()
            torch.autograd.grad(out, local, batch.tensors["dout"])
            backward = received.take()
            want = layer_bytes(cu, cp_size=world, strategy=spec, heads=heads)
            label = f"rank {rank} {spec} {heads}"
            assert want.path == path, label
            assert (forward, backward) == (int(want.forward[rank]), int(want.backward[rank])), label


@pytest.mark.distributed
def test_layer_bytes_are_what_the_collectives_move():
    run_ranks(_count_rank, 4)


def test_layer_bytes_by_hand():
    """cp=8, 32/8 heads of 128 in bf16, 128K tokens: the all-gather, and pure head parallelism's all-to-alls."""
    cu, heads, t_local = cu_seqlens([131072]), Heads(32, 8), 16384
    gather = layer_bytes(cu, cp_size=8, strategy="dual_chunk_swap", heads=heads)
    kv = 7 * t_local * 8 * 128  # K or V elements from the 7 others
    assert gather.path == "all-gather" and gather.forward.tolist() == [2 * kv * 2] * 8
    assert gather.backward.tolist() == [2 * kv * 2 + 2 * kv * 4] * 8
    pure = layer_bytes(
        cu, cp_size=8, strategy=StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=8), heads=heads
    )
    slot = t_local * 7 // 8 * 128  # one head's elements a rank sends away: 7/8 of its tokens
    forward = (32 + 8 + 8 + 32) * slot * 2 + 32 * t_local * 7 // 8 * 4  # q, k, v, out (bf16), lse (float32)
    backward = (32 * 3 + 8 * 2 + 32 + 8 * 2) * slot * 2 + 32 * t_local * 7 // 8 * 4  # dO, q, out, k, v, dq, dk, dv; lse
    assert pure.forward.tolist() == [forward] * 8 and pure.backward.tolist() == [backward] * 8


def test_kv_forces_either_path():
    cu, heads = cu_seqlens([300, 5, 17, 1, 90, 40, 2, 61]), Heads(4, 4, 8)
    never = layer_bytes(cu, cp_size=4, strategy=StrategySpec("balanced", kv="all_gather"), heads=heads)
    always = layer_bytes(cu, cp_size=4, strategy=StrategySpec("dual_chunk_swap", kv="exchange"), heads=heads)
    assert (never.path, always.path) == ("all-gather", "exchange")


def test_head_parallel_options_and_candidates():
    assert head_parallel_options(8, 32) == (2, 4, 8)
    assert head_parallel_options(8, 12) == (2, 4)
    assert head_parallel_options(6, 9) == (3,)
    specs = candidates_with_heads(8, Heads(32, 8))
    assert specs[:4] == auto_candidates()
    assert {s.head_parallel for s in specs} == {1, 2, 4, 8}
    assert [s for s in specs if s.head_parallel == 8] == [
        StrategySpec(Strategy.NO_LOAD_BALANCE, kv="heads", head_parallel=8)
    ]
    assert [s for s in specs if s.head_parallel == 2] == [
        dataclasses.replace(s, kv="heads", head_parallel=2) for s in specs[:4]
    ]


def test_choose_spec_is_the_lowest_step_with_communication_and_deterministic():
    cu = cu_seqlens([3000, 40, 7, 900, 1, 260, 5000, 12])
    heads = Heads(16, 16)
    specs = candidates_with_heads(4, heads)
    steps = [predict_step(cu, cp_size=4, strategy=s, heads=heads).step for s in specs]
    picked = choose_spec(cu, cp_size=4, heads=heads)
    assert picked == specs[steps.index(min(steps))]
    assert all(choose_spec(cu.clone(), cp_size=4, heads=heads) == picked for _ in range(3))
    # ties go to the earlier candidate: a 1-rank group has nothing to move and one layout
    nlb, bal = StrategySpec(Strategy.NO_LOAD_BALANCE), StrategySpec(Strategy.BALANCED)
    assert choose_spec(cu, cp_size=1, heads=heads, candidates=(bal, nlb)) == bal
    # communication counts: at a slow enough link the pure head parallelism's all-to-alls lose to the exchange
    slow = Link(bandwidth_gbps=1)
    assert choose_spec(cu, cp_size=4, heads=heads, link=slow).head_parallel == 1


def test_comm_pairs():
    # a pair is 14 Hq D FLOP: 32 heads of 128 at 330 TFLOP/s take as long as 52.1 bytes at 300 GB/s
    assert comm_pairs(torch.tensor([300 * 14 * 32 * 128]), Heads(32, 8), Link()).item() == 330_000
    assert Link().milliseconds(300_000_000) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(heads=(32,)), r"heads must be Heads\(q, kv, dim=128, itemsize=2, v_dim=None\), got \(32,\)"),
        (dict(heads=Heads(32, 6)), "heads.q=32 must be a multiple of heads.kv=6"),
        (dict(heads=Heads(32, 8, itemsize=3)), "heads.itemsize must be 2, 4 or 8"),
        (
            dict(heads=Heads(6, 6), strategy=StrategySpec(kv="heads", head_parallel=4)),
            "head_parallel=4 must divide the number",
        ),
        (dict(heads=Heads(8, 8), strategy=StrategySpec(kv="ring")), "layer_bytes models every kv but 'ring'"),
    ],
)
def test_bad_arguments_name_themselves(kw, message):
    with pytest.raises(ValueError, match=message):
        layer_bytes(cu_seqlens([64]), cp_size=4, **{"strategy": "no_load_balance", **kw})

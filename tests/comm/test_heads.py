"""Head-parallel bookkeeping: K/V replication and the head-parallel plan, on one process.

The all-to-alls themselves run on real ranks (``tests/attention/test_heads.py``).
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.comm.heads import kv_replication, replicate, sum_replicas
from cpcompile.cost.model import resolve_auto
from cpcompile.layouts.partition import pad_for_cp
from cpcompile.plan import make_plan
from cpcompile.plan.pieces import head_step_plan, make_head_plan
from tests.fixtures import LAYOUT_SPECS, cu_seqlens


@pytest.mark.parametrize(
    "hq, hkv, u, f",
    [(8, 8, 4, 1), (8, 4, 4, 1), (8, 2, 4, 2), (8, 1, 8, 8), (4, 1, 2, 2), (12, 6, 4, 2), (6, 2, 3, 3), (32, 8, 8, 1)],
)
def test_kv_replication_is_the_least_that_splits(hq, hkv, u, f):
    assert kv_replication(hq, hkv, u) == f
    heads = hkv * f
    group, per_rank = hq // heads, heads // u
    for rank in range(u):
        # rank's query heads read, through the copies, exactly the K/V heads GQA gives them
        for h in range(rank * hq // u, (rank + 1) * hq // u):
            copy = h // group
            assert rank * per_rank <= copy < (rank + 1) * per_rank
            assert copy // f == h // (hq // hkv)


def test_kv_replication_refuses_heads_that_do_not_split():
    with pytest.raises(ValueError, match="head_parallel=4 must divide the number of query heads 6"):
        kv_replication(6, 2, 4)


def test_sum_replicas_is_the_gradient_of_replicate():
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 6, 3, dtype=torch.float64)
    (dx,) = torch.autograd.grad(replicate(x, 3), x, dy)
    assert torch.equal(sum_replicas(dy, 3), dx)


@pytest.mark.parametrize("spec", LAYOUT_SPECS, ids=str)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_head_plan_is_the_layout_and_whole_documents(spec, cp):
    cu = cu_seqlens([1, 7, 0, 12, 3])
    plan = make_head_plan(cu, cp_size=cp, strategy=spec)
    layout = make_plan(cu, cp_size=cp, rank=cp - 1, strategy=spec)
    assert torch.equal(plan.gather_index, layout.gather_index)  # the same on every rank
    padded = pad_for_cp(cu, cp_size=cp, strategy=spec)
    whole = make_plan(cu, padded, cp_size=1, rank=0, strategy=Strategy.NO_LOAD_BALANCE)
    for got, want in zip(plan[1:], whole[1:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("spec", LAYOUT_SPECS, ids=str)
@pytest.mark.parametrize("lengths", [[1, 7, 0, 12, 3], [8, 4, 4], [5]])
def test_documents_take_the_real_tokens_back_to_back_and_put_the_output_back(spec, lengths):
    """The kernel's rows are the real tokens in physical order, taken where they are when the layout
    pads only after them (no_load_balance), and the output goes back to the all-gather's order,
    ``fill`` at the padding: against indexing by the plan, row by row."""
    from cpcompile.attention.heads import _to_documents, _to_gathered, documents

    cp, cu = 4, cu_seqlens(lengths)
    plan = make_head_plan(cu, cp_size=cp, strategy=spec)
    docs = documents(plan.gather_index, plan.k_start, plan.k_len_causal)
    padded = pad_for_cp(cu, cp_size=cp, strategy=spec)
    physical = [int(padded[d]) + i for d, n in enumerate(lengths) for i in range(n)]  # real rows, in order
    gathered_row = dict(enumerate(plan.gather_index.tolist()))  # physical row -> gathered row
    x = torch.randn(plan.gather_index.shape[0], 2, 3, dtype=torch.float64)
    (got,) = _to_documents([x], docs)
    assert torch.equal(got, x[[gathered_row[p] for p in physical]])
    assert docs.in_place == ([gathered_row[p] for p in physical] == list(range(len(physical))))
    if spec.strategy == Strategy.NO_LOAD_BALANCE:
        assert docs.in_place
    (back,) = _to_gathered([got * 2], docs, fill=-1.0)
    want = torch.full_like(x, -1.0)
    want[[gathered_row[p] for p in physical]] = x[[gathered_row[p] for p in physical]] * 2
    assert torch.equal(back, want)


def test_auto_keeps_head_parallel():
    cu = cu_seqlens([1, 7, 0, 12, 3])
    assert resolve_auto(StrategySpec("auto", kv="heads", head_parallel=2), cu, cp_size=2).head_parallel == 2


def test_shard_batch_makes_the_head_plan_ahead():
    """``shard_batch(..., device=...)`` makes, ahead of the step, the head plan that head-parallel ops ask for."""
    cu = cu_seqlens([1, 7, 0, 12, 3])
    spec = StrategySpec("dual_chunk_swap", kv="heads", head_parallel=2)
    batch = cpcompile.shard_batch({"x": torch.arange(23)}, cu, cp_size=2, rank=1, strategy=spec, device="cpu")
    tokens = 2 * batch.indices.shape[0]
    made = head_step_plan(batch.cu_seqlens, None, tokens, 2, "dual_chunk_swap", 1)
    assert torch.equal(made.gather_index, make_head_plan(cu, cp_size=2, strategy=spec).gather_index)


@pytest.mark.parametrize("cp, u", [(4, 2), (6, 3), (6, 2), (8, 4)])
def test_hybrid_plan_of_contiguous_slices_is_the_group_as_one_rank(cp, u):
    """Under no_load_balance a head group's ranks hold one contiguous slice: the group's plan is
    the plan of one rank of ``cp / u`` holding it (live pieces alike), over the ``cp`` layout's order."""
    from cpcompile.plan.pieces import make_hybrid_plan

    cu = cu_seqlens([1, 7, 0, 12, 3, 9])
    padded = pad_for_cp(cu, cp_size=cp, strategy="no_load_balance")
    for rank in range(cp):
        plan = make_hybrid_plan(cu, padded, cp_size=cp, head_parallel=u, rank=rank, strategy="no_load_balance")
        group = make_plan(cu, padded, cp_size=cp // u, rank=rank // u, strategy="no_load_balance")
        assert torch.equal(
            plan.gather_index, make_plan(cu, padded, cp_size=cp, rank=0, strategy="no_load_balance").gather_index
        )
        for got, want in zip(plan[1:], group[1:]):
            n = int((plan.cu_q[1:] > plan.cu_q[:-1]).sum())
            assert torch.equal(got[:n], want[:n])

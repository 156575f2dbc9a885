"""The sparse exchange's plan, rule and layout of returned sums (``cpcompile.plan.exchange``)."""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cpcompile
from cpcompile.comm import collectives
from cpcompile.comm import exchange as transport
from cpcompile.cost.comm import EXCHANGE_AT, use_exchange
from cpcompile.plan import exchange
from cpcompile.plan.exchange import Exchange, _sum_layers, exchange_plan, reads
from cpcompile.plan.pieces import step_plan
from tests.fixtures import LAYOUT_CASE, LAYOUT_SPECS, cu_seqlens


def test_exchange_rule():
    """The sparse exchange is used when the busiest rank's rows sent or received are at most
    EXCHANGE_AT of an all-gather's; counts[r][s]: rows rank r reads from rank s."""
    assert EXCHANGE_AT == 0.75
    assert use_exchange([[10, 7], [0, 10]], 10)  # rank 0 receives 7 of 10
    assert not use_exchange([[10, 8], [0, 10]], 10)  # 8 > 7.5
    # cp=3, all-gather brings 2 x 10 rows: rank 2 sends 8 + 8 > 15, though no rank receives more than 8
    assert not use_exchange([[10, 0, 8], [0, 10, 8], [0, 0, 10]], 10)
    assert use_exchange([[10, 0, 7], [0, 10, 8], [0, 0, 10]], 10)
    assert use_exchange([[10, 10], [10, 10]], 10, "always") and not use_exchange([[10, 0], [0, 10]], 10, "never")


def test_exchange_sums_take_own_rows_then_senders_in_rank_order():
    """Each local row's gradient parts, by layer: its own compact sum, then each sender's
    returned one in rank order (a fixed order: deterministic sums)."""
    # 5 local rows; the rank reads rows 0 and 3 itself (compact rows 2 and 0); 4 compact keys;
    # rank 0 returns rows 3, 4 and rank 2 returns row 3 (rank 1, this one, and rank 3 send none)
    own_rows, own_compact = torch.tensor([0, 3]), torch.tensor([2, 0])
    send_rows, send_counts = torch.tensor([3, 4, 3]), [2, 0, 1, 0]
    spare = 4 + 3
    want = torch.tensor(
        [
            [2, spare, spare, 0, spare],  # own
            [spare, spare, spare, 4, 5],  # rank 0's, returned at rows 4 and 5
            [spare, spare, spare, 6, spare],  # rank 2's, at row 6
        ]
    )
    assert torch.equal(_sum_layers(own_rows, own_compact, send_rows, send_counts, 4, 5), want)


@pytest.mark.parametrize("kv", ["exchange", "all_gather", "auto"])
def test_each_setting_runs(single_rank_group, kv):
    cu = torch.tensor([0, 3, 12, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8)
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    out = cpcompile.cp_attention(q, k, v, cu, strategy=cpcompile.StrategySpec("no_load_balance", kv=kv))
    want = cpcompile.packed_attention(q, k, v, cu)
    torch.testing.assert_close(out, want)


def test_a_copied_plan_exchanges(single_rank_group):
    """A plan is values: a copy of it (as ``.to(device)`` makes) runs the sparse exchange as the plan
    does, and ``cp_attention`` checks it against its arguments by value."""
    cu = torch.tensor([0, 3, 12, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8)
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    plan = cpcompile.plan.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    copied = type(plan)(*(t.clone() for t in plan))
    exchange = cpcompile.StrategySpec("no_load_balance", kv="exchange")
    out = cpcompile.cp_attention(q, k, v, cu, strategy=exchange, plan=copied)
    torch.testing.assert_close(out, cpcompile.packed_attention(q, k, v, cu))
    other = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"plan was made from other cu_seqlens: cu_seqlens\[1\] is 4, the plan's 3"):
        cpcompile.cp_attention(q, k, v, other, strategy=exchange, plan=copied)


# --- the plan, made without communication -------------------------------------------------


def _as_ranks_told_each_other(plans, causal: bool, choice: str) -> list[Exchange | None]:
    """Every rank's :class:`Exchange` as the ranks used to build it, telling each other what
    they read (an all-gather of counts, an all-to-all of row indices), played here by hand:
    each rank's reads from its own plan alone."""
    cp = len(plans)
    t_local = plans[0].gather_index.shape[0] // cp
    mine = [reads(p.gather_index, p.k_start, p.k_len(causal), cp) for p in plans]
    matrix = [m.counts.tolist() for m in mine]  # the all-gather
    if not use_exchange(matrix, t_local, choice):
        return [None] * cp
    out = []
    for rank, m in enumerate(mine):
        own = m.owner == rank
        by_owner = torch.argsort(torch.where(own, -1, m.owner), stable=True)[int(own.sum()) :]
        # the all-to-all: from each other rank in rank order, the rows of this one it reads, in its order
        send_rows = torch.cat([mine[r].local_row[mine[r].owner == rank] for r in range(cp) if r != rank])
        send_counts = [0 if r == rank else matrix[r][rank] for r in range(cp)]
        gather = m.local_row.clone()
        gather[by_owner] = t_local + torch.arange(by_owner.shape[0])
        own_compact = own.nonzero().squeeze(1)
        sums = _sum_layers(m.local_row[own_compact], own_compact, send_rows, send_counts, gather.shape[0], t_local)
        recv_counts = [0 if s == rank else matrix[rank][s] for s in range(cp)]
        out.append(Exchange(m.k_start, gather, send_rows, by_owner, sums, recv_counts, send_counts))
    return out


def _assert_same(got: Exchange | None, want: Exchange | None, label: str) -> None:
    assert (got is None) == (want is None), label
    if got is None:
        return
    for name, a, b in zip(Exchange._fields, got, want):
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert same, f"{label}: {name} {a} != {b}"


@contextlib.contextmanager
def _rank_that_cannot_communicate(cp: int, rank: int):
    """This process as rank ``rank`` of a group of ``cp`` whose every collective raises."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the exchange plan communicated")

    group = types.SimpleNamespace(size=lambda: cp, rank=lambda: rank)
    names = ("all_gather", "all_gather_object", "all_to_all", "all_to_all_single", "all_reduce", "broadcast")
    names += ("barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(exchange, "resolve_group", lambda name: group))
        stack.enter_context(mock.patch.object(transport, "all_to_all_rows", forbidden))
        for module, name in [(collectives, "_all_gather"), (collectives, "_reduce_scatter")] + [
            (dist, n) for n in names
        ]:
            stack.enter_context(mock.patch.object(module, name, forbidden))
        yield


@settings(max_examples=80, deadline=None)
@given(**LAYOUT_CASE, choice=st.sampled_from(["always", "auto"]))
@example(lengths=[1], cp=4, spec=LAYOUT_SPECS[0], causal=True, choice="always")  # ranks that read nothing
@example(lengths=[0, 7, 0, 1, 0], cp=3, spec=LAYOUT_SPECS[4], causal=False, choice="always")
@example(lengths=[30], cp=2, spec=LAYOUT_SPECS[1], causal=True, choice="auto")  # one document
def test_the_plan_is_the_one_ranks_agreed_by_collectives(lengths, cp, spec, causal, choice):
    """Every rank's exchange, derived from the pack alone, without a collective: the same counts,
    rows to send (in the same order), destinations and sums as when each rank told the others
    what it read. Packs of 1-token, empty and single documents; ranks that read nothing."""
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    tokens = int(padded[-1])
    plans = [step_plan(cu, padded, tokens, cp, r, spec.strategy.value, spec.stripe_size) for r in range(cp)]
    want = _as_ranks_told_each_other(plans, causal, choice)
    window = (-1, 0) if causal else (-1, -1)
    for rank, plan in enumerate(plans):
        with _rank_that_cannot_communicate(cp, rank):
            got = exchange_plan(*_keys(plan, causal), *_pack(plan), window, "group", choice)
        _assert_same(got, want[rank], f"rank {rank} of {cp}, {spec}, causal={causal}, {choice}, docs {lengths}")


def _keys(plan, causal: bool) -> tuple[torch.Tensor, ...]:
    return plan.gather_index, plan.k_start, plan.k_len(causal)


def _pack(plan) -> tuple[torch.Tensor, torch.Tensor]:
    return plan.cu_seqlens, plan.cu_seqlens_padded


def test_a_plan_carries_its_pack_as_values():
    """The exchange derives every rank's reads from the pack the plan carries, so a copy of a plan
    (or one made by hand) exchanges as the plan does; an op given no offsets (the hybrid's) uses the
    all-gather for ``auto``, and ``always`` says what it lacks; pieces of another rank's plan beside
    this rank's pack are refused, not exchanged."""
    cu = cu_seqlens([5, 11])
    plan = cpcompile.plan.make_plan(cu, cp_size=2, rank=1, strategy="no_load_balance")
    copied = type(plan)(*(t.clone() for t in plan))
    causal = (-1, 0)
    with _rank_that_cannot_communicate(2, 1):
        made = exchange_plan(*_keys(plan, True), *_pack(plan), causal, "group", "always")
        _assert_same(exchange_plan(*_keys(copied, True), *_pack(copied), causal, "group", "always"), made, "copy")
        assert exchange_plan(*_keys(plan, True), None, None, causal, "group", "auto") is None
        with pytest.raises(ValueError, match=r"kv='exchange' needs the pack's offsets \(the plan's cu_seqlens"):
            exchange_plan(*_keys(plan, True), None, None, causal, "group", "always")
    with (
        _rank_that_cannot_communicate(2, 0),
        pytest.raises(ValueError, match=r"piece 0 reads keys \[5, 16\), which rank 0"),
    ):
        other = type(plan)(*(t.clone() for t in plan))  # not the plan whose exchange rank 1 cached
        exchange_plan(*_keys(other, True), *_pack(other), causal, "group", "always")

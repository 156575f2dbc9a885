"""``shard_batch`` against a brute-force pad-then-select (unshard runs in the gloo tests)."""

from __future__ import annotations

import pytest
import torch

import cpcompile


def _brute_force(t: torch.Tensor, lengths, padded_lengths, fill, held):
    rows, start = [], 0
    for n, p in zip(lengths, padded_lengths):
        rows += list(t[start : start + n]) + [torch.full_like(t[0], fill)] * (p - n)
        start += n
    return torch.stack([rows[i] for i in held])


@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance", "striped"])
def test_shard_batch_pads_then_selects(strategy):
    lengths = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    ids = torch.arange(100, 115)
    emb = torch.randn(15, 3)
    for rank in range(3):
        b = cpcompile.shard_batch(
            {"input_ids": ids, "labels": ids, "shift_labels": ids, "emb": emb},
            cu,
            cp_size=3,
            rank=rank,
            strategy=strategy,
            pad_values={"input_ids": 7},
        )
        padded = b.cu_seqlens_padded.diff().tolist()
        held = b.indices.tolist()
        assert torch.equal(b.cu_seqlens, cu) and b.strategy.value == strategy and (b.cp_size, b.rank) == (3, rank)
        assert torch.equal(b.tensors["input_ids"], _brute_force(ids, lengths, padded, 7, held))
        for name in ("labels", "shift_labels"):  # padding rows ignored by the loss
            assert torch.equal(b.tensors[name], _brute_force(ids, lengths, padded, -100, held))
        assert torch.equal(b.tensors["emb"], _brute_force(emb, lengths, padded, 0.0, held))
        assert torch.equal(
            b.indices, cpcompile.layouts.partition_indices(b.cu_seqlens_padded, cp_size=3, rank=rank, strategy=strategy)
        )


def test_shard_batch_follows_the_active_strategy():
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with cpcompile.strategy("striped", stripe_size=2):
        b = cpcompile.shard_batch({"x": torch.arange(10)}, cu, cp_size=2, rank=1)
    assert b.spec == cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, 2)
    assert b.tensors["x"].tolist() == [2, 3, 6, 7, 0, 0]  # 10 tokens padded to 12: stripes 1, 3, 5


@pytest.mark.parametrize(
    "tensors, kwargs, message",
    [
        ({"x": torch.zeros(9)}, {}, r"tensors\['x'\] has 9 tokens in dim 0, cu_seqlens\[-1\] is 10"),
        ({}, {}, "tensors must be a non-empty dict"),
        (
            {"x": torch.zeros(10)},
            {"pad_values": {"y": 0}},
            r"pad_values names tensors that are not in tensors: \['y'\]",
        ),
        ({"x": torch.zeros(10)}, {"rank": 5}, r"rank must be an int in \[0, 2\), got 5"),
        ({"x": torch.zeros(10)}, {"pad_values": {"x": "a"}}, r"pad_values must be a dict .*got \{'x': 'a'\}"),
        ({"x": torch.zeros(10)}, {"pad_values": 7}, r"pad_values must be a dict .*got 7"),
        (
            {"x": torch.zeros(10)},
            {"strategy": cpcompile.StrategySpec("striped", kv="heads", head_parallel=3)},
            "head_parallel=3 must divide the CP size 2",
        ),
        ({"x": torch.zeros(10)}, {"cu_device": "meta"}, "cu_seqlens must hold its values .*got a meta tensor"),
    ],
)
def test_bad_batches(tensors, kwargs, message):
    cu = torch.tensor([0, 10], dtype=torch.int32).to(kwargs.pop("cu_device", "cpu"))
    with pytest.raises(ValueError, match=message):
        cpcompile.shard_batch(tensors, cu, **{"cp_size": 2, "rank": 0, **kwargs})


def test_one_rank_gets_the_pack_as_it_is():
    """At cp=1 nothing is padded under any strategy: the backend leaves the graph alone there,
    so the model attends over the tokens and cu_seqlens exactly as the loader gave them."""
    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    ids = torch.arange(13)
    for strategy in ("dual_chunk_swap", "striped", "no_load_balance", "balanced"):
        with cpcompile.strategy(strategy, stripe_size=4 if strategy == "striped" else None):
            batch = cpcompile.shard_batch({"ids": ids}, cu, cp_size=1, rank=0)
        assert torch.equal(batch.cu_seqlens_padded, cu), strategy
        assert torch.equal(batch.tensors["ids"], ids), strategy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": None}, r"rank must be an int in \[0, 2\), got None"),
        ({"num_tokens": 16.0}, r"num_tokens must be an int >= 1, got 16\.0"),
    ],
)
def test_bad_plans(kwargs, message):
    """make_plan names the argument it cannot take, before it lays anything out."""
    cu = torch.tensor([0, 4, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        cpcompile.plan.make_plan(cu, **{"cp_size": 2, "rank": 0, **kwargs})


def test_attention_checks_what_the_batch_was_sharded_for():
    """A batch carries the CP size, rank and layout ``shard_batch`` laid it out for (``batch.sharded_for``), and
    attention (``batch.check_rows``, called by ``cp_attention`` and the plan ops) refuses another:
    rows of another rank or layout with the same token count would attend wrongly without an error."""
    from cpcompile.batch import check_rows
    from cpcompile.cost.model import resolve_auto
    from cpcompile.spec import resolve_strategy

    cu = torch.tensor([0, 3, 10, 11, 24], dtype=torch.int32)
    x = {"x": torch.arange(24.0)}
    striped = cpcompile.StrategySpec("striped", 2)
    batches = [cpcompile.shard_batch(x, cu, cp_size=2, rank=r, strategy=striped) for r in range(2)]
    for r, batch in enumerate(batches):
        check_rows(batch.cu_seqlens, 2, r, striped, batch.sharded_for)
        check_rows(batch.cu_seqlens, 2, None, striped, batch.sharded_for)  # a plan op without a rank
    cases = [
        ((4, 0, striped), r"laid out for cp_size=2, but the CP group has 4 ranks"),
        ((2, 1, striped), r"laid out for rank 0, but this is rank 1 of the CP group"),
        ((2, 0, resolve_strategy("striped")), r"the layout 'striped' \(stripe_size=2\), but attention runs 'striped' "),
        ((2, 0, resolve_strategy("dual_chunk_swap")), r"but attention runs 'dual_chunk_swap': attention over its rows"),
    ]
    for (cp, rank, spec), message in cases:
        with pytest.raises(ValueError, match=message + r".*cp_group.rank\(\)"):
            check_rows(batches[0].cu_seqlens, cp, rank, spec, batches[0].sharded_for)
    # offsets alone (the batch's or a copy): no record of whose rows they are, refused under CP
    for unknown in (cu, batches[0].cu_seqlens.clone()):
        with pytest.raises(ValueError, match="cannot tell which rank's rows it got.*cpcompile.strategy\\(batch\\)"):
            check_rows(unknown, 2, 0, striped, None)
        check_rows(unknown, 1, 0, striped, None)  # one rank holds every row

    # auto: the batch keeps the layout auto picked; attention under auto, or under that layout, fits it
    auto = resolve_strategy("auto")
    batch = cpcompile.shard_batch(x, cu, cp_size=2, rank=0, strategy=auto)
    picked = resolve_auto(auto, cu, cp_size=2)
    assert batch.spec == picked
    check_rows(batch.cu_seqlens, 2, 0, auto, batch.sharded_for)
    check_rows(batch.cu_seqlens, 2, 0, picked, batch.sharded_for)
    other = "no_load_balance" if picked.strategy.value != "no_load_balance" else "dual_chunk_swap"
    with pytest.raises(ValueError, match=f"but attention runs '{other}'"):
        check_rows(batch.cu_seqlens, 2, 0, resolve_strategy(other), batch.sharded_for)
    # a batch sharded under the layout auto picks fits attention under auto; another does not
    fits = cpcompile.shard_batch(x, cu, cp_size=2, rank=0, strategy=picked)
    check_rows(fits.cu_seqlens, 2, 0, auto, fits.sharded_for)
    unfit = cpcompile.shard_batch(x, cu, cp_size=2, rank=0, strategy=other)
    with pytest.raises(ValueError, match=f"the layout '{other}'.*, but attention runs 'auto'"):
        check_rows(unfit.cu_seqlens, 2, 0, auto, unfit.sharded_for)


def test_a_copied_batch_is_checked_and_layouts_spelled_otherwise_pass():
    """A copy of a whole ``ShardedBatch`` (``copy.deepcopy``, pickling, as a ``DataLoader`` worker hands it over)
    knows what it was sharded for; attention under another spelling of the same layout (balanced's windows in
    another order or repeated, none against one global layer) passes where it gives every rank the same rows."""
    import copy
    import pickle

    from cpcompile.batch import check_rows

    cu = torch.tensor([0, 3, 10, 11, 24], dtype=torch.int32)
    batch = cpcompile.shard_batch({"x": torch.arange(24.0)}, cu, cp_size=2, rank=1, strategy="dual_chunk_swap")
    spec = batch.spec
    for copied in (copy.deepcopy(batch), pickle.loads(pickle.dumps(batch))):
        assert copied.sharded_for[:4] == batch.sharded_for[:4] and torch.equal(copied.sharded_for.pack, cu)
        check_rows(copied.cu_seqlens, 2, 1, spec, copied.sharded_for)
        with pytest.raises(ValueError, match="laid out for rank 1, but this is rank 0"):
            check_rows(copied.cu_seqlens, 2, 0, spec, copied.sharded_for)
    for loader, model in [((3, -1), (-1, 3)), ((3, -1), (3, -1, 3, -1)), ((), (-1,))]:
        balanced = cpcompile.StrategySpec("balanced", windows=loader)
        batch = cpcompile.shard_batch({"x": torch.arange(24.0)}, cu, cp_size=2, rank=0, strategy=balanced)
        check_rows(batch.cu_seqlens, 2, 0, cpcompile.StrategySpec("balanced", windows=model), batch.sharded_for)


def test_the_batch_given_as_a_value_survives_copies_of_its_offsets():
    """``with cpcompile.strategy(batch)`` (or ``strategy=batch``) tells attention what the rows were laid out for,
    however ``cu_seqlens`` was copied since (clone, a numpy round trip, a list): another rank's batch, another
    CP size, layout or pack is refused; the batch's own layout passes."""
    import numpy as np

    from cpcompile.batch import check_rows
    from cpcompile.spec import current_rows, layout_in_force

    cu = torch.tensor([0, 5, 7, 8], dtype=torch.int32)
    batches = [
        cpcompile.shard_batch({"x": torch.arange(8.0)}, cu, cp_size=2, rank=r, strategy="balanced") for r in (0, 1)
    ]
    copies = [
        lambda t: t.clone(),
        lambda t: torch.from_numpy(np.array(t.numpy())),
        lambda t: torch.tensor(t.tolist(), dtype=torch.int32),
    ]
    for copy in copies:
        for rank, batch in enumerate(batches):
            with cpcompile.strategy(batch):
                spec, rows = layout_in_force(None, cp_size=2, what="test")
                assert (rows, True) == current_rows() and spec == batch.spec
                check_rows(copy(batch.cu_seqlens), 2, rank, spec, rows)
                with pytest.raises(ValueError, match=f"laid out for rank {rank}, but this is rank {1 - rank}"):
                    check_rows(copy(batch.cu_seqlens), 2, 1 - rank, spec, rows)  # one rank's batch on another
            spec, rows = layout_in_force(batch, cp_size=2, what="test")  # strategy=batch: the same
            with pytest.raises(ValueError, match="another pack"):
                check_rows(torch.tensor([0, 4, 7, 8], dtype=torch.int32), 2, rank, spec, rows)
            with pytest.raises(ValueError, match="but attention runs 'dual_chunk_swap'"):
                check_rows(copy(batch.cu_seqlens), 2, rank, cpcompile.StrategySpec("dual_chunk_swap"), rows)


def test_no_default_layout_under_cp():
    """Attention on a CP group of more than one rank takes no default layout: given none, by argument or by a
    strategy block, it raises naming both ways; one rank takes the default."""
    from cpcompile.spec import current_rows, layout_in_force

    with pytest.raises(
        ValueError, match=r"cp_attention has no layout.*strategy=batch.*with cpcompile.strategy\(batch\)"
    ):
        layout_in_force(None, cp_size=2, what="cp_attention")
    assert layout_in_force(None, cp_size=1, what="cp_attention") == (cpcompile.StrategySpec(), None)
    assert layout_in_force("striped", cp_size=2, what="cp_attention")[0].strategy.value == "striped"
    with cpcompile.strategy("balanced"):
        assert layout_in_force(None, cp_size=2, what="cp_attention") == (cpcompile.StrategySpec("balanced"), None)
        batch = cpcompile.shard_batch(
            {"x": torch.arange(8.0)}, torch.tensor([0, 8], dtype=torch.int32), cp_size=2, rank=1
        )
        _, rows = layout_in_force(None, cp_size=2, what="cp_attention")  # the block learned its batch
        assert rows == batch.sharded_for and current_rows() == (rows, False)
        with cpcompile.strategy("balanced", kv="ring"):  # a nested block knows it too
            assert layout_in_force(None, cp_size=2, what="cp_attention")[1] == batch.sharded_for
    batch = cpcompile.shard_batch({"x": torch.arange(8.0)}, torch.tensor([0, 8], dtype=torch.int32), cp_size=2, rank=0)
    with pytest.raises(ValueError, match="head_parallel decide.s. a batch's layout"):
        with cpcompile.strategy(batch, head_parallel=2):
            pass
    with cpcompile.strategy(batch, kv="ring") as spec:
        assert spec.kv == "ring" and spec.strategy.value == "dual_chunk_swap"


def test_a_block_checks_the_last_batch_it_learned():
    """A block given a strategy learns the last batch ``shard_batch`` made in it, and checks attention's rows
    against that one: an earlier batch's rows (prefetching the next batch in the block, or sharding every
    rank's) are refused, not run; ``with cpcompile.strategy(batch)`` names the batch the rows are of."""
    from cpcompile.batch import check_rows
    from cpcompile.spec import layout_in_force

    cu = torch.tensor([0, 5, 7, 8], dtype=torch.int32)
    with cpcompile.strategy("balanced"):
        mine = cpcompile.shard_batch({"x": torch.arange(8.0)}, cu, cp_size=2, rank=0)
        cpcompile.shard_batch({"x": torch.arange(8.0)}, cu, cp_size=2, rank=1)  # another rank's, made last
        spec, rows = layout_in_force(None, cp_size=2, what="test")
        with pytest.raises(ValueError, match="laid out for rank 1, but this is rank 0"):
            check_rows(mine.cu_seqlens, 2, 0, spec, rows)
        with cpcompile.strategy(mine):
            spec, rows = layout_in_force(None, cp_size=2, what="test")
            check_rows(mine.cu_seqlens, 2, 0, spec, rows)


def test_bad_tensors_are_refused_before_auto_decides(monkeypatch):
    """``tensors`` and ``pad_values`` are checked before ``auto``'s decision (host time per pack)."""
    from cpcompile import batch as batch_module

    def decided(*args, **kwargs):
        raise AssertionError("decided before checking the tensors")

    monkeypatch.setattr(batch_module, "resolve", decided)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    for tensors, kw, message in (
        ({"x": torch.zeros(9)}, {}, r"tensors\['x'\] has 9 tokens"),
        ({"x": torch.zeros(10)}, {"pad_values": {"y": 0}}, r"pad_values names tensors that are not in tensors"),
    ):
        with pytest.raises(ValueError, match=message):
            cpcompile.shard_batch(tensors, cu, cp_size=2, rank=0, strategy="auto", topology="h200", **kw)


def test_auto_decided_with_a_topology_inside_an_auto_block_is_refused():
    """Attention in a ``strategy("auto")`` block resolves ``auto`` by the kernel's work alone, not the batch's
    decision with communication: deciding there raises, naming the way that runs it."""
    cu = torch.tensor([0, 300, 305, 322, 323, 413], dtype=torch.int32)
    x = {"x": torch.arange(413)}
    message = r"inside `with cpcompile.strategy\('auto'\)`.*under `with cpcompile.strategy\(batch\)`"
    for requested in (None, "auto"):
        with cpcompile.strategy("auto"), pytest.raises(ValueError, match=message):
            cpcompile.shard_batch(x, cu, cp_size=4, rank=0, strategy=requested, topology="h200")
    batch = cpcompile.shard_batch(x, cu, cp_size=4, rank=0, strategy="auto", topology="h200")  # outside: runs
    with cpcompile.strategy(batch) as spec:
        assert spec == batch.spec and spec.strategy is not cpcompile.Strategy.AUTO
    with cpcompile.strategy("auto"):  # by the kernel's work alone, as attention in the block: allowed
        assert cpcompile.shard_batch(x, cu, cp_size=4, rank=0).spec.kv == "auto"


@pytest.mark.parametrize(
    "spec", [cpcompile.StrategySpec("balanced"), cpcompile.StrategySpec("balanced", windows=(4, -1))]
)
def test_the_step_finds_the_plan_the_batch_made_ahead(spec):
    """The ``cp_plan`` op's function, with the arguments a compiled call gives it (windows and capacity
    at their schema defaults where the spec has none), returns the plan ``shard_batch(..., device=...)``
    made, not a second one."""
    from cpcompile.attention.plan_op import step_plan_in_layers
    from cpcompile.plan.pieces import plan_extras, spec_step_plan

    cu = torch.tensor([0, 1, 8, 8, 20, 23], dtype=torch.int32)
    b = cpcompile.shard_batch({"x": torch.arange(23)}, cu, cp_size=4, rank=2, strategy=spec, device="cpu")
    tokens = 4 * b.indices.shape[0]
    ahead = spec_step_plan(b.cu_seqlens, None, tokens, 4, 2, spec)
    extras = dict(zip(("windows", "capacity"), plan_extras(spec)))
    assert step_plan_in_layers(b.cu_seqlens, None, tokens, 4, 2, "balanced", 1, **extras) is ahead


def test_the_hybrid_batch_makes_the_hybrid_plan_ahead(monkeypatch):
    """``shard_batch(..., device=...)`` makes the plan compiled calls ask for: ``cp_hybrid_plan``'s for the
    hybrid (``1 < u < cp``), ``cp_head_plan``'s for pure head parallelism."""
    from cpcompile.plan import pieces

    made = []
    monkeypatch.setattr(pieces, "hybrid_step_plan", lambda *a: made.append(("hybrid", a[2:])))
    monkeypatch.setattr(pieces, "head_step_plan", lambda *a: made.append(("heads", a[2:])))
    cu = torch.tensor([0, 1, 8, 8, 20, 23], dtype=torch.int32)
    for u in (2, 4):
        spec = cpcompile.StrategySpec("dual_chunk_swap", kv="heads", head_parallel=u)
        b = cpcompile.shard_batch({"x": torch.arange(23)}, cu, cp_size=4, rank=3, strategy=spec, device="cpu")
        tokens = 4 * b.indices.shape[0]
    assert made == [("hybrid", (tokens, 4, 2, 3, "dual_chunk_swap", 1)), ("heads", (tokens, 4, "dual_chunk_swap", 1))]

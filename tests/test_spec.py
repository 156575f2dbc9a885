"""The Strategy enum and the active-strategy context."""

from __future__ import annotations

import sys

import pytest
import torch

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.spec import check_head_parallel, resolve_strategy


def test_strings_and_default():
    assert Strategy("dual_chunk_swap") is Strategy.DUAL_CHUNK_SWAP
    # a spec built from a plain string holds the enum, so every layout function recognizes it
    assert StrategySpec("striped", 4).strategy is Strategy.STRIPED
    assert StrategySpec("striped", 4) == StrategySpec(Strategy.STRIPED, 4)
    assert resolve_strategy("STRIPED") == StrategySpec(Strategy.STRIPED)
    assert cpcompile.spec.current_strategy() is Strategy.DUAL_CHUNK_SWAP


def test_context_nests_and_restores():
    with cpcompile.strategy("striped", stripe_size=4) as spec:
        assert spec == StrategySpec(Strategy.STRIPED, 4)
        assert cpcompile.spec.current_strategy() is Strategy.STRIPED
        # naming the active strategy keeps its stripe size, so loader and attention agree
        assert resolve_strategy("striped") == spec
        assert resolve_strategy(None) == spec
        with cpcompile.strategy(Strategy.NO_LOAD_BALANCE):
            assert cpcompile.spec.current_spec() == StrategySpec(Strategy.NO_LOAD_BALANCE)
        assert cpcompile.spec.current_spec() == spec
    assert cpcompile.spec.current_spec() == StrategySpec()


def test_context_restores_after_error():
    with pytest.raises(RuntimeError), cpcompile.strategy("no_load_balance"):
        raise RuntimeError
    assert cpcompile.spec.current_strategy() is Strategy.DUAL_CHUNK_SWAP


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: resolve_strategy("ring"), ValueError, "strategy must be one of 'dual_chunk_swap'.*got 'ring'"),
        (lambda: resolve_strategy(3), TypeError, "strategy must be a Strategy, a str or None, got int"),
        (lambda: StrategySpec(Strategy.STRIPED, 0), ValueError, "stripe_size must be a positive int, got 0"),
        (lambda: StrategySpec(Strategy.DUAL_CHUNK_SWAP, 2), ValueError, "only applies to strategy 'striped'"),
        (lambda: cpcompile.strategy("nope").__enter__(), ValueError, "got 'nope'"),
        (lambda: StrategySpec("foo"), ValueError, "strategy must be one of 'dual_chunk_swap'.*got 'foo'"),
        (lambda: StrategySpec(None), TypeError, "got NoneType"),
        (lambda: StrategySpec(kv="heads", head_parallel=0), ValueError, "head_parallel must be a positive int .*got 0"),
        (
            lambda: StrategySpec(kv="heads", head_parallel=True),
            ValueError,
            "head_parallel must be a positive int .*got True",
        ),
        (
            lambda: StrategySpec(head_parallel=2),
            ValueError,
            "kv='heads' and head_parallel > 1 go together.*got kv='auto' with head_parallel=2",
        ),
        (
            lambda: StrategySpec(kv="heads"),
            ValueError,
            "kv='heads' and head_parallel > 1 go together.*got kv='heads' with head_parallel=1",
        ),
        (
            lambda: StrategySpec(kv="gather"),
            ValueError,
            r"kv must be one of \('auto', 'all_gather', 'exchange', 'ring', 'heads'\), got 'gather'",
        ),
        (
            lambda: StrategySpec(kernel="fa9"),
            ValueError,
            r"kernel must be one of \(None, 'reference', 'flash', 'cudnn', 'fa4', 'auto'\), got 'fa9'",
        ),
        (lambda: StrategySpec(kv_chunks=0), ValueError, "kv_chunks must be an int >= 1, got 0"),
        (lambda: StrategySpec(kv_chunks="2"), ValueError, "kv_chunks must be an int >= 1, got '2'"),
        (lambda: check_head_parallel(3, 4), ValueError, "head_parallel=3 must divide the CP size 4"),
        (lambda: check_head_parallel(4, 4, 6), ValueError, "head_parallel=4 must divide the number of query heads 6"),
    ],
)
def test_bad_strategies_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_head_parallel_is_part_of_the_spec():
    with cpcompile.strategy("balanced", kv="heads", head_parallel=4) as spec:
        assert spec == StrategySpec(Strategy.BALANCED, kv="heads", head_parallel=4)
        assert resolve_strategy("balanced") == spec  # the loader and attention read the same u
        assert "head_parallel=4" in sys.modules["cpcompile.spec"].guard_key  # the compiler's guard
    with cpcompile.strategy(StrategySpec("striped", 2), kv="ring") as spec:
        assert (spec.stripe_size, spec.kv, spec.head_parallel) == (2, "ring", 1)
    check_head_parallel(1, 3, 5)  # no head parallelism: any cp and heads
    check_head_parallel(4, 4, 8)
    check_head_parallel(2, 4, 6)  # the hybrid: heads over pairs of ranks, sequence between the pairs


def test_every_choice_is_a_field_of_the_one_spec_and_of_the_guard():
    """How K/V move, the kernel and the chunks are the spec's, set by the strategy block and part of
    the compiler's guard; a batch's block may change them but not its layout."""
    with cpcompile.strategy("balanced", kv="exchange", kernel="reference", kv_chunks=2) as spec:
        assert spec == StrategySpec("balanced", kv="exchange", kernel="reference", kv_chunks=2)
        assert (spec.exchange, StrategySpec(kv="all_gather").exchange, StrategySpec(kv="ring").exchange) == (
            "always",
            "never",
            "never",
        )
        key = sys.modules["cpcompile.spec"].guard_key
        assert "kv='exchange'" in key and "kernel='reference'" in key and "kv_chunks=2" in key
    sharded = cpcompile.shard_batch(
        {"x": torch.arange(8)}, torch.tensor([0, 8], dtype=torch.int32), cp_size=2, rank=0, strategy="balanced"
    )
    with cpcompile.strategy(sharded, kv="ring", kernel="reference") as spec:
        assert (spec.strategy, spec.kv, spec.kernel) == (Strategy.BALANCED, "ring", "reference")
    with pytest.raises(ValueError, match="stripe_size, windows decide.s. a batch's layout"):
        cpcompile.strategy(sharded, stripe_size=2, windows=(4,)).__enter__()

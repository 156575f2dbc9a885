"""The Strategy enum and the active-strategy context."""

from __future__ import annotations

import sys

import pytest

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
        (lambda: StrategySpec(head_parallel=0), ValueError, "head_parallel must be a positive int .*got 0"),
        (lambda: StrategySpec(head_parallel=True), ValueError, "head_parallel must be a positive int .*got True"),
        (lambda: check_head_parallel(3, 4), ValueError, "head_parallel=3 must divide the CP size 4"),
        (lambda: check_head_parallel(4, 4, 6), ValueError, "head_parallel=4 must divide the number of query heads 6"),
    ],
)
def test_bad_strategies_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_head_parallel_is_part_of_the_spec():
    with cpcompile.strategy("balanced", head_parallel=4) as spec:
        assert spec == StrategySpec(Strategy.BALANCED, head_parallel=4)
        assert resolve_strategy("balanced") == spec  # the loader and attention read the same u
        assert "head_parallel=4" in sys.modules["cpcompile.spec"].guard_key  # the compiler's guard
    with cpcompile.strategy(StrategySpec("striped", 2, head_parallel=2), comm="ring") as spec:
        assert (spec.stripe_size, spec.comm, spec.head_parallel) == (2, "ring", 2)
    check_head_parallel(1, 3, 5)  # no head parallelism: any cp and heads
    check_head_parallel(4, 4, 8)
    check_head_parallel(2, 4, 6)  # the hybrid: heads over pairs of ranks, sequence between the pairs

"""Tier 1: the Strategy enum and the active-strategy context."""

from __future__ import annotations

import pytest

import cpcompile
from cpcompile import Strategy, StrategySpec
from cpcompile.strategy import resolve_strategy


def test_strings_and_default():
    assert Strategy("dual_chunk_swap") is Strategy.DUAL_CHUNK_SWAP
    # a spec built from a plain string holds the enum, so every layout function recognizes it
    assert StrategySpec("striped", 4).strategy is Strategy.STRIPED
    assert StrategySpec("striped", 4) == StrategySpec(Strategy.STRIPED, 4)
    assert resolve_strategy("STRIPED") == StrategySpec(Strategy.STRIPED)
    assert cpcompile.current_strategy() is Strategy.DUAL_CHUNK_SWAP


def test_context_nests_and_restores():
    with cpcompile.strategy("striped", stripe_size=4) as spec:
        assert spec == StrategySpec(Strategy.STRIPED, 4)
        assert cpcompile.current_strategy() is Strategy.STRIPED
        # naming the active strategy keeps its stripe size, so loader and attention agree
        assert resolve_strategy("striped") == spec
        assert resolve_strategy(None) == spec
        with cpcompile.strategy(Strategy.NO_LOAD_BALANCE):
            assert cpcompile.current_spec() == StrategySpec(Strategy.NO_LOAD_BALANCE)
        assert cpcompile.current_spec() == spec
    assert cpcompile.current_spec() == StrategySpec()


def test_context_restores_after_error():
    with pytest.raises(RuntimeError), cpcompile.strategy("no_load_balance"):
        raise RuntimeError
    assert cpcompile.current_strategy() is Strategy.DUAL_CHUNK_SWAP


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
    ],
)
def test_bad_strategies_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()

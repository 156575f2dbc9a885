"""Layouts against brute-force definitions, every rank, in one process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpcompile
from cpcompile import Strategy, StrategySpec
from tests.fixtures import LAYOUT_SPECS as SPECS
from tests.fixtures import cu_seqlens
from tests.reference import layout_brute_force


def test_transformer_engine_example():
    # docs/design.md, "Packs and layouts": TransformerEngine's thd_get_partitioned_indices.
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert cpcompile.layouts.partition_indices(cu, cp_size=2, rank=0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cpcompile.layouts.partition_indices(cu, cp_size=2, rank=1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def _pad_brute_force(lengths: list[int], spec: StrategySpec, cp: int) -> list[int]:
    if cp == 1:  # one rank holds the pack as it is
        return lengths
    if spec.strategy is Strategy.DUAL_CHUNK_SWAP:
        return [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    m = cp * spec.stripe_size
    return lengths[:-1] + [lengths[-1] + (-sum(lengths)) % m]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=8).filter(lambda x: sum(x) > 0),
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    spec=st.sampled_from(SPECS),
)
def test_layouts_match_brute_force(lengths, cp, spec):
    cu = cu_seqlens(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    assert padded.dtype == torch.int32
    want_lengths = _pad_brute_force(lengths, spec, cp)
    assert padded.diff().tolist() == want_lengths
    layout = cpcompile.layouts.all_partition_indices(padded, cp_size=cp, strategy=spec)
    for rank in range(cp):
        got = cpcompile.layouts.partition_indices(padded, cp_size=cp, rank=rank, strategy=spec)
        assert got.dtype == torch.int64
        assert got.tolist() == layout_brute_force(want_lengths, cp, rank, spec.strategy.value, spec.stripe_size)
        assert torch.equal(layout[rank], got)
    # every physical token is held exactly once
    assert sorted(layout.flatten().tolist()) == list(range(int(padded[-1])))


def test_num_tokens_avoids_reading_the_total():
    cu = cu_seqlens([5, 3])
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=2)
    a = cpcompile.layouts.partition_indices(padded, cp_size=2, rank=1, num_tokens=12)
    assert torch.equal(a, cpcompile.layouts.partition_indices(padded, cp_size=2, rank=1))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: cpcompile.layouts.pad_for_cp(torch.tensor([0, 4]), cp_size=2),
            ValueError,
            "cu_seqlens must have dtype torch.int32, got torch.int64",
        ),
        (
            lambda: cpcompile.layouts.pad_for_cp(torch.tensor([0, 4, 2], dtype=torch.int32), cp_size=2),
            ValueError,
            r"cu_seqlens must be non-decreasing .* got \[0, 4, 2\]",
        ),
        (
            lambda: cpcompile.layouts.pad_for_cp(torch.tensor([1, 4], dtype=torch.int32), cp_size=2),
            ValueError,
            "cu_seqlens must start at 0, got 1",
        ),
        (
            lambda: cpcompile.layouts.pad_for_cp(torch.tensor([0], dtype=torch.int32), cp_size=2),
            ValueError,
            r"at least 2 entries .* got shape \(1,\)",
        ),
        (
            lambda: cpcompile.layouts.pad_for_cp(torch.tensor([0, 4], dtype=torch.int32), cp_size=0),
            ValueError,
            "cp_size must be an int >= 1, got 0",
        ),
        (
            lambda: cpcompile.layouts.partition_indices(torch.tensor([0, 8], dtype=torch.int32), cp_size=2, rank=2),
            ValueError,
            r"rank must be an int in \[0, 2\), got 2",
        ),
        (
            lambda: cpcompile.layouts.partition_indices(torch.tensor([0, 6, 12], dtype=torch.int32), cp_size=2, rank=0),
            ValueError,
            r"every document must be padded to a multiple of 4, got lengths \[6, 6\]",
        ),
        (
            lambda: cpcompile.layouts.partition_indices(
                torch.tensor([0, 7], dtype=torch.int32), cp_size=2, rank=0, strategy="striped"
            ),
            ValueError,
            "the total 7 must be a multiple of 2",
        ),
        (
            lambda: cpcompile.layouts.partition_indices(
                torch.tensor([0, 8], dtype=torch.int32), cp_size=2, rank=0, num_tokens=12
            ),
            ValueError,
            r"cu_seqlens_padded\[-1\] = 8 does not match the token count 12",
        ),
        (
            lambda: cpcompile.layouts.pad_for_cp(torch.tensor([0, 4], dtype=torch.int32), cp_size=2, strategy="zigzag"),
            ValueError,
            "strategy must be one of",
        ),
        (
            lambda: cpcompile.layouts.partition_indices(cu_seqlens([8]), cp_size=2, rank=0, strategy="auto"),
            ValueError,
            "strategy 'auto' has no layout of its own",
        ),
        (
            lambda: cpcompile.layouts.pad_for_cp(cu_seqlens([8]), cp_size=2, strategy="auto"),
            ValueError,
            "strategy 'auto' has no layout of its own",
        ),
        (
            lambda: cpcompile.layouts.partition_indices(cu_seqlens([7]), cp_size=2, rank=0, strategy="balanced"),
            ValueError,
            "balanced with cp_size=2: the total 7 must be a multiple of 2",
        ),
    ],
)
def test_bad_layout_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()

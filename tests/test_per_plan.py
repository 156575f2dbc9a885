"""Tier 1: ``per_plan``, the memoisation of what kernels and ops derive from a plan (no GPU needed)."""

from __future__ import annotations

import gc
import weakref

import torch

from cpcompile.per_plan import ENTRIES, per_plan


def test_per_plan_builds_once_for_the_same_plan_tensors():
    calls = []

    @per_plan
    def derived(x, n):
        calls.append(n)
        return x * n

    x = torch.arange(4)
    first = derived(x, 2)
    assert derived(x, 2) is first and len(calls) == 1  # the next layer, same plan
    assert torch.equal(derived(x, 3), x * 3) and len(calls) == 2  # another argument
    assert torch.equal(derived(x.clone(), 3), x * 3) and len(calls) == 3  # equal values, another tensor
    y = x.clone()
    derived(y, 3)
    y.add_(1)  # changed in place: rebuilt
    assert torch.equal(derived(y, 3), (x + 1) * 3) and len(calls) == 5
    with torch.inference_mode():
        z = torch.arange(4)
        derived(z, 3), derived(z, 3)
    assert len(calls) == 7  # inference tensors carry no version: never cached


def test_per_plan_knows_views_by_memory_and_keeps_plans_while_they_live():
    calls = []

    @per_plan
    def derived(x):
        calls.append(1)
        return x * 2

    blocks = torch.arange(12).view(3, 4)  # a ring plan: one row per key block
    first = [derived(blocks[i]) for i in range(3)]
    assert [derived(blocks[i]) for i in range(3)] == first and len(calls) == 3  # new views, same memory
    assert torch.equal(derived(blocks[0, 1:]), blocks[0, 1:] * 2) and len(calls) == 4  # another slice
    assert torch.equal(derived(blocks[:, 0]), blocks[:, 0] * 2) and len(calls) == 5  # same address, other layout
    blocks[1].add_(1)  # the shared version counter: every view is rebuilt
    assert torch.equal(derived(blocks[2]), blocks[2] * 2) and len(calls) == 6
    newer = [torch.full((2,), i) for i in range(ENTRIES)]
    for x in newer:
        derived(x)
    derived(blocks[2])  # pushed out by the newer plans
    assert len(calls) == 7 + ENTRIES
    plan = torch.arange(5)
    result = weakref.ref(derived(plan))
    del plan
    gc.collect()
    assert result() is None  # the plan is gone, and with it what was derived from it

    @per_plan(collective=True)
    def agreed(x):  # runs collectives: no rank may evict an entry another keeps
        calls.append(1)
        return x * 2

    kept = torch.arange(3)
    agreed(kept)
    for x in newer:
        agreed(x)
    before = len(calls)
    agreed(kept)  # still there, past ENTRIES newer plans
    assert len(calls) == before
    result = weakref.ref(agreed(torch.arange(4)))
    gc.collect()
    assert result() is None  # entries still go with their plans

"""``per_plan``, the memoisation of what kernels and ops derive from a plan (no GPU needed)."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest
import torch

import cpcompile
from cpcompile.attention.api import _single_device_pieces
from cpcompile.cache import (
    ENTRIES,
    on_host,
    per_plan,
    readable,
    same_plan,
    token,
    twin,
    twinned,
    uncached,
    upload,
    within_capture,
)
from cpcompile.plan.pieces import step_plan


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


def test_a_remembered_result_is_found_by_its_arguments_memory_alone():
    calls = []

    @per_plan
    def inverse(x):
        calls.append(1)
        return torch.argsort(x)

    x = torch.tensor([2, 0, 1])
    made = torch.tensor([1, 2, 0])  # made together with x, as a plan's layout with its gather index
    inverse.remember(x, result=made)
    assert inverse(x) is made and inverse(x[:]) is made and not calls  # a view of the same memory too
    assert torch.equal(inverse(x.clone()), made) and len(calls) == 1  # equal values, another tensor: derived
    x.add_(0)  # a write through torch: the version moves on, the remembered result is not found
    assert inverse(x) is not made and len(calls) == 2
    y, kept = torch.tensor([0, 1]), torch.tensor([0, 1])
    inverse.remember(y, result=kept)
    ref = weakref.ref(kept)
    del y, kept
    gc.collect()
    assert ref() is None  # the entry went with its argument


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


def test_per_plan_is_shared_by_threads():
    """On CUDA the backward runs on the autograd engine's thread: it must find the forward's entries."""
    calls = []

    @per_plan
    def derived(x):
        calls.append(1)
        return x + 1

    x = torch.arange(3)
    derived(x)
    other = threading.Thread(target=derived, args=(x,))
    other.start()
    other.join()
    assert len(calls) == 1


def test_uploaded_tensors_keep_host_twins_while_unchanged():
    """``upload`` remembers the host copy (here to the ``meta`` device, which has no values to read)."""
    host = torch.arange(5)
    dev = upload(host, "meta")
    assert dev.device.type == "meta" and twin(dev) is host
    assert readable(dev)[0] is host and on_host(dev)[0] is host
    alone = torch.empty(7, device="meta")  # never uploaded: no twin, read as it is
    assert twin(alone) is None and readable(dev, alone) == (dev, alone)
    assert twin(host) is host  # on the host a tensor is its own twin
    dev.add_(1)  # changed in place: the twin no longer holds its values
    assert twin(dev) is None
    del dev
    gc.collect()


def test_twinned_runs_on_twins_and_uploads_its_results():
    seen = []

    @twinned
    def sizes(a, b, n):
        seen.append((a.device.type, b.device.type))
        return a + b, (int(a.sum()) if a.device.type == "cpu" else None), n

    # meta tensors have no addresses: only their shapes tell them apart
    a, b = upload(torch.arange(4), "meta"), upload(torch.ones(1, dtype=torch.int64), "meta")
    total, count, n = sizes(a, b, 1)
    assert seen == [("cpu", "cpu")] and (count, n) == (6, 1)
    assert total.device.type == "meta" and torch.equal(twin(total), torch.tensor([1, 2, 3, 4]))
    sizes(a, torch.empty(2, 1, dtype=torch.int64, device="meta"), 0)  # one argument without a twin: as it is
    assert seen[-1] == ("meta", "meta")
    cpu = torch.arange(3)
    assert sizes(cpu, cpu, 0)[1] == 3 and seen[-1] == ("cpu", "cpu")


def test_an_entry_evicted_under_the_lock_may_free_another_entrys_tensor():
    """Evicting an entry frees its result; when that result is another entry's argument, that entry
    goes too, from the weakref callback, while the cache's lock is held: a plain lock deadlocked."""

    @per_plan
    def derived(x):
        return x + 1

    def scenario():
        x = torch.arange(3)  # kept alive: its entry goes by eviction, not with it
        first = derived(x)
        derived(first)  # an entry whose argument is the first entry's result
        del first  # now only the first entry's value holds it
        kept = [torch.full((i + 4,), i) for i in range(ENTRIES + 1)]
        for t in kept:  # evicts the first entry, freeing its result
            derived(t)

    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "per_plan deadlocked evicting an entry"


def test_an_inference_tensors_upload_has_no_twin():
    """An inference tensor has no version counter to know it by: its upload is a plain copy, without
    a host twin (derivations then read the copy)."""
    with torch.inference_mode():
        frozen = torch.arange(3)
        frozen_dev = upload(frozen, "meta")  # meta stands for a device here
    assert twin(frozen_dev) is None and twin(upload(torch.arange(3), "meta")) is not None


def test_another_tensor_over_the_same_memory_is_another_plan():
    """A loader that refills one buffer and wraps it anew (``torch.from_numpy``) hands over a new
    tensor at the old address, its version counter at 0 again: per_plan must not take it for the
    plan it cached, nor a twin lookup for the tensor uploaded before (``meta``: every upload at
    address 0)."""
    import numpy as np

    calls = []

    @per_plan
    def total(t):
        calls.append(1)
        return int(t.sum())

    buffer = np.array([0, 3, 8], dtype=np.int32)
    first = torch.from_numpy(buffer)
    assert total(first) == 11 and total(first.detach()) == 11 and len(calls) == 1  # an alias of it: the same
    buffer[1] = 5
    assert total(torch.from_numpy(buffer)) == 13 and len(calls) == 2
    # the same tensor, refilled through numpy (no version bump): a small CPU tensor is known by its values too
    assert total(first) == 13 and len(calls) == 3
    buffer[1] = 4
    assert total(first) == 12 and len(calls) == 4
    hosts = torch.tensor([0, 1, 2]), torch.tensor([0, 5, 9])
    uploaded = [upload(h, "meta") for h in hosts]
    assert [twin(u) is h for u, h in zip(uploaded, hosts)] == [True, True]


def test_a_cuda_graph_replays_outputs_are_never_known_by_their_memory():
    """Inductor's cudagraph trees hand out the same output tensor (memory, address, version) at
    every replay, new values written into it; they mark it a cached tensor. A plan op reading such
    a tensor (``cu_seqlens`` computed inside a captured part of the model) must derive its plan
    anew each time, never from the replay before. Simulated on CPU: values changed behind the
    version counter, as a replay writes them."""
    calls = []

    @per_plan
    def total(t):
        calls.append(1)
        return int(t.sum())

    out = torch.tensor([0, 3, 8], dtype=torch.int32)
    enabled = torch._C._set_cached_tensors_enabled  # off again after: no CUDA graph lives in this process
    enabled(True)
    torch._C._add_cached_tensor(out)
    try:
        assert total(out) == 11 and total(out[1:]) == 11 and len(calls) == 2  # a view of it too
        out.numpy()[1] = 5  # the next replay's values, version unchanged
        assert out._version == 0 and total(out) == 13 and len(calls) == 3
        assert twin(out) is out  # on the CPU a tensor is its own twin
        assert not same_plan(token(out), out)  # the K/V gather's kept buffers are zeroed anew
    finally:
        torch._C._remove_cached_tensor(out)
        enabled(False)
    assert total(out) == 13 and total(out) == 13 and len(calls) == 4  # an ordinary tensor again: cached


def test_a_captured_steps_capture_derives_each_plan_once_for_its_layers(monkeypatch):
    """In a CUDA graph capture nothing is cached across calls (each capture derives its own, on the
    device), except within the capture of a whole step (``within_capture``, a CapturedStep's): there the
    first layer's derivation serves the others, whatever ``uncached`` says (the captured ops run in it),
    until the capture ends. Simulated on CPU: ``capturing`` made true."""
    import cpcompile.cache as cache

    calls = []

    @per_plan
    def derived(x, n):
        calls.append(n)
        return x * n

    monkeypatch.setattr(cache, "capturing", lambda: True)
    x = torch.arange(4)
    with uncached():
        assert derived(x, 2) is not derived(x, 2) and calls == [2, 2]  # a capture of cudagraph trees' part
    derived(x, 2)
    assert calls == [2, 2, 2]  # nor outside uncached: nothing kept in a capture by default
    with within_capture(), uncached():
        first = derived(x, 2)
        assert derived(x, 2) is first and derived(x[:], 2) is first and calls == [2, 2, 2, 2]  # the next layers
        assert torch.equal(derived(x, 3), x * 3) and calls[-1] == 3  # another argument
        x.add_(1)  # written in the capture: derived again
        assert torch.equal(derived(x, 2), x * 2) and len(calls) == 6
        with pytest.raises(RuntimeError, match="one capture at a time"):
            with within_capture():
                pass
    derived(x, 2)
    assert len(calls) == 7  # the capture's derivations went with it
    with within_capture(), torch.inference_mode():  # a step captured under inference mode: nothing to key by
        plan = torch.arange(4)
        assert torch.equal(derived(plan, 2), plan * 2) and torch.equal(derived(plan, 2), plan * 2)
    assert len(calls) == 9
    monkeypatch.setattr(cache, "capturing", lambda: False)
    with within_capture():  # not capturing (a CapturedStep's warm-up runs without one): the per-plan cache
        assert derived(x, 5) is derived(x, 5)


def _refilled_packs(docs: int, dtype=np.int32):
    """A loader's reused offsets buffer ``[docs + 1]`` (numpy) and two packs' offsets for it: the
    second the first's documents in another order (the same count, tokens and padding: a stale
    plan would be taken for it)."""
    g = np.random.default_rng(docs)
    lengths = g.integers(1, 5, docs)
    packs = [np.concatenate([[0], np.cumsum(order)]).astype(dtype) for order in (lengths, g.permutation(lengths))]
    assert not np.array_equal(*packs)
    return np.empty(docs + 1, dtype=dtype), packs


@pytest.mark.parametrize("docs, dtype", [(1100, np.int32), (5000, np.int32), (1100, np.int64)])
def test_a_refilled_buffer_of_any_size_is_known_by_its_values(docs, dtype):
    """Offsets past 4 KiB (more than 1,023 documents) refilled through numpy, version unchanged:
    the cache and a kept token both see the new pack."""
    calls = []

    @per_plan
    def plan(t, n):
        calls.append(1)
        return t.clone() * n

    buffer, (first, second) = _refilled_packs(docs, dtype)
    buffer[:] = first
    cu = torch.from_numpy(buffer)
    assert cu.nbytes > 4096
    assert torch.equal(plan(cu, 2), torch.from_numpy(first) * 2) and len(calls) == 1
    assert torch.equal(plan(cu[1:], 2), torch.from_numpy(first[1:]) * 2) and len(calls) == 2  # a view
    kept = token(cu)
    plan(cu, 2), plan(cu[1:], 2)  # the next layers: cached
    assert len(calls) == 2 and same_plan(kept, cu)
    buffer[:] = second
    assert cu._version == 0
    assert torch.equal(plan(cu, 2), torch.from_numpy(second) * 2) and len(calls) == 3
    assert torch.equal(plan(cu[1:], 2), torch.from_numpy(second[1:]) * 2) and len(calls) == 4
    assert not same_plan(kept, cu)
    plan(cu, 2), plan(cu[1:], 2)  # cached again for the new pack's layers
    assert len(calls) == 4
    buffer[-1] += 1  # a single offset
    assert int(plan(cu, 1)[-1]) == int(second[-1]) + 1 and len(calls) == 5


@pytest.mark.parametrize("docs", [1100, 5000])
def test_a_refilled_buffers_plan_is_the_new_packs(docs):
    """End to end on one process: the step plan, the ``cp_plan`` op and the pieces single-device attention
    runs on a refilled ``cu_seqlens`` buffer are exactly those of a fresh tensor of the new pack's offsets."""
    buffer, packs = _refilled_packs(docs)
    cu = torch.from_numpy(buffer)
    balanced, plain = (cpcompile.StrategySpec(s) for s in ("balanced", "no_load_balance"))
    tokens = int(cpcompile.layouts.pad_for_cp(torch.from_numpy(packs[0]), cp_size=2, strategy=balanced)[-1])
    assert tokens == int(cpcompile.layouts.pad_for_cp(torch.from_numpy(packs[0]), cp_size=2, strategy=plain)[-1])
    windowed = (tokens, 2, 1, balanced.strategy.value, balanced.stripe_size, (3,))
    layout = (plain.strategy.value, plain.stripe_size)  # the op's: a cheaper layout for 5,000 documents
    q = torch.empty(int(packs[0][-1]), 1, 4)
    seen = []
    for pack in packs:
        buffer[:] = pack
        fresh = torch.from_numpy(pack.copy())
        got, want = (
            [step_plan(t, None, *windowed), torch.ops.cpcompile.cp_plan.default(t, None, tokens, 2, 0, *layout)]
            for t in (cu, fresh)
        )
        for a, b in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        seen.append(got[0].gather_index)
        for window in ((-1, 0), (2, 1)):  # what single-device attention hands its kernel
            pieces = [_single_device_pieces(q, t, None, None, window) for t in (cu, fresh)]
            for field in dataclasses.fields(pieces[0]):
                a, b = (getattr(p, field.name) for p in pieces)
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name
    assert not torch.equal(*seen)  # the packs' plans differ: a stale one would have been caught

"""Captured CP attention (``ops.captured``): the op pair a CUDA graph captures with the rest of the step.

On the CPU there are no CUDA graphs; what is checked here is what makes a capture replay right
for every pack: the layered in-place backward with a fixed layer bound (FA4's, emulated on the
reference kernel, ``tests.emulated``) against float64 attention on random packs' real plans, the
bound itself, the loud failure of a pack beyond it, the compiler's choice of the captured ops and
the plan's place at the start of the graph, and training on 2 gloo ranks through them. The GPU
run (captures, replays, equal losses) is ``benchmarks/cuda_graphs.py`` (``tests/compiler/test_cuda_graphs.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from unittest import mock

import pytest
import torch

import cpcompile
from cpcompile import Capacity, StrategySpec
from cpcompile.attention.captured import LAYERS, capturable
from cpcompile.kernels import KeyGrads, Pieces, reference
from cpcompile.kernels.contract import KeyPartials
from cpcompile.kernels.metadata import scratch
from cpcompile.plan.pieces import make_plan
from cpcompile.testing import GPTConfig, PackedGPT, synthetic_pack
from tests import emulated
from tests.fixtures import KINDS, cu_seqlens, random_pack
from tests.graphs import FakeGroupTestCase

CASES = [(s.value, cp, kind) for s in LAYERS for cp in (2, 3, 8) for kind in KINDS]


@pytest.mark.parametrize(("strategy", "cp", "kind"), CASES)
def test_captured_backward_of_every_rank_equals_float64_attention(strategy, cp, kind):
    """Every rank's pieces of random packs (1-token and zero-length documents, single documents, packs
    whose padding is cp), both masks, over the all-gathered keys in a shuffled order (as
    ``ops.gathered`` hands them): the emulated FA4 forward, and the backward with the strategy's layer
    bound (``LAYERS``: one call per layer in place, every dK/dV row written), equal the reference's.
    Had a rank's pieces needed more layers, or fallen within one, the device-side checks would raise."""
    rng = random.Random(f"{strategy}-{cp}-{kind}")
    for _ in range(3):
        cu = cu_seqlens(random_pack(rng, cp, kind))
        spec = StrategySpec(strategy)
        for rank in range(cp):
            plan = make_plan(cu, cp_size=cp, rank=rank, strategy=spec)
            n, t_local = plan.gather_index.shape[0], plan.cu_q[-1].item()
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            q = torch.randn(t_local, 4, 8, dtype=torch.float64, generator=g)
            k, v = (torch.randn(n, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
            dout = torch.randn_like(q)
            order = torch.randperm(n, generator=g)
            for causal in (True, False):
                pieces = Pieces(plan.cu_q, plan.k_start, plan.k_len(causal))
                kw = {"causal": causal, "scale": 0.3}
                want = reference.forward(q, k, v, pieces, **kw)
                want_grads = reference.backward(dout, q, k, v, *want, pieces, **kw)
                calls: list = []
                kernel = emulated.fa4(calls)
                got = kernel.forward(q, k, v, pieces, **kw)
                layers = LAYERS[spec.strategy]
                grads = kernel.backward(dout, q, k, v, *got, pieces, grads=KeyGrads(order), layers=layers, **kw)
                assert len(calls) == LAYERS[spec.strategy] and all(rows for rows, _ in calls)
                label = f"{strategy} cp={cp} rank {rank} causal={causal} {cu.tolist()}"
                for name, a, b in zip(("out", "lse"), got, want, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name} {label}")
                wanted = (want_grads[0], want_grads[1][order], want_grads[2][order])
                for name, a, b in zip(("dq", "dk", "dv"), grads, wanted, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name} {label}")


def test_captured_backward_hands_over_the_layers_rows_when_asked_for_parts():
    """``KeyGrads(partial=True)`` on a captured backward: each layer's rows with their index (every
    layer's call writes every key row it reads), summing to the reference's dK/dV."""
    cu_q = torch.tensor([0, 4, 8, 11], dtype=torch.int32)  # a head piece and a tail piece of one document
    k_start, k_len = torch.tensor([0, 0, 9], dtype=torch.int32), torch.tensor([4, 9, 3], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(11, 2, 4, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(12, 1, 4, dtype=torch.float64, generator=g) for _ in range(2))
    pieces, kw = Pieces(cu_q, k_start, k_len), {"causal": True, "scale": 0.5}
    out, lse = reference.forward(q, k, v, pieces, **kw)
    want = reference.backward(dout, q, k, v, out, lse, pieces, **kw)
    dq, *parts = emulated.fa4().backward(dout, q, k, v, out, lse, pieces, grads=KeyGrads(partial=True), layers=2, **kw)
    assert all(isinstance(p, KeyPartials) and p.index.shape == (2, 12) for p in parts)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, *map(scratch.sum_partials, parts)), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_a_pack_beyond_the_layers_fails_on_the_host_and_on_the_device_not_silently():
    """Pieces that the layer bound cannot hold (three prefixes of one document for two layers), or
    whose key ranges fall within a layer, fail the plan op's host check (``check_layers``, before the
    step) and, were it skipped, the backward's device-side assertion (on the CPU, at once): summed
    without some piece's dK/dV, the gradient would be wrong without a word."""
    from cpcompile.attention.plan_op import check_layers

    q = torch.randn(6, 2, 4, dtype=torch.float64)
    k, v = torch.randn(8, 1, 4, dtype=torch.float64), torch.randn(8, 1, 4, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    three = Pieces(cu_q, torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([2, 4, 6], dtype=torch.int32))
    falling = Pieces(cu_q, torch.tensor([4, 0, 2], dtype=torch.int32), torch.tensor([2, 2, 2], dtype=torch.int32))
    kernel, kw = emulated.fa4(), {"causal": True, "scale": 0.5}
    for pieces, layers, message in ((three, 2, "fits none of the captured layers"), (falling, 1, "overlap or fall")):
        with pytest.raises(ValueError, match=f"more than the {layers} that captured attention runs"):
            check_layers(pieces.cu_q, pieces.k_start, pieces.k_len, pieces.k_len, layers, 3)
        if pieces is three:  # in key order: three layers hold it
            check_layers(pieces.cu_q, pieces.k_start, pieces.k_len, pieces.k_len, 3, 3)
        out, lse = reference.forward(q, k, v, pieces, **kw)
        with pytest.raises(RuntimeError, match=message):
            kernel.backward(torch.randn_like(q), q, k, v, out, lse, pieces, layers=layers, **kw)


def test_backends_that_size_work_on_the_host_refuse_a_captured_backward():
    """flash's and cuDNN's backwards (and ``auto``'s) derive host-side sizes from the plan: asked for a
    captured backward (``layers``), they raise naming the kernels that can."""
    from cpcompile.kernels import auto, cudnn, flash

    q = torch.randn(4, 2, 8)
    pieces = Pieces(torch.tensor([0, 4], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    torch.full((1,), 4, dtype=torch.int32))  # fmt: skip
    for backend in (flash, cudnn, auto):
        with pytest.raises(ValueError, match="cannot run in a CUDA graph capture"):
            backend.backward(q, q, q, q, q, q[:, :, 0].t(), pieces, causal=True, scale=1.0, layers=2)


def _inductor_as_aot_eager(graphs: list):
    """``compile_fx`` stood in for by ``aot_eager`` (the CPU has no CUDA graphs), recording each graph
    the backend hands it and the config patches it gets."""
    import torch._inductor.compile_fx as inductor

    def recording(gm, example_inputs, config_patches=None, **kwargs):
        graphs.append((gm, config_patches))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return mock.patch.object(inductor, "compile_fx", recording)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


class CapturedOpsInTheGraph(FakeGroupTestCase):
    def _compile(self, spec: StrategySpec) -> torch.fx.GraphModule:
        cfg = GPTConfig(vocab=32, dim=16, heads=2, kv_heads=1, layers=2, max_position=64)
        pack = synthetic_pack([5, 9, 2], cfg.vocab, torch.Generator().manual_seed(0))
        names = ("input_ids", "position_ids")
        batch = cpcompile.shard_batch({n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=2, rank=1,
                                      strategy=spec)  # fmt: skip
        graphs: list = []
        torch._dynamo.reset()
        kv = "all_gather" if spec.kv == "auto" else spec.kv  # the fake group: no exchange
        with _inductor_as_aot_eager(graphs), cpcompile.strategy(batch, kv=kv):
            backend = cpcompile.backend()
            compiled = torch.compile(PackedGPT(cfg), backend=backend, dynamic=False, mode="reduce-overhead")
            compiled(*(batch.tensors[n] for n in names), batch.cu_seqlens, 9).sum().backward()
        return graphs[0][0]

    def test_capturable_calls_become_captured_ops_fed_by_a_plan_at_the_start(self):
        """Under CUDA graphs with a capacity, each attention call of balanced, dual_chunk_swap and
        no_load_balance becomes ``cp_attention_captured`` (with the strategy's layer bound), and its plan
        op comes first, before any computation, so that it does not cut the captured forward in two."""
        for strategy in ("balanced", "dual_chunk_swap", "no_load_balance"):
            gm = self._compile(StrategySpec(strategy, capacity=Capacity(tokens=32, documents=4)))
            targets = _targets(gm)
            assert targets.count("cpcompile.cp_attention_captured.default") == 2, targets
            assert "cpcompile.cp_attention.default" not in targets, targets
            first = [t for t in targets if t != "<built-in function getitem>"][0]
            assert first == "cpcompile.cp_plan.default", targets
            layers = [n.args[-1] for n in gm.graph.nodes if "captured" in str(n.target)]
            assert layers == [LAYERS[cpcompile.Strategy(strategy)]] * 2, layers

    def test_calls_that_cannot_be_captured_stay_between_the_captured_parts(self):
        """Striped (as many layers as a document has stripes on a rank) and the ring keep ``cp_attention``
        / ``cp_ring_attention``, which inductor's graph partitions leave out of the CUDA graphs, as before;
        so do sliding windows, head parallelism and kernels that size their work on the host, each
        with its reason (logged by the pass)."""
        bucket = Capacity(tokens=48, documents=4)
        for spec, op in (
            (StrategySpec("striped", capacity=bucket), "cp_attention"),
            (StrategySpec("balanced", kv="ring", capacity=bucket), "cp_ring_attention"),
        ):
            targets = _targets(self._compile(spec))
            assert f"cpcompile.{op}.default" in targets and not any("captured" in t for t in targets), (spec, targets)
        q, spec = torch.empty(8, 2, 16), StrategySpec("balanced", capacity=bucket)
        assert capturable(spec, q, None, (-1, 0)) is None and capturable(spec, q, "reference", (-1, -1)) is None
        for args, why in (
            ((spec, q, None, (4, 0)), "window_size=(4, 0)"),
            ((spec, q, "cudnn", (-1, 0)), "kernel 'cudnn'"),
            ((StrategySpec("balanced", kv="heads", head_parallel=2), q, None, (-1, 0)), "kv='heads'"),
            ((StrategySpec("balanced", kv="exchange"), q, None, (-1, 0)), "kv='exchange'"),
            ((StrategySpec("striped"), q, None, (-1, 0)), "strategy 'striped'"),
        ):
            assert why in capturable(*args), (args, capturable(*args))


class _OnCuda:
    """What ``capturable`` reads of a CUDA bfloat16 tensor ``shape`` (this machine has no GPU)."""

    def __init__(self, *shape: int) -> None:
        self.shape, self.dtype, self.is_cuda, self.device = shape, torch.bfloat16, True, torch.device("cuda", 0)

    def dim(self) -> int:
        return len(self.shape)


def test_a_value_head_dim_fa4_cannot_run_is_not_captured(monkeypatch):
    """FA4 on Hopper (head dims up to 256): keys of 128 with values of 512 (an MLA-like call) are not
    captured, whose op would then find no kernel; values of 128 are."""
    from cpcompile.kernels import fa4

    monkeypatch.setattr(fa4, "available", lambda: True)
    monkeypatch.setattr(fa4, "_major", lambda device: 9)
    q, spec = _OnCuda(8, 2, 128), StrategySpec("balanced")
    assert capturable(spec, q, None, (-1, 0), v=_OnCuda(8, 2, 128)) is None
    assert "value head dim 512" in capturable(spec, q, None, (-1, 0), v=_OnCuda(8, 2, 512))


def _train_captured(rank: int, world: int) -> None:
    import torch._dynamo

    from cpcompile.attention import captured
    from cpcompile.testing import summed_loss
    from tests.dist import assert_matches_summed_over_ranks

    calls: list = []
    captured._kernel = lambda q, name, v: emulated.fa4(calls)  # FA4's arrangement, on the CPU
    cfg = GPTConfig(vocab=32, dim=32, heads=4, kv_heads=2, layers=2, max_position=256)
    for strategy in ("balanced", "dual_chunk_swap"):
        torch.manual_seed(0)
        reference, model = PackedGPT(cfg), PackedGPT(cfg)
        model.load_state_dict(reference.state_dict())
        # dual_chunk_swap's K/V come in two head groups (StrategySpec.kv_chunks): one captured backward each
        chunks = 2 if strategy == "dual_chunk_swap" else 1
        spec = StrategySpec(strategy, capacity=Capacity(tokens=96, documents=8), kv_chunks=chunks)
        graphs: list = []
        torch._dynamo.reset()
        with _inductor_as_aot_eager(graphs):
            backend = cpcompile.backend()
            compiled = torch.compile(model, backend=backend, dynamic=False, mode="reduce-overhead")
            g = torch.Generator().manual_seed(3)
            for step, lengths in enumerate(([5, 17, 1, 9], [40], [2, 0, 11, 1, 6, 3])):
                pack = synthetic_pack(lengths, cfg.vocab, g)
                reference.zero_grad()
                want = reference(pack["input_ids"], pack["position_ids"], pack["cu_seqlens"], 40)
                want = summed_loss(want, pack["labels"])
                want.backward()
                names = ("input_ids", "labels", "position_ids")
                batch = cpcompile.shard_batch({n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=world,
                                              rank=rank, strategy=spec)  # fmt: skip
                t = batch.tensors
                model.zero_grad()
                calls.clear()
                with cpcompile.strategy(batch):
                    loss = summed_loss(compiled(t["input_ids"], t["position_ids"], batch.cu_seqlens, 40), t["labels"])
                loss.backward()
                assert len(calls) == 2 * chunks * LAYERS[spec.strategy], f"{len(calls)} backward calls, {strategy}"
                label = f"captured {strategy} step {step}"
                assert_matches_summed_over_ranks(loss, want, model, reference, label, 1e-4)
        assert len(graphs) == 1 and "cpcompile.cp_attention_captured.default" in _targets(graphs[0][0]), graphs


@pytest.mark.distributed
def test_a_compiled_model_trains_through_the_captured_ops_like_one_process():
    """2 gloo ranks, balanced and dual_chunk_swap (K/V in two head groups) on a capacity,
    ``mode="reduce-overhead"`` (inductor stood in for by ``aot_eager``): the captured ops, with FA4's
    layered backward emulated, give the single-process loss and every gradient on three packs of 1-6
    documents, one graph."""
    from tests.dist import run_ranks

    run_ranks(_train_captured, 2)


def test_plan_slots_refill_a_captured_plan_for_every_pack_of_the_bucket():
    """``CapturedStep``'s plan slots (the CPU part of it): a plan op call seen in the warm-up tells the
    slot's shapes, the same call in the capture (on the step's input buffers) gets buffers of them,
    and before each replay the buffers take the next pack's plan, as ``step_plan`` makes it; a plan
    of a tensor that is no input of the step, or a pack of another shape, raises."""
    from cpcompile.plan.pieces import plan_extras, step_plan
    from cpcompile.plan.slots import PlanSlots

    spec = StrategySpec("balanced", capacity=Capacity(tokens=64, documents=5))
    packs = []
    for lengths in ([5, 17, 1, 9], [40], [2, 0, 11, 1, 6]):
        batch = cpcompile.shard_batch({"x": torch.zeros(sum(lengths))}, cu_seqlens(lengths), cp_size=2, rank=1,
                                      strategy=spec)  # fmt: skip
        packs.append(batch.cu_seqlens)
    rest = (64, 2, 1, "balanced", 1, *plan_extras(spec))
    slots = PlanSlots()
    slots.warming([packs[2], 7])  # a warm-up call on another pack of the bucket than the capture's
    slots.seen(step_plan, (packs[2], None, *rest), step_plan(packs[2], None, *rest))
    static = [packs[0].clone(), 7]
    slots.capture(static, layers=1)
    buffers = slots.add(step_plan, (static[0], None, *rest))
    with pytest.raises(ValueError, match="from the step's own inputs"):
        slots.add(step_plan, (packs[1], None, *rest))
    captured = slots.captured()
    assert not slots.capturing and slots.layers is None
    for cu in packs:
        slots.fill(slots.plans(slots.calls([cu, 7])), captured)
        for buffer, want in zip(buffers, step_plan(cu, None, *rest), strict=True):
            assert torch.equal(buffer, want)
    # a pack not padded to the bucket's documents: the plan refuses it (``check_capacity_documents``)
    with pytest.raises(ValueError, match=r"attention takes the batch's cu_seqlens .* got 2 documents"):
        slots.plans(slots.calls([cu_seqlens([3, 3]), 7]))


def test_a_captured_backward_runs_the_layers_its_capturing_step_was_told():
    """Inside a ``CapturedStep``'s capture told its pack's count of layers, the captured attention's backward
    runs that many (never more than its strategy's bound, at least one); outside one, the bound. And the
    count a pack needs (``pack_layers``), alike on every rank: the most of any rank's, one for pieces over
    disjoint keys, two where a rank holds the head and the tail of one document (both read its first keys)."""
    from cpcompile.attention.plan_op import layers_needed, step_plan_in_layers
    from cpcompile.compiler.captured_step import pack_layers
    from cpcompile.plan import slots as plan_slots
    from cpcompile.plan.pieces import plan_extras, step_plan

    slots = plan_slots.PlanSlots()
    assert plan_slots.layers_in_capture(2) == 2
    plan_slots.ACTIVE.slots = slots
    try:
        slots.capture([], layers=1)
        assert plan_slots.layers_in_capture(2) == 1
        slots.capture([], layers=0)
        assert plan_slots.layers_in_capture(2) == 1
        slots.capture([], layers=3)
        assert plan_slots.layers_in_capture(2) == 2
        slots.captured()
        assert plan_slots.layers_in_capture(2) == 2
    finally:
        plan_slots.ACTIVE.slots = None

    def counts(lengths, strategy):  # every rank's own count, and the pack's (every rank's most)
        spec = StrategySpec(strategy)
        cu = cu_seqlens(lengths)
        padded = cpcompile.layouts.pad_for_cp(cu, cp_size=2, strategy=spec)
        args = (cu, padded, int(padded[-1]), 2, 0, strategy, 1, *plan_extras(spec))
        own = []
        for rank in range(2):
            plan = step_plan(*args[:4], rank, *args[5:])
            own.append(layers_needed(plan.cu_q, plan.k_start, plan.k_len_causal, plan.k_len_full)[0])
        return own, pack_layers({(step_plan_in_layers, None): args})

    # dual_chunk_swap at cp=2: rank 0 holds chunks 0 and 3 of the document, both reading its first keys;
    # rank 1's chunks 1 and 2 are one piece
    assert counts([16], "dual_chunk_swap") == ([2, 1], 2)
    # documents of one token each: every piece reads its own key alone (rank 1 holds padding only)
    assert counts([1, 1, 1, 1], "dual_chunk_swap") == ([1, 0], 1)
    # balanced cuts the long document into rank 0's head and tail: rank 1 needs one layer, the pack two,
    # so that both ranks replay the graph of two
    assert counts([1, 300], "balanced") == ([2, 1], 2)


def test_a_packs_count_of_layers_is_every_ranks_plans_most_on_random_packs():
    """``pack_layers`` (every rank's pieces from the layout's runs) against each rank's own plan made token by
    token (``step_plan``, ``layers_needed``), on random packs of every kind, every layout, cp 2-8, with and
    without a capacity bucket and a window."""
    from cpcompile.attention.plan_op import layers_needed, step_plan_in_layers
    from cpcompile.compiler.captured_step import pack_layers
    from cpcompile.plan.pieces import plan_extras, step_plan

    rng = random.Random(11)
    for case in range(120):
        cp, kind = rng.choice([2, 3, 4, 8]), KINDS[case % len(KINDS)]
        lengths = random_pack(rng, cp, kind)
        spec = StrategySpec(rng.choice(["balanced", "dual_chunk_swap", "striped", "no_load_balance"]))
        if case % 3 == 1 and spec.strategy.value == "balanced":  # windows shape balanced's layout alone
            spec = StrategySpec(spec.strategy, windows=(rng.randint(1, 8),))
        cu = cu_seqlens(lengths)
        if case % 4 == 2:  # a bucket of more tokens and documents, as shard_batch pads a pack to it
            spec = dataclasses.replace(spec, capacity=cpcompile.layouts.capacity_for([cu], cp_size=cp, strategy=spec))
            tokens = {"x": torch.zeros(int(cu[-1]))}
            batch = cpcompile.shard_batch(tokens, cu, cp_size=cp, rank=0, strategy=spec)
            cu, padded = batch.cu_seqlens, batch.cu_seqlens_padded
        else:
            padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
        args = (cu, padded, int(padded[-1]), cp, 0, spec.strategy.value, spec.stripe_size, *plan_extras(spec))
        own = [layers_needed(*step_plan(*args[:4], r, *args[5:])[1:5])[0] for r in range(cp)]
        assert pack_layers({(step_plan_in_layers, None): args}) == max(1, *own), (lengths, cp, spec)


def test_a_captured_step_knows_inputs_by_memory_and_plans_from_any_thread():
    """What a ``CapturedStep`` keys its graphs by: an input given twice, as one object or as two views of
    the same memory (Hugging Face's ``cu_seq_lens_q``/``_k``), is one tensor, others are not; and a plan
    op called on another thread while the step warms up (the autograd engine's, recomputing a
    checkpointed layer's plan in the backward) reaches the step's plan slots."""
    import threading

    from cpcompile.compiler import captured_step
    from cpcompile.plan import slots as plan_slots

    cu, other = torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8])
    same = cu.view(3)
    assert captured_step._shapes([cu, same, other, 7]) == [((3,), torch.int64, cu.device, i) for i in (0, 0, 2)] + [7]
    slots = plan_slots.PlanSlots()
    slots.warming([cu])
    plan_slots.ACTIVE.slots = slots
    try:
        thread = threading.Thread(target=plan_slots.note_plan, args=(len, (same,), (torch.zeros(4),)))
        thread.start()
        thread.join()
    finally:
        plan_slots.ACTIVE.slots = None
    assert slots._seen == {(len, (("input", 0),)): [((4,), torch.float32, torch.device("cpu"))]}


class InACapture(FakeGroupTestCase):
    def test_ops_that_size_work_on_the_host_refuse_a_capture(self):
        """While a CUDA graph is captured (simulated: the CPU has none), the plan op outside a
        ``CapturedStep``, every op that selects an attention kernel and the TP overlap ops raise
        ``RuntimeError`` naming the ways that work, rather than record one pack's sizes for all."""
        from cpcompile import cache as per_plan
        from cpcompile.attention import plan_op as plan_ops

        cu = cu_seqlens([5, 3])
        q = torch.randn(8, 2, 4)
        capturing = (mock.patch.object(module, "capturing", lambda: True) for module in (per_plan, plan_ops))
        with contextlib.ExitStack() as stack:
            for patch in capturing:
                stack.enter_context(patch)
            with pytest.raises(RuntimeError, match="CapturedStep"):
                torch.ops.cpcompile.cp_plan(cu, None, 8, 2, 1, "balanced", 1)
            with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
                cpcompile.packed_attention(q, q, q, cu)
            with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
                cpcompile.tp.ag_gemm(torch.randn(4, 8), torch.randn(8, 8), group=self.group)


def test_captured_step_takes_cuda_tensors_and_a_positive_warmup():
    with pytest.raises(ValueError, match="warmup must be a positive int"):
        cpcompile.CapturedStep(lambda x: x, module=None, warmup=0)
    with pytest.raises(ValueError, match="CapturedStep takes CUDA tensors, got input 0 on cpu"):
        cpcompile.CapturedStep(lambda x: x, module=None)(torch.zeros(2))


class CapturedStepBackend(FakeGroupTestCase):
    def test_a_backend_for_a_captured_step_emits_the_captured_ops_and_needs_a_capacity(self):
        """``cpcompile.backend(captured_step=True)`` without ``mode``: the same captured ops as under
        ``mode="reduce-overhead"``, and the same refusal of packs without a capacity."""
        from torch._dynamo.exc import BackendCompilerFailed

        cfg = GPTConfig(vocab=32, dim=16, heads=2, kv_heads=1, layers=1, max_position=64)
        pack = synthetic_pack([5, 9, 2], cfg.vocab, torch.Generator().manual_seed(0))
        names = ("input_ids", "position_ids")
        for spec in (StrategySpec("balanced", capacity=Capacity(tokens=32, documents=4)), StrategySpec("balanced")):
            batch = cpcompile.shard_batch({n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=2, rank=1,
                                          strategy=spec)  # fmt: skip
            graphs: list = []

            def inner(gm, example_inputs, graphs=graphs):
                graphs.append(gm)
                return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

            torch._dynamo.reset()
            backend = cpcompile.backend(inner=inner, captured_step=True)
            compiled = torch.compile(PackedGPT(cfg), backend=backend, dynamic=False)
            # the fake group: no exchange
            with cpcompile.strategy(batch, kv="all_gather"), contextlib.ExitStack() as stack:
                if spec.capacity is None:
                    stack.enter_context(pytest.raises(BackendCompilerFailed, match="capacity bucket"))
                compiled(*(batch.tensors[n] for n in names), batch.cu_seqlens, 9)
            if spec.capacity is not None:
                assert "cpcompile.cp_attention_captured.default" in _targets(graphs[0])

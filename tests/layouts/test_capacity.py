"""Capacity buckets (``StrategySpec.capacity``): every pack of a bucket padded to one shape.

The layout against the least padding (the last document's padding runs on), the loader's shapes
and errors, one compiled graph for packs of any composition with ``dynamic=False`` (the fake
group), and exactness on gloo ranks. Every rank's pieces on packs padded to a capacity against
float64 single-device attention: ``tests/plan/test_pieces.py``'s simulated ranks.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.utils import counters

import cpcompile
from cpcompile import Capacity, StrategySpec
from cpcompile.batch import physical_positions
from cpcompile.cost.model import resolve_auto
from cpcompile.layouts.partition import padding_multiple
from cpcompile.plan.pieces import plan_extras, step_plan
from cpcompile.testing import GPTConfig, PackedGPT, synthetic_pack
from tests.graphs import FakeGroupTestCase

STRATEGIES = [
    StrategySpec("dual_chunk_swap"),
    StrategySpec("no_load_balance"),
    StrategySpec("striped", stripe_size=2),
    StrategySpec("balanced"),
]


OWN_CU = (
    r"under capacity=\(\d+, \d+\) attention takes the batch's cu_seqlens .* got \d+ documents: pass batch.cu_seqlens"
)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _with(spec: StrategySpec, capacity) -> StrategySpec:
    return StrategySpec(spec.strategy, spec.stripe_size, capacity=capacity)


@pytest.mark.parametrize("spec", STRATEGIES, ids=str)
@pytest.mark.parametrize("lengths", [[5, 17, 1], [40], [3, 0, 9], [3, 0]])
def test_the_last_documents_padding_runs_on_to_the_capacity(spec, lengths):
    cu, cp = _cu(lengths), 4
    least = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    got = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=_with(spec, (128, 4)))
    assert torch.equal(got[:-1], least[:-1]) and int(got[-1]) == 128 and got.dtype == torch.int32


def test_a_pack_that_does_not_fit_is_refused_naming_the_capacity():
    cu = _cu([50, 60])
    with pytest.raises(ValueError, match=r"needs 120 tokens .* more than capacity.tokens=104: use a larger capacity"):
        cpcompile.layouts.pad_for_cp(cu, cp_size=4, strategy=StrategySpec("dual_chunk_swap", capacity=(104, 4)))
    with pytest.raises(ValueError, match="capacity.tokens=126 must be a multiple of 4 for balanced with cp_size=4"):
        cpcompile.layouts.pad_for_cp(cu, cp_size=4, strategy=StrategySpec("balanced", capacity=(126, 4)))
    tensors = {"input_ids": torch.zeros(110, dtype=torch.long)}
    with pytest.raises(ValueError, match="the pack has 2 documents, more than capacity.documents=1"):
        cpcompile.shard_batch(tensors, cu, cp_size=2, rank=0, strategy=StrategySpec("balanced", capacity=(128, 1)))


def test_attention_takes_the_batchs_cu_seqlens():
    """Under a capacity the plan is made from the batch's ``cu_seqlens`` (zero-length documents after the
    last): the pack's own, of the same token count, would lay out the capacity's padding otherwise."""
    cu, spec = _cu([5, 17, 1, 9]), StrategySpec("dual_chunk_swap", capacity=(64, 6))
    batch = cpcompile.shard_batch({"x": torch.zeros(32)}, cu, cp_size=2, rank=0, strategy=spec)
    cpcompile.plan.make_plan(batch.cu_seqlens, cp_size=2, rank=0, strategy=spec)
    with pytest.raises(ValueError, match=OWN_CU):
        cpcompile.plan.make_plan(cu, cp_size=2, rank=0, strategy=spec)


def test_a_batch_of_another_capacity_is_refused_naming_the_capacity():
    """A batch sharded under one capacity and run under another has the other's token count: the error
    names the capacity (the offsets' mismatch alone would not say why)."""
    cu, spec = _cu([5, 17, 1, 9]), StrategySpec("balanced", capacity=(96, 6))
    batch = cpcompile.shard_batch({"x": torch.zeros(32)}, cu, cp_size=2, rank=0, strategy=_with(spec, (64, 6)))
    with pytest.raises(ValueError, match=r"under capacity=\(96, 6\) a batch holds 96 tokens \(48 per rank at "):
        cpcompile.plan.make_plan(batch.cu_seqlens, cp_size=2, rank=0, strategy=spec, num_tokens=64)


@pytest.mark.parametrize("value", [(0, 4), (128,), (128, 4, 1), ("128", 4), (128.0, 4), 128, (True, 4)], ids=repr)
def test_capacity_values_are_checked(value):
    with pytest.raises(ValueError, match=r"capacity must be a Capacity\(tokens, documents\)"):
        StrategySpec("balanced", capacity=value)


def test_capacity_takes_a_pair_and_refuses_head_parallelism():
    assert StrategySpec("balanced", capacity=(64, 3)).capacity == Capacity(tokens=64, documents=3)
    with pytest.raises(ValueError, match=r"capacity=\(64, 3\) is not supported with head_parallel=2 yet"):
        StrategySpec("balanced", kv="heads", head_parallel=2, capacity=(64, 3))


@pytest.mark.parametrize(
    ("lengths", "cp", "tokens"),
    [([976], 2, 978), ([29, 24, 14, 1668, 1828], 4, 3568), ([1533, 4, 14, 767, 234], 4, 2552)],
)
def test_auto_picks_among_the_layouts_the_pack_fits(lengths, cp, tokens):
    """Under a capacity ``auto`` picks among the layouts under which the pack fits it. Without the capacity
    it picks a layout under which these packs do not fit (dual_chunk_swap's per-document padding, striped's
    multiple), so they were refused, naming a layout the user never chose, though balanced and
    no_load_balance hold them."""
    cu, spec = _cu(lengths), StrategySpec("auto", capacity=(tokens, 6))
    unbounded = resolve_auto(StrategySpec("auto"), cu, cp_size=cp).strategy.value
    assert unbounded in ("dual_chunk_swap", "striped"), unbounded
    batch = cpcompile.shard_batch({"x": torch.zeros(sum(lengths))}, cu, cp_size=cp, rank=0, strategy=spec)
    assert batch.spec.strategy.value in ("no_load_balance", "balanced") and batch.cu_seqlens_padded[-1] == tokens
    with pytest.raises(
        ValueError, match=r"'auto' under capacity=\(8, 6\) at cp_size=2: the pack fits none .*balanced: "
    ):
        resolve_auto(StrategySpec("auto", capacity=(8, 6)), cu, cp_size=2)


@pytest.mark.parametrize(
    ("lengths", "cp", "spec"),
    [
        ([30, 23, 0, 12, 25], 4, StrategySpec("auto", windows=(11, 1, 7), capacity=(96, 8))),
        ([22, 9, 14, 22, 10, 15], 3, StrategySpec("auto", capacity=(93, 9))),
    ],
)
def test_auto_picks_from_the_documents_the_plan_ops_see(lengths, cp, spec):
    """With a capacity, the loader resolves auto over the pack with the bucket's empty documents, as
    the plan ops do from ``ShardedBatch.cu_seqlens`` when the model runs under the unresolved spec:
    these packs pick another layout without them (the layouts then disagree silently)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tensors = {"x": torch.arange(int(cu[-1]))}
    sharded = cpcompile.shard_batch(tensors, cu, cp_size=cp, rank=0, strategy=spec)
    assert resolve_auto(spec, sharded.cu_seqlens, cp_size=cp) == sharded.spec
    assert resolve_auto(spec, cu, cp_size=cp).strategy is not sharded.spec.strategy  # the case in point
    plan = step_plan(sharded.cu_seqlens, None, int(sharded.cu_seqlens_padded[-1]), cp, 0, "auto", 1, *plan_extras(spec))
    direct = cpcompile.plan.make_plan(
        sharded.cu_seqlens, sharded.cu_seqlens_padded, cp_size=cp, rank=0, strategy=sharded.spec
    )
    assert torch.equal(plan.gather_index, direct.gather_index)


def test_shard_batch_gives_every_pack_of_a_bucket_one_shape():
    capacity = Capacity(tokens=96, documents=6)
    for lengths in ([5, 17, 1], [40], [3, 0, 9, 2, 2, 1]):
        cu = _cu(lengths)
        tensors = {"input_ids": torch.arange(int(cu[-1])), "labels": torch.arange(int(cu[-1]))}
        batch = cpcompile.shard_batch(
            tensors, cu, cp_size=2, rank=1, strategy=StrategySpec("balanced", capacity=capacity)
        )
        assert batch.cu_seqlens.shape == (7,) and batch.cu_seqlens_padded.shape == (7,)
        assert (
            torch.equal(batch.cu_seqlens[: len(lengths) + 1], cu) and (batch.cu_seqlens[len(lengths) :] == cu[-1]).all()
        )
        assert batch.tensors["input_ids"].shape == (48,) and int(batch.cu_seqlens_padded[-1]) == 96
        real = physical_positions(batch.cu_seqlens, batch.cu_seqlens_padded)
        mine = torch.isin(batch.indices, real)
        assert (batch.tensors["labels"][~mine] == -100).all(), "padding rows carry no label"


def _static_graphs(shapes: list):
    """An inner backend (aot_eager) that records, per graph the pass hands it, every symbolic size
    its nodes carry (``[]``: every size a constant)."""

    def inner(gm, example_inputs):
        symbolic = []
        for node in gm.graph.nodes:
            vals = node.meta.get("val", node.meta.get("example_value"))
            for val in vals if isinstance(vals, (tuple, list)) else [vals]:
                if isinstance(val, torch.Tensor) and not all(isinstance(n, int) for n in val.shape):
                    symbolic.append((node.name, tuple(val.shape)))
                elif isinstance(val, torch.SymInt):
                    symbolic.append((node.name, val))
        shapes.append(symbolic)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return inner


class OneGraphPerBucket(FakeGroupTestCase):
    def test_packs_of_any_composition_share_one_graph_without_dynamic_shapes(self):
        """With ``dynamic=False`` a pack's token and document counts would each compile a graph of their
        own; padded to one capacity, every pack runs the one graph (what a CUDA graph capture needs),
        and nothing in it has a symbolic size (the plan's pieces included)."""
        cfg = GPTConfig(vocab=32, dim=32, heads=2, kv_heads=1, layers=2, max_position=256)
        model = PackedGPT(cfg)
        capacity = Capacity(tokens=128, documents=10)
        for strategy in ("balanced", "dual_chunk_swap"):
            torch._dynamo.reset()
            counters.clear()
            shapes = []
            backend = cpcompile.backend(inner=_static_graphs(shapes))
            compiled = torch.compile(model, backend=backend, dynamic=False)
            g = torch.Generator().manual_seed(0)
            # the fake group cannot run data-dependent exchanges
            spec = StrategySpec(strategy, capacity=capacity, kv="all_gather")
            for i in range(6):
                docs = 1 if i == 0 else int(torch.randint(2, 10, (1,), generator=g))
                lengths = torch.randint(1, 12, (docs,), generator=g).tolist()
                pack = synthetic_pack(lengths, cfg.vocab, g)
                names = ("input_ids", "position_ids")
                batch = cpcompile.shard_batch(
                    {n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=2, rank=1, strategy=spec
                )
                with cpcompile.strategy(batch):
                    out = compiled(*(batch.tensors[n] for n in names), batch.cu_seqlens, capacity.tokens)
                out.sum().backward()
            self.assertEqual(counters["stats"]["unique_graphs"], 1, strategy)
            self.assertTrue(shapes and not any(shapes), shapes)
            with cpcompile.strategy(batch), self.assertRaisesRegex(BackendCompilerFailed, OWN_CU):
                compiled(*(batch.tensors[n] for n in names), pack["cu_seqlens"], capacity.tokens)  # the pack's own


def _train_on_capacity(rank: int, world: int) -> None:
    from torch._dynamo.utils import counters

    from cpcompile.testing import summed_loss
    from tests.dist import assert_matches_summed_over_ranks

    cfg = GPTConfig(vocab=32, dim=32, heads=2, kv_heads=1, layers=2, max_position=256)
    torch.manual_seed(0)
    reference, model = PackedGPT(cfg), PackedGPT(cfg)
    model.load_state_dict(reference.state_dict())
    spec = StrategySpec("dual_chunk_swap", capacity=Capacity(tokens=96, documents=8))
    counters.clear()
    compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=False)
    g = torch.Generator().manual_seed(3)
    for step, lengths in enumerate(([5, 17, 1, 9], [40], [2, 0, 11, 1, 6, 3])):
        pack = synthetic_pack(lengths, cfg.vocab, g)
        reference.zero_grad()
        want = summed_loss(reference(pack["input_ids"], pack["position_ids"], pack["cu_seqlens"], 40), pack["labels"])
        want.backward()
        names = ("input_ids", "labels", "position_ids")
        batch = cpcompile.shard_batch(
            {n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=world, rank=rank, strategy=spec
        )
        t = batch.tensors
        model.zero_grad()
        with cpcompile.strategy(batch):
            logits = compiled(t["input_ids"], t["position_ids"], batch.cu_seqlens, spec.capacity.tokens)
        loss = summed_loss(logits, t["labels"])
        loss.backward()
        assert_matches_summed_over_ranks(loss, want, model, reference, f"capacity step {step}", 1e-4)
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]


class OneGraphPerBucketHF(FakeGroupTestCase):
    def test_hf_packs_of_a_bucket_share_one_graph_without_dynamic_shapes(self):
        """A Hugging Face Llama through ``shard_flattened_batch`` with a capacity and a fixed
        ``max_length``: packs of 1-4 documents run one graph under ``dynamic=False``."""
        import cpcompile.integrations.hf as cphf
        from tests.integrations.test_hf import flattened_batch, tiny_model

        model = tiny_model("llama", cphf.ATTN_IMPLEMENTATION)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=False)
        # the fake group cannot run data-dependent exchanges
        spec = StrategySpec("balanced", capacity=Capacity(tokens=64, documents=6), kv="all_gather")
        for step, lengths in enumerate(([7, 5], [20, 1, 3], [9, 9, 9, 2], [30])):
            batch = flattened_batch(lengths, seed=step)
            inputs, sharded = cphf.shard_flattened_batch(batch, cp_size=2, rank=1, strategy=spec, max_length=64)
            with cpcompile.strategy(sharded):
                compiled(**inputs).loss.backward()
        self.assertEqual(counters["stats"]["unique_graphs"], 1)


def _eager_on_capacity(rank: int, world: int) -> None:
    from tests.fixtures import attention_case
    from tests.reference import attention_fp64_on_rank, relative_error

    cu, _, q, k, v, dout = attention_case([5, 17, 1, 9], 4, 2, 8, seed=1)
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    for kv in ("auto", "ring"):
        for strategy in ("dual_chunk_swap", "balanced", "no_load_balance"):
            for causal in (True, False):
                spec = StrategySpec(strategy, kv=kv, capacity=Capacity(tokens=96, documents=6))
                batch = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
                ref, *ref_grads = attention_fp64_on_rank(batch.cu_seqlens, batch, tensors, causal=causal)
                local = [batch.tensors[n].clone().requires_grad_() for n in "qkv"]
                out = cpcompile.cp_attention(*local, batch.cu_seqlens, strategy=batch, causal=causal)
                grads = torch.autograd.grad(out, local, batch.tensors["dout"])
                label = f"rank {rank} {kv} {strategy} causal={causal}"
                assert relative_error(out, ref) < 1e-4, f"out {label}"
                for name, got, want in zip("qkv", grads, ref_grads):
                    assert relative_error(got, want) < 1e-4, f"d{name} {label}"
                # the pack's own cu_seqlens (4 documents): same token count, another layout of the
                # padding (dual_chunk_swap and balanced: every output wrong before), refused
                with pytest.raises(ValueError, match=r"another pack .*pass batch.cu_seqlens"):
                    cpcompile.cp_attention(*local, cu, strategy=batch, causal=causal)


def _on_capacity(rank: int, world: int) -> None:
    _eager_on_capacity(rank, world)
    _train_on_capacity(rank, world)


@pytest.mark.distributed
def test_cp_attention_and_a_compiled_model_on_packs_padded_to_a_capacity():
    """2 gloo ranks (both checks on one pair: starting the processes costs more than either).

    Eager ``cp_attention`` with the capacity's spec (its plan made in the call): float64 single-device
    attention and gradients, all-gather and ring, three layouts, both masks. Then a compiled model,
    dual_chunk_swap, ``dynamic=False``: three packs of 1-6 documents (a zero-length one among them)
    padded to one capacity give the single-process loss and gradients, one graph."""
    from tests.dist import run_ranks

    run_ranks(_on_capacity, 2)


def test_every_op_but_the_captured_pair_is_kept_out_of_cuda_graphs():
    """Every cpcompile op but ``cp_attention_captured`` and its backward, and ``sinks_grad``, carries
    torch's ``cudagraph_unsafe`` tag: the plan and attention ops read their tensors' values on the host (a
    captured call would replay the pack it was captured on), so inductor's graph partitions leave
    them out of any CUDA graph (docs/cuda-graphs.md); the captured pair reads nothing on the host, nor
    does the sinks' gradient (one kernel over its inputs, of their shapes)."""
    import cpcompile.layouts.balanced_op  # noqa: F401  (registered where balanced first lays out a pack)

    tag = torch.Tag.cudagraph_unsafe
    packets = {n: getattr(torch.ops.cpcompile, n) for n in dir(torch.ops.cpcompile)}
    packets = {n: p for n, p in packets.items() if isinstance(p, torch._ops.OpOverloadPacket)}
    assert {"cp_plan", "cp_attention", "cp_attention_backward", "packed_attention", "ag_gemm"} <= set(packets)
    untagged = {f"{n}.{o}" for n, p in packets.items() for o in p.overloads() if tag not in getattr(p, o).tags}
    captured = {"cp_attention_captured.default", "cp_attention_captured_backward.default", "sinks_grad.default"}
    assert untagged == captured, untagged


class TorchCompileMode(FakeGroupTestCase):
    def test_mode_and_options_reach_inductor(self):
        """``torch.compile(..., backend=cpcompile.backend(), mode=..., options=...)``: inductor gets
        them as config patches (option names spelled with ``-`` too, as torch.compile takes them);
        ``aot_eager`` takes neither."""
        from unittest import mock

        import torch._inductor.compile_fx as inductor

        def f(x):
            return (x @ x.t()).relu().sum()

        x, seen = torch.randn(8, 4), []
        compile_fx = inductor.compile_fx

        def recording(gm, example_inputs, config_patches=None, **kwargs):
            seen.append(config_patches)
            return compile_fx(gm, example_inputs, config_patches=config_patches, **kwargs)

        with mock.patch.object(inductor, "compile_fx", recording):
            torch._dynamo.reset()
            got = torch.compile(f, backend=cpcompile.backend(), options={"max-autotune-gemm": False})(x)
        assert torch.allclose(got, f(x)) and {"max_autotune_gemm": False} in seen, seen
        torch._dynamo.reset()
        message = r"mode='max-autotune-no-cudagraphs' and options=None need inner='inductor', got inner='aot_eager'"
        with pytest.raises(BackendCompilerFailed, match=message):
            torch.compile(f, backend=cpcompile.backend(inner="aot_eager"), mode="max-autotune-no-cudagraphs")(x)

    def test_cuda_graphs_take_graph_partitions_fixed_sizes_and_a_capacity(self):
        """CUDA graphs, however turned on (``mode="reduce-overhead"``, ``triton.cudagraphs`` in
        ``options`` or in inductor's config), reach inductor with its graph partitions on, so that
        cpcompile's ops run between the captured parts. A step that would be captured anew per pack
        is refused before anything runs, naming the remedy: sizes Dynamo may make symbolic (``dynamic``
        True or None), CP attention on packs without a capacity bucket; so are graph partitions or
        cudagraph trees turned off. (Inductor itself is stood in for by
        ``aot_eager``: the CPU has no CUDA graphs, and the GPU run is ``benchmarks/cuda_graphs.py``.)"""
        from unittest import mock

        import torch._inductor.compile_fx as inductor

        seen = []

        def recording(gm, example_inputs, config_patches=None, **kwargs):
            seen.append(config_patches)
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        cfg = GPTConfig(vocab=32, dim=16, heads=2, kv_heads=1, layers=1, max_position=64)
        model = PackedGPT(cfg)
        pack = synthetic_pack([5, 9, 2], cfg.vocab, torch.Generator().manual_seed(0))

        def step(spec, dynamic, **kwargs):
            torch._dynamo.reset()
            names = ("input_ids", "position_ids")
            batch = cpcompile.shard_batch({n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=2, rank=1,
                                          strategy=spec)  # fmt: skip
            # made here, under the stand-in: a backend made before it would keep inductor's own compile_fx
            backend = cpcompile.backend()
            compiled = torch.compile(model, backend=backend, dynamic=dynamic, **kwargs)
            with cpcompile.strategy(batch, kv="all_gather"):  # the fake group: no exchange
                compiled(*(batch.tensors[n] for n in names), batch.cu_seqlens, 9).sum().backward()

        bucket = StrategySpec("balanced", capacity=Capacity(tokens=32, documents=4))
        turned_on = [
            ({"mode": "reduce-overhead"}, contextlib.nullcontext()),
            ({"options": {"triton.cudagraphs": True}}, contextlib.nullcontext()),
            ({}, mock.patch.object(torch._inductor.config.triton, "cudagraphs", True)),
        ]
        with mock.patch.object(inductor, "compile_fx", recording):
            for kwargs, on in turned_on:
                seen.clear()
                with on:
                    step(bucket, False, **kwargs)
                assert seen and all(p["graph_partition"] and p.get("triton.cudagraphs", True) for p in seen), seen
            fixed = "CUDA graphs need torch.compile\\(..., dynamic=False\\)"
            for dynamic in (True, None):  # None: static at first, symbolic at the first pack of another size
                # and nothing else on the way: the pass used to hand the plan op a raw SymInt (a UserWarning)
                with pytest.raises(BackendCompilerFailed, match=fixed), warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)
                    step(bucket, dynamic, mode="reduce-overhead")
            bucket_needed = "CUDA graphs need packs padded to a capacity bucket"
            with pytest.raises(BackendCompilerFailed, match=bucket_needed):
                step(StrategySpec("balanced"), False, mode="reduce-overhead")
            for option, needed in (("graph_partition", "graph_partition=True"), ("triton.cudagraph_trees", "trees")):
                with pytest.raises(BackendCompilerFailed, match=f"CUDA graphs .* need inductor's .*{needed}"):
                    step(bucket, False, options={"triton.cudagraphs": True, option: False})
            seen.clear()
            step(StrategySpec("balanced"), True)  # without CUDA graphs: neither is needed
            assert seen and all(patches is None for patches in seen), seen  # the stand-in, with no patches


def _fits(cu, spec, cp) -> bool:
    try:
        cpcompile.shard_batch({"x": torch.zeros(int(cu[-1]))}, cu, cp_size=cp, rank=0, strategy=spec)
    except ValueError as e:
        assert "use a larger capacity" in str(e)
        return False
    return True


@pytest.mark.parametrize("spec", STRATEGIES, ids=str)
def test_capacity_for_is_the_smallest_bucket_that_holds_every_pack(spec):
    """Every pack pads to ``capacity_for``'s capacity; a capacity one padding multiple or one document
    smaller refuses a pack; auto, head parallelism and no packs are refused."""
    cp = 4
    packs = [_cu(lengths) for lengths in ([5, 17, 1], [40], [3, 0, 9, 1, 1], [1])]
    capacity = cpcompile.layouts.capacity_for(packs, cp_size=cp, strategy=spec)
    needed = [int(cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)[-1]) for cu in packs]
    assert capacity == (max(needed), 5)
    for cu in packs:
        sharded = cpcompile.shard_batch(
            {"x": torch.zeros(int(cu[-1]))}, cu, cp_size=cp, rank=0, strategy=_with(spec, capacity)
        )
        assert sharded.tensors["x"].shape == (capacity.tokens // cp,) and sharded.cu_seqlens.shape == (6,)
    m, _ = padding_multiple(spec, cp)
    for smaller in (Capacity(capacity.tokens - m, 5), Capacity(capacity.tokens, 4)):
        assert not all(_fits(cu, _with(spec, smaller), cp) for cu in packs), smaller
    with pytest.raises(ValueError, match="packs must hold at least one pack, got none"):
        cpcompile.layouts.capacity_for([], cp_size=cp, strategy=spec)
    with pytest.raises(
        ValueError, match="capacity_for needs the layout the bucket's packs will use, got strategy 'auto'"
    ):
        cpcompile.layouts.capacity_for(packs, cp_size=cp, strategy="auto")
    with pytest.raises(ValueError, match="capacity buckets are not supported with head_parallel=2 yet"):
        cpcompile.layouts.capacity_for(
            packs, cp_size=cp, strategy=StrategySpec(spec.strategy, spec.stripe_size, kv="heads", head_parallel=2)
        )

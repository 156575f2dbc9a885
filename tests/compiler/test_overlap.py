"""``cpcompile.backend(..., overlap_kv=True)``: K/V transfers as graph nodes (``attention.split``).

- On real gloo ranks, float64: a model of separate Q, K, V projections (a causal and a windowed
  layer, checkpointed or not) trains exactly as one process does on the whole pack on the
  all-gather path, with one compilation over packs of varying length; ring and head-parallel
  calls, which the option leaves as they are, stay exact.
- On a fake group: the forward and backward graphs that AOT autograd hands the compiler start
  each transfer before, and wait for it after, work that does not depend on it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.utils import counters

import cpcompile
from cpcompile.compiler import overlap
from tests.dist import PACK_SIZES, compiled_graphs, run_ranks
from tests.graphs import FakeGroupTestCase
from tests.reference import relative_error


class Net(torch.nn.Module):
    """Separate Q, K and V projections and a RoPE-like rotation of Q and K, in Hugging Face's order (Q
    first: the pass moves Q's projection and rotation to where K/V travel), one attention call per layer
    of ``windows``;
    ``checkpointed``: each layer under activation checkpointing (its body a subgraph the pass rewrites,
    its transfers run again in the backward)."""

    def __init__(self, windows=((-1, 0), (3, 0)), vocab=32, dim=16, heads=4, kv_heads=2, checkpointed=False):
        super().__init__()
        self.hd, self.windows, self.checkpointed = dim // heads, windows, checkpointed
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(128, dim)
        linear = lambda n: torch.nn.Linear(dim, n * self.hd, bias=False)  # noqa: E731
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"k": linear(kv_heads), "v": linear(kv_heads), "q": linear(heads), "o": linear(heads)})
            for _ in windows
        )

    def forward(self, ids, positions, cu_seqlens, max_seqlen: int):
        x = self.tok(ids) + self.pos(positions)
        angle = positions.to(x.dtype)[:, None, None] * 0.1
        for layer, window in zip(self.layers, self.windows):
            args = (layer, window, x, angle, cu_seqlens, max_seqlen)
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(self._layer, *args, use_reentrant=False)
            else:
                x = self._layer(*args)
        return x

    def _layer(self, layer, window, x, angle, cu_seqlens, max_seqlen: int):
        q, k, v = (layer[n](x).unflatten(1, (-1, self.hd)) for n in "qkv")
        q, k = (x * angle.cos() + x.roll(1, -1) * angle.sin() for x in (q, k))
        o = cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen, window_size=window)
        return x + layer["o"](o.flatten(1))


def _loss(x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """A sum over the real tokens (``real`` ``[T]``: 1, 0 at the layout's padding): the ranks' shares add up."""
    per_token = x.sin().sum(1)
    return per_token.sum() if real is None else (per_token * real).sum()


def _pack(step: int):
    from cpcompile.testing import sample_lengths

    g = torch.Generator().manual_seed(step)
    lengths = sample_lengths(PACK_SIZES[step], g, lengths=[1, 3, 9, 17, 30])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(32, (cu[-1],), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return ids, positions, cu, max(lengths)


def _check_exact(rank: int, world: int, runs) -> None:
    for spec, windows, checkpointed in runs:
        torch.manual_seed(0)
        reference, model = Net(windows).double(), Net(windows, checkpointed=checkpointed).double()
        model.load_state_dict(reference.state_dict())
        torch._dynamo.reset()
        counters.clear()
        backend = cpcompile.backend(inner="aot_eager", overlap_kv=True)
        compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
        for step in range(2):
            ids, positions, cu, longest = _pack(step)
            reference.zero_grad()
            want = _loss(reference(ids, positions, cu, longest))
            want.backward()
            with cpcompile.strategy(spec):
                real = torch.ones(ids.shape, dtype=torch.float64)
                batch = cpcompile.shard_batch(
                    {"ids": ids, "pos": positions, "real": real}, cu, cp_size=world, rank=rank
                )
                t = batch.tensors
                model.zero_grad()
                with cpcompile.strategy(batch):
                    loss = _loss(compiled(t["ids"], t["pos"], cu, longest), t["real"])
                loss.backward()
            label = f"{spec} step {step}"
            total = loss.detach().clone()
            dist.all_reduce(total)
            assert relative_error(total, want) < 1e-10, f"loss {label}: {total} vs {want}"
            for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
                grad = p.grad.clone()
                dist.all_reduce(grad)
                assert relative_error(grad, p_ref.grad) < 1e-10, f"grad of {name} {label}"
        assert compiled_graphs() == 1, f"{compiled_graphs()} compilations for 2 packs of other lengths, {spec}"


@pytest.mark.distributed
def test_split_graphs_train_exactly():
    """The all-gather path split into graph nodes (``inner="aot_eager"``, whose AOT graphs get
    ``compiler.overlap.sink_waits``), causal and windowed, with and without activation checkpointing:
    ``kv="all_gather"``'s functional collectives, and the exchange's nodes (``attention.split_exchange``)
    under ``kv="exchange"`` and ``kv="auto"`` (balanced: the plan picks the exchange); the ring and head
    parallelism, which the option leaves alone (head parallelism takes no window)."""
    S, windowed, causal = cpcompile.StrategySpec, ((-1, 0), (3, 0)), ((-1, 0),)
    runs = [
        (S("dual_chunk_swap", kv="all_gather"), windowed, False),
        (S("dual_chunk_swap", kv="exchange"), windowed, False),
        (S("balanced", windows=(-1, 3)), windowed, True),
        (S("dual_chunk_swap", kv="ring"), windowed, False),
        (S("dual_chunk_swap", kv="heads", head_parallel=2), causal, False),
    ]
    run_ranks(_check_exact, 2, runs)


@pytest.mark.distributed
def test_exchange_graphs_train_exactly_at_cp_3():
    """The exchange's nodes at cp=3, where a rank receives from two peers and returns their sums to
    two owners: ``kv="exchange"`` under balanced, and ``kv="auto"`` under dual_chunk_swap, whose plans
    pick the exchange for the windowed layer and the all-gather for the causal one, inside the same nodes."""
    S, windowed = cpcompile.StrategySpec, ((-1, 0), (3, 0))
    run_ranks(
        _check_exact, 3, [(S("balanced", kv="exchange"), windowed, False), (S("dual_chunk_swap"), windowed, False)]
    )


def _interesting(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's transfers, waits, matmuls and cpcompile ops, in order, by kind."""
    names = {
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "wait_tensor": "wait",
        "mm": "mm",
    }
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not hasattr(node.target, "_opname"):
            continue
        ns, op = node.target.namespace, node.target._opname
        if ns == "cpcompile" or op in names:
            out.append(op if ns == "cpcompile" else names[op])
    return out


class InPlaceQuery(Net):
    """Q scaled in place before K and V are projected: a side effect the pass moves nothing across."""

    def _layer(self, layer, window, x, angle, cu_seqlens, max_seqlen: int):
        q = layer["q"](x).unflatten(1, (-1, self.hd))
        q.mul_(0.5)
        k, v = (layer[n](x).unflatten(1, (-1, self.hd)) for n in "kv")
        o = cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen, window_size=window)
        return x + layer["o"](o.flatten(1))


class InPlaceQueryAfter(Net):
    """Q scaled in place after K and V exist: Q's projection moves, still before its scaling."""

    def _layer(self, layer, window, x, angle, cu_seqlens, max_seqlen: int):
        q, k, v = (layer[n](x).unflatten(1, (-1, self.hd)) for n in "qkv")
        q.mul_(0.5)
        o = cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen, window_size=window)
        return x + layer["o"](o.flatten(1))


def test_sinking_passes_over_a_wait_nobody_reads():
    """A wait whose result is never read (K's gradient not needed, its wait side-effectful so never
    removed) stays where it is; the search for its reader ends at the graph's end."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    unread = graph.call_function(overlap._WAIT, (x,))
    read = graph.call_function(overlap._WAIT, (x,))
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (y, read)))
    assert overlap.sink_waits(graph) == 1
    assert [n.target for n in graph.nodes][1:4] == [overlap._WAIT, torch.ops.aten.relu.default, overlap._WAIT]
    assert next(iter(unread.users), None) is None


class SnapshotTest(FakeGroupTestCase):
    def graphs(self, model, spec: cpcompile.StrategySpec | None = None) -> list[torch.fx.GraphModule]:
        """The forward and backward graphs AOT autograd hands the compiler, ``overlap_kv=True``, ``spec``
        in force (default: dual_chunk_swap over the all-gather's functional collectives)."""
        spec = spec or cpcompile.StrategySpec("dual_chunk_swap", kv="all_gather")
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return boxed_nop(gm, example_inputs)

        torch._dynamo.reset()
        backend = cpcompile.backend(inner=overlap.aot_backend(capture), overlap_kv=True)
        compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
        ids, positions, cu, longest = _pack(0)
        batch = cpcompile.shard_batch({"ids": ids, "pos": positions}, cu, cp_size=2, rank=1, strategy=spec)
        with cpcompile.strategy(batch):
            _loss(compiled(batch.tensors["ids"], batch.tensors["pos"], cu, longest)).backward()
        return graphs

    def test_nothing_moves_across_a_side_effect(self):
        forward, _ = self.graphs(InPlaceQuery(windows=((-1, 0),)))
        # Q's projection stays before the all-gathers: its in-place scaling lies between it and them
        self.assertExpectedInline(
            " ".join(_interesting(forward)), "mm mm mm cp_plan all_gather all_gather wait wait cp_attention_split mm"
        )

    def test_a_moved_node_stays_before_its_readers(self):
        forward, _ = self.graphs(InPlaceQueryAfter(windows=((-1, 0),)))
        self.assertExpectedInline(
            " ".join(_interesting(forward)), "mm mm cp_plan all_gather all_gather mm wait wait cp_attention_split mm"
        )

    def test_transfers_start_before_and_wait_after_independent_work(self):
        forward, backward = self.graphs(Net(windows=((-1, 0),)))
        # forward: K and V projected (mm, mm) and K rotated, their all-gathers started, the Q projection (mm)
        # and rotation run (written first, moved by the pass), then the waits, attention, the output projection
        self.assertExpectedInline(
            " ".join(_interesting(forward)),
            "mm mm cp_plan all_gather all_gather mm wait wait cp_attention_split mm",
        )
        # backward: the output projection's gradients, the re-gathers (started after the backward's
        # agreement, in cp_attention_split_regather), the kernel, the dK/dV reduce-scatters started;
        # the Q projection's weight and input gradients (mm mm) run before their waits, then K's and V's
        self.assertExpectedInline(
            " ".join(_interesting(backward)),
            "mm mm cp_attention_split_regather wait wait cp_attention_split_backward reduce_scatter reduce_scatter "
            "mm mm wait wait mm mm mm mm",
        )

    def test_a_gradient_not_needed_does_not_travel(self):
        """K of the first layer needs no gradient (its projection and the embeddings frozen, as LoRA on Q
        alone leaves them): its sum is not reduce-scattered, and the graphs compile and run."""
        model = Net(windows=((-1, 0),))
        for module in (model.tok, model.pos, model.layers[0]["k"]):
            module.requires_grad_(False)
        _, backward = self.graphs(model)
        self.assertExpectedInline(
            " ".join(_interesting(backward)),
            "mm mm cp_attention_split_regather wait wait cp_attention_split_backward reduce_scatter mm wait mm",
        )

    def test_the_exchange_starts_before_and_waits_after_independent_work(self):
        """The sparse exchange (``attention.split_exchange``; ``kv="auto"`` takes the same nodes, choosing
        per plan inside them): one fetch of K and V, started before the Q projection, waited for just before
        attention; in the backward the sums' returns started before the Q projection's gradients, each
        wait and its add just before the gradient is read."""
        forward, backward = self.graphs(Net(windows=((-1, 0),)), cpcompile.StrategySpec("balanced", kv="exchange"))
        self.assertExpectedInline(
            " ".join(_interesting(forward)),
            "mm mm cp_plan cp_exchange_fetch mm wait wait cp_attention_exchange mm",
        )
        self.assertExpectedInline(
            " ".join(_interesting(backward)),
            "mm mm cp_exchange_refetch wait wait cp_attention_exchange_backward cp_exchange_return cp_exchange_return "
            "mm mm wait cp_exchange_add wait cp_exchange_add mm mm mm mm",
        )

"""Compiled graphs the pass used to get silently wrong, on real gloo ranks (issue 57).

- A window passed to the compiled function as an argument: Dynamo lifts its ints to inputs, and
  ``causal`` reaches ``cpcompile::packed_attention`` as a symbolic bool (``window[1] == 0``). The
  pass must specialize both (one graph per window), never read the node as true. Every window,
  ``dynamic=None`` and ``True``, the all-gather, the exchange and the ring: float64-exact.
- ``torch._dynamo.config.suppress_errors``: a graph that fails to compile would run eagerly,
  attention over each rank's own tokens. The backend refuses the combination when the graph runs
  (an error while compiling is what the flag swallows), and compiles once the flag is off.
- Attention the pass cannot split (``F.scaled_dot_product_attention``, flex attention, aten's
  attention ops) fails the compile on every rank, naming the call and the fix, unless
  ``unsupported="single_device"``; a graph with no attention compiles.
- In-place ops whose results are unused (``out.add_(b)``, ``out.mul_(s)``, ``out += b``) beside
  rewritten attention are kept: forward and gradients equal one device.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

import cpcompile
from cpcompile.compiler.shard_attention import UnsupportedAttentionError, find_packed_attention, shard_attention_pass
from tests.dist import run_ranks
from tests.fixtures import attention_case, doc_lengths
from tests.graphs import FakeGroupTestCase, dynamo_graph, fake_rank_inputs
from tests.reference import assert_attention_matches, attention_fp64_on_rank

EXACT = 1e-10  # float64 throughout: only the summation order differs
#: (2, 3) first: dynamic=None compiles it with constant ints, the next window with symbolic ones
WINDOWS = [(2, 3), (4, 4), (1, 5), (-1, -1), (3, 3), (2, 0)]
#: (kv, dynamic, windows): the pass reads the window alike for every path (each window is a graph of its
#: own: the all-gather takes them all, the exchange and the ring a banded window with right > 0, full
#: attention and a causal band, symbolic)
PATHS = [
    ("all_gather", None, WINDOWS),
    ("all_gather", True, WINDOWS),
    ("exchange", True, [(1, 5), (-1, -1), (2, 0)]),
    ("ring", True, [(1, 5), (-1, -1), (2, 0)]),
]
SPEC = "balanced"


def windowed(q, k, v, cu, window):
    return cpcompile.packed_attention(q, k, v, cu, causal=False, window_size=window)


def _case(rank: int, world: int, seed: int = 0):
    cu, _, q, k, v, dout = attention_case(doc_lengths(world, seed), 4, 2, 8, seed=seed, dtype=torch.float64)
    tensors = {"q": q, "k": k, "v": v, "dout": dout}
    return tensors, cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=SPEC)


def _local(sharded):
    return [sharded.tensors[name].clone().requires_grad_() for name in "qkv"]


def _check_window_argument(rank: int, world: int) -> None:
    tensors, sharded = _case(rank, world)
    cu = sharded.cu_seqlens
    for kv, dynamic, windows in PATHS:
        torch._dynamo.reset()
        backend = cpcompile.backend(inner="aot_eager")
        compiled = torch.compile(windowed, backend=backend, dynamic=dynamic)
        with cpcompile.strategy(sharded, kv=kv, kernel="reference"):
            for window in windows:
                local = _local(sharded)
                out = compiled(*local, cu, window)
                got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
                want = attention_fp64_on_rank(cu, sharded, tensors, causal=False, window=window)
                label = f"rank {rank} window={window} dynamic={dynamic} kv={kv}"
                assert_attention_matches(got, want, EXACT, label, dtype=torch.float64)


def _check_suppress_errors(rank: int, world: int) -> None:
    """Refused on every call while the flag is on, at the first compile or at a recompile (a new window
    after graphs compiled with it off); compiled and exact once it is off again."""
    tensors, sharded = _case(rank, world)
    cu = sharded.cu_seqlens
    torch._dynamo.reset()
    compiled = torch.compile(windowed, backend=cpcompile.backend(inner="aot_eager"))
    for window in ((2, 3), (4, 4)):
        torch._dynamo.config.suppress_errors = True
        try:
            with cpcompile.strategy(sharded):
                for _ in range(2):  # refused on every call, never run eagerly
                    with pytest.raises(RuntimeError, match=r"suppress_errors is True.*suppress_errors = False"):
                        compiled(*_local(sharded), cu, window)
        finally:
            torch._dynamo.config.suppress_errors = False
        with cpcompile.strategy(sharded):  # the refusal was guarded on the flag: this compiles
            out = compiled(*_local(sharded), cu, window)
        want = attention_fp64_on_rank(cu, sharded, tensors, causal=False, window=window)[:1]
        assert_attention_matches([out], want, EXACT, f"rank {rank} {window} after suppress_errors", torch.float64)


def sdpa(q, k, v):  # q [T, H, D]: one sequence of this rank's tokens, heads first for SDPA
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)


def mlp(x, w):
    return torch.relu(x @ w) @ w.t()


def _check_sdpa(rank: int, world: int) -> None:
    """Refused on every rank (each checks its own error), run as asked with single_device; no attention: no error."""
    q = torch.randn(8, 2, 4)
    torch._dynamo.reset()
    compiled = torch.compile(sdpa, backend=cpcompile.backend(inner="aot_eager"))
    with cpcompile.strategy(SPEC), pytest.raises(BackendCompilerFailed) as failed:
        compiled(q, q, q)
    assert isinstance(failed.value.inner_exception, UnsupportedAttentionError)
    message = str(failed.value.inner_exception)
    for part in ("F.scaled_dot_product_attention is not packed attention", "cpcompile.packed_attention", "varlen_attn"):
        assert part in message, message
    torch._dynamo.reset()
    compiled = torch.compile(sdpa, backend=cpcompile.backend(inner="aot_eager", unsupported="single_device"))
    with cpcompile.strategy(SPEC), pytest.warns(UserWarning, match="left .*scaled_dot_product_attention.* as single"):
        out = compiled(q, q, q)
    assert torch.allclose(out, sdpa(q, q, q))  # what was asked for: each rank's tokens alone
    torch._dynamo.reset()
    x, w = torch.randn(6, 4), torch.randn(4, 8)
    with cpcompile.strategy(SPEC), warnings.catch_warnings():
        warnings.simplefilter("error")  # no attention, nothing to refuse or warn about
        got = torch.compile(mlp, backend=cpcompile.backend(inner="aot_eager"))(x, w)
    assert torch.equal(got, mlp(x, w))


def in_place(q, k, v, cu, b, s):
    """Rewritten attention, then in-place ops whose results are unused."""
    out = cpcompile.packed_attention(q, k, v, cu, max_seqlen=32) * 1.0
    out.add_(b)
    out.mul_(s)
    return out


def in_place_iadd(q, k, v, cu, b, s):
    out = cpcompile.packed_attention(q, k, v, cu, max_seqlen=32) * s
    out += b  # operator.iadd
    return out


def _check_in_place(rank: int, world: int) -> None:
    tensors, sharded = _case(rank, world, seed=1)
    cu = sharded.cu_seqlens
    b = torch.full((), 100.0, dtype=torch.float64)
    s = torch.full((), 3.0, dtype=torch.float64)
    reference = attention_fp64_on_rank(cu, sharded, tensors, causal=True)
    for fn, scale in ((in_place, [100.0, 3.0]), (in_place_iadd, [3.0, 3.0])):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with cpcompile.strategy(sharded):
            local = _local(sharded)
            out = compiled(*local, cu, b, s)
            got = [out, *torch.autograd.grad(out, local, sharded.tensors["dout"])]
        # in_place: (a + 100) * 3 (gradients 3 x attention's); in_place_iadd: a * 3 + 100
        shift, factor = scale
        want_out = (reference[0] + 100.0) * 3.0 if fn is in_place else reference[0] * 3.0 + 100.0
        want = [want_out, *(g * factor for g in reference[1:])]
        assert_attention_matches(got, want, EXACT, f"rank {rank} {fn.__name__}", dtype=torch.float64)


def _check_rank(rank: int, world: int) -> None:
    _check_in_place(rank, world)
    _check_sdpa(rank, world)
    _check_suppress_errors(rank, world)
    _check_window_argument(rank, world)


@pytest.mark.distributed
def test_compiled_graphs_exact_or_refused():
    run_ranks(_check_rank, 2)


def flex(q, k, v):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v)


def aten_sdpa(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0]


@pytest.mark.parametrize(
    "fn, what",
    [
        (sdpa, "F.scaled_dot_product_attention"),
        (flex, "flex_attention"),
        (aten_sdpa, "aten::_scaled_dot_product_flash_attention_for_cpu"),
    ],
)
def test_attention_ops_cp_cannot_split_are_found(fn, what):
    """SDPA, flex attention and aten's attention ops in a Dynamo graph are found as calls CP cannot run."""
    graphs = []
    q = torch.randn(1, 2, 8, 4)
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(q, q, q)
    (gm,) = graphs
    matches, skipped = find_packed_attention(gm)
    assert matches == [] and len(skipped) == 1 and not skipped[0].packed
    assert skipped[0].reason.startswith(f"{what} is not packed attention"), skipped[0].reason


class FakeGroupGraphs(FakeGroupTestCase):
    def test_head_parallel_names_the_window(self):
        """A symbolic window under head parallelism: the refusal shows its values, not graph nodes."""
        q, k, v, cu, _ = fake_rank_inputs()
        gm = dynamo_graph(windowed, q, k, v, cu, (2, 3))
        spec = cpcompile.StrategySpec(kv="heads", head_parallel=2)
        with self.assertRaisesRegex(ValueError, r"window_size=\(2, 3\) is not supported with head_parallel > 1"):
            shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec)

    def test_rewritten_graph_keeps_mutations(self):
        """The pass removes only what it added or made unread: ``add_`` and ``mul_`` (``call_method``) and
        ``operator.iadd``, whose results nothing reads, stay in the rewritten Dynamo graph."""
        q, k, v, cu, _ = fake_rank_inputs()
        b, s = torch.ones(()), torch.ones(())
        for fn, mutations in ((in_place, {"add_", "mul_"}), (in_place_iadd, {operator.iadd})):
            gm = dynamo_graph(fn, q, k, v, cu, b, s)
            before = [n for n in gm.graph.nodes if n.target in mutations]
            self.assertEqual(len(before), len(mutations), fn.__name__)
            count = shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=cpcompile.StrategySpec())
            self.assertEqual(count, 1)
            self.assertEqual([n for n in gm.graph.nodes if n.target in mutations], before, fn.__name__)

"""What the pass's graph tests share: small models, one fake rank's inputs, Dynamo's graph of a
function, and a test case on rank 1 of a fake two-rank group."""

from __future__ import annotations

import expecttest
import torch
import torch.distributed as dist
from torch.nn.attention.varlen import varlen_attn
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile
from cpcompile.testing import VARLEN_GQA


def packed_model(q, k, v, cu_seqlens, max_seqlen):
    return cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen)


def varlen_model(q, k, v, cu_seqlens, max_seqlen):
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0), **VARLEN_GQA)


def two_layers(q, k, v, cu_seqlens, max_seqlen):
    """Two attention calls on one ``cu_seqlens``: they must share one plan."""
    o = packed_model(q, k, v, cu_seqlens, max_seqlen)
    return varlen_attn(o, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **VARLEN_GQA)


def fake_rank_inputs(strategy=None):
    """One rank's q, k, v for two documents (5 and 15 tokens) over cp=2, laid out for ``strategy``."""
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    tokens = int(cpcompile.layouts.pad_for_cp(cu, cp_size=2, strategy=strategy)[-1]) // 2
    q = torch.randn(tokens, 4, 8, requires_grad=True)
    k, v = (torch.randn(tokens, 2, 8, requires_grad=True) for _ in range(2))
    return q, k, v, cu, 15


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """The Dynamo graph of ``fn`` (dynamic shapes, one graph), not run: the inputs are one
    rank's, which single-device attention cannot take (and varlen_attn has no CPU kernel)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        # every model here returns attention output, shaped like q (the first 3-D input)
        return lambda *a: (torch.zeros_like(next(t for t in a if isinstance(t, torch.Tensor) and t.dim() == 3)),)

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=True, fullgraph=True)(*args)
    return graphs[0]


class FakeGroupTestCase(expecttest.TestCase):
    """Rank 1 of a fake two-rank default group (``self.group``) for the class's tests, each inside
    ``cpcompile.strategy("dual_chunk_swap")``."""

    @classmethod
    def setUpClass(cls):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
        cls.group = dist.group.WORLD.group_name

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    def setUp(self):
        # under CP attention takes no default layout: the tests' own blocks nest inside this one
        block = cpcompile.strategy("dual_chunk_swap")
        block.__enter__()
        self.addCleanup(block.__exit__, None, None, None)
        super().setUp()

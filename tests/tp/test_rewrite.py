"""The TP overlap pass on the fake process group (tp = 2): graph snapshots, symbolic t, one compilation.

The fake group returns garbage data, so these tests pin graphs and shapes only;
tests/tp/test_ops.py checks the numbers on real gloo ranks with the same block and backend.
"""

from __future__ import annotations

import logging

import expecttest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import cpcompile
from tests.fixtures import OverlapBackend, all_gather, reduce_scatter, sp_mlp

GATHERED = "the gathered tensor does not feed exactly one matmul as its input (a [t, ..., K] input, a 2-D weight)"
SCATTERED = "the reduce-scatter's input is not a bias-free matmul ([t, ..., K] input, 2-D weight) used only by it"


def setup_module() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


def teardown_module() -> None:
    dist.destroy_process_group()


class TestOverlapPass(expecttest.TestCase):
    def setUp(self) -> None:
        torch._dynamo.reset()

    def test_sp_mlp_graphs_stay_symbolic_and_compile_once(self):
        backend = OverlapBackend(capacity_tokens=64)
        step = torch.compile(sp_mlp, backend=backend, fullgraph=True)
        g = dist.group.WORLD
        w1, b1, w2, b2 = (torch.randn(*s, requires_grad=True) for s in ((6, 8), (6,), (8, 6), (8,)))
        for t in (4, 9, 2, 33):
            x = torch.randn(t, 8, requires_grad=True)
            if t == 4:
                torch._dynamo.mark_dynamic(x, 0)
            y = step(x, w1, b1, w2, b2, g)
            y.sum().backward()
            self.assertEqual((y.shape, x.grad.shape), ((t, 8), (t, 8)))
        self.assertEqual(backend.rewrites, [2])
        dynamo, forward, backward = backend.graphs
        self.assertExpectedInline(
            dynamo,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s77: "Sym(s77)", L_x_: "f32[s77, 8]", L_w1_: "f32[6, 8]", L_b1_: "f32[6]", L_w2_: "f32[8, 6]", L_b2_: "f32[8]"):
        l_x_ = L_x_
        l_w1_ = L_w1_
        l_b1_ = L_b1_
        l_w2_ = L_w2_
        l_b2_ = L_b2_

        ag_gemm_default: "f32[2*s77, 6]" = torch.ops.cpcompile.ag_gemm.default(l_x_, l_w1_, l_b1_, '0', 64, 'symm_mem');  l_x_ = l_w1_ = l_b1_ = None
        h: "f32[2*s77, 6]" = torch._C._nn.gelu(ag_gemm_default);  ag_gemm_default = None

        gemm_rs_default: "f32[s77, 8]" = torch.ops.cpcompile.gemm_rs.default(h, l_w2_, '0', 64, 'symm_mem');  h = l_w2_ = None

        add: "f32[s77, 8]" = gemm_rs_default + l_b2_;  gemm_rs_default = l_b2_ = None
        return (add,)
""",
        )  # noqa: E501
        self.assertExpectedInline(
            forward,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "Sym(s77)", primals_2: "f32[s77, 8]", primals_3: "f32[6, 8]", primals_4: "f32[6]", primals_5: "f32[8, 6]", primals_6: "f32[8]"):
        ag_gemm: "f32[2*s77, 6]" = torch.ops.cpcompile.ag_gemm.default(primals_2, primals_3, primals_4, '0', 64, 'symm_mem');  primals_4 = None
        gelu: "f32[2*s77, 6]" = torch.ops.aten.gelu.default(ag_gemm)

        gemm_rs: "f32[s77, 8]" = torch.ops.cpcompile.gemm_rs.default(gelu, primals_5, '0', 64, 'symm_mem')

        add_9: "f32[s77, 8]" = torch.ops.aten.add.Tensor(gemm_rs, primals_6);  gemm_rs = primals_6 = None
        return (add_9, primals_2, primals_3, primals_5, ag_gemm, gelu, primals_1)
""",
        )  # noqa: E501
        self.assertExpectedInline(
            backward,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "Sym(s77)", primals_2: "f32[s77, 8]", primals_3: "f32[6, 8]", primals_5: "f32[8, 6]", ag_gemm: "f32[2*s77, 6]", gelu: "f32[2*s77, 6]", tangents_1: "f32[s77, 8]"):
        sum_1: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)
        view: "f32[8]" = torch.ops.aten.view.default(sum_1, [8]);  sum_1 = None

        gemm_rs_backward = torch.ops.cpcompile.gemm_rs_backward.default(tangents_1, gelu, primals_5, '0', 64, 'symm_mem');  tangents_1 = gelu = primals_5 = None
        getitem: "f32[2*s77, 6]" = gemm_rs_backward[0]
        getitem_1: "f32[8, 6]" = gemm_rs_backward[1];  gemm_rs_backward = None

        gelu_backward: "f32[2*s77, 6]" = torch.ops.aten.gelu_backward.default(getitem, ag_gemm);  getitem = ag_gemm = None
        ag_gemm_backward = torch.ops.cpcompile.ag_gemm_backward.default(gelu_backward, primals_2, primals_3, '0', 64, 'symm_mem');  primals_2 = primals_3 = None
        getitem_2: "f32[s77, 8]" = ag_gemm_backward[0]
        getitem_3: "f32[6, 8]" = ag_gemm_backward[1];  ag_gemm_backward = None
        view_1: "f32[2*s77, 6]" = torch.ops.aten.view.default(gelu_backward, [-1, 6]);  gelu_backward = None
        sum_2: "f32[6]" = torch.ops.aten.sum.dim_IntList(view_1, [0]);  view_1 = None
        return (None, getitem_2, getitem_3, sum_2, getitem_1, view)
""",
        )  # noqa: E501

    def test_views_addmm_matmul_and_3d_linear(self):
        backend = OverlapBackend()
        g = dist.group.WORLD

        def patterns(x3, w1, b1, w_kn, y3, w3):
            a = torch.addmm(b1, all_gather(x3, 0, g).reshape(-1, 8), w1.t())  # [tp * t * 3, 6]
            c = torch.matmul(all_gather(x3, 0, g), w_kn)  # [tp * t, 3, 5]: weight stored [K, N]
            r = reduce_scatter(F.linear(y3, w3), "sum", 0, g)  # [t, 3, 4]: Megatron's [s, b, h]
            return a, c, r

        x3, y3 = torch.randn(5, 3, 8), torch.randn(10, 3, 7)
        torch._dynamo.mark_dynamic(x3, 0)
        torch._dynamo.mark_dynamic(y3, 0)
        args = (x3, torch.randn(6, 8), torch.randn(6), torch.randn(8, 5), y3, torch.randn(4, 7))
        a, c, r = torch.compile(patterns, backend=backend, fullgraph=True)(*args)
        self.assertEqual((a.shape, c.shape, r.shape), ((30, 6), (10, 3, 5), (5, 3, 4)))
        self.assertEqual(backend.rewrites, [3])
        self.assertExpectedInline(
            backend.graphs[0],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s82: "Sym(s82)", L_x3_: "f32[s82, 3, 8]", L_w1_: "f32[6, 8]", L_b1_: "f32[6]", L_w_kn_: "f32[8, 5]", s10: "Sym(s10)", L_y3_: "f32[s10, 3, 7]", L_w3_: "f32[4, 7]"):
        l_x3_ = L_x3_
        l_w1_ = L_w1_
        l_b1_ = L_b1_
        l_w_kn_ = L_w_kn_
        l_y3_ = L_y3_
        l_w3_ = L_w3_

        flatten: "f32[3*s82, 8]" = torch.flatten(l_x3_, 0, -2)
        ag_gemm_default: "f32[6*s82, 6]" = torch.ops.cpcompile.ag_gemm.default(flatten, l_w1_, l_b1_, '0', None, 'symm_mem');  flatten = l_w1_ = l_b1_ = None

        t_1: "f32[5, 8]" = torch.t(l_w_kn_);  l_w_kn_ = None
        ag_gemm_default_1: "f32[2*s82, 3, 5]" = torch.ops.cpcompile.ag_gemm.default(l_x3_, t_1, None, '0', None, 'symm_mem');  l_x3_ = t_1 = None

        gemm_rs_default: "f32[(s10//2), 3, 4]" = torch.ops.cpcompile.gemm_rs.default(l_y3_, l_w3_, '0', None, 'symm_mem');  l_y3_ = l_w3_ = None
        return (ag_gemm_default, ag_gemm_default_1, gemm_rs_default)
""",
        )  # noqa: E501

    def test_chains_it_cannot_overlap_are_left_alone(self):
        backend = OverlapBackend()
        g = dist.group.WORLD

        def unmatched(x, wq, wk, y, w, b, wf):
            h = all_gather(x, 0, g)
            q, k = h @ wq.T, h @ wk.T  # one gather feeding two matmuls
            s = reduce_scatter(y @ w.T, "avg", 0, g)  # not a sum
            u = reduce_scatter(F.linear(y, w, b), "sum", 0, g)  # the bias would be summed tp times
            v = x @ all_gather(wf, 0, g).T  # a gathered weight (FSDP), not gathered tokens
            return q, k, s, u, v

        args = [torch.randn(*s) for s in ((4, 8), (6, 8), (6, 8), (8, 5), (3, 5), (3,), (4, 8))]
        logger = logging.getLogger("cpcompile.tp.rewrite")
        with self.assertLogs(logger, level="DEBUG") as logs:
            torch.compile(unmatched, backend=backend, fullgraph=True)(*args)
        self.assertEqual(backend.rewrites, [0])
        self.assertEqual(
            [r.getMessage().split(": ", 1)[1] for r in logs.records],
            [
                "tensor not rewritten: " + GATHERED,
                "tensor_3 not rewritten: " + GATHERED,
                "tensor_1 not rewritten: the reduce-scatter does not sum",
                "tensor_2 not rewritten: " + SCATTERED,
                "no all-gather -> matmul or matmul -> reduce-scatter to rewrite",
            ],
        )

    def test_matmuls_the_ops_cannot_take_are_left_alone(self):
        """Matmuls over gathered tokens that are not ``x [t, ..., K] @ w.T + b`` with ``w`` 2-D and ``b`` exactly
        ``[N]``: the gathered tensor as the weight too, a broadcast bias, a 1-D weight or input. Each compiles and
        runs as written (the fake group's values are garbage: shapes only)."""
        backend = OverlapBackend()
        g = dist.group.WORLD

        def misshapen(x, w, b1, w1, x1, h):
            a = all_gather(x, 0, g)
            b = all_gather(x, 0, g)
            return (
                a @ a,  # the gathered tensor as both operands
                F.linear(b, w, b1),  # a bias of [1], broadcast
                F.linear(all_gather(x, 0, g), w1),  # a 1-D weight
                all_gather(x1, 0, g) @ w.T,  # 1-D gathered tokens
                reduce_scatter(F.linear(h, w1), "sum", 0, g),  # a 1-D weight before the reduce-scatter
            )

        args = [torch.randn(*s) for s in ((2, 4), (3, 4), (1,), (4,), (2,), (4, 4))]
        outs = torch.compile(misshapen, backend=backend, fullgraph=True)(*args)
        self.assertEqual(backend.rewrites, [0])
        self.assertEqual([tuple(o.shape) for o in outs], [(4, 4), (4, 3), (4,), (3,), (2,)])


def test_cpcompile_backend_runs_the_overlap_pass():
    """The user-facing backend rewrites the block too (no attention here: the CP pass finds nothing)."""
    seen = []

    def capture(gm, example_inputs):
        seen.append(sorted({str(n.target) for n in gm.graph.nodes if "cpcompile" in str(n.target)}))
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(sp_mlp, backend=cpcompile.backend(inner=capture, tp_capacity_tokens=64), fullgraph=True)
    w1, b1, w2, b2 = (torch.randn(*s) for s in ((6, 8), (6,), (8, 6), (8,)))
    step(torch.randn(4, 8), w1, b1, w2, b2, dist.group.WORLD)
    assert seen == [["cpcompile.ag_gemm.default", "cpcompile.gemm_rs.default"]]

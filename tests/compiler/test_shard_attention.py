"""The attention pass on a fake process group (shapes and graphs only).

Snapshots pin the Dynamo graph before and after ``shard_attention_pass`` for each
recognized call, the AOT forward and backward graphs the inner compiler gets, and
what each strategy changes. Refresh with ``EXPECTTEST_ACCEPT=1``.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile.compiler.shard_attention import UnsupportedAttentionError, find_packed_attention, shard_attention_pass
from cpcompile.testing import VARLEN_GQA, GPTConfig, PackedGPT, synthetic_pack
from tests.fixtures import readable
from tests.graphs import FakeGroupTestCase, dynamo_graph, fake_rank_inputs, packed_model, two_layers, varlen_model


def aot_graphs(fn, **spec) -> dict[str, str]:
    """The AOT forward and backward graphs ``cpcompile.backend()`` hands its inner compiler, under
    ``cpcompile.strategy("dual_chunk_swap", **spec)``."""
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = readable(gm)
            return make_boxed_func(gm.forward)  # AOTAutograd calls compiled graphs with boxed arguments

        return compiler

    inner = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=cpcompile.backend(inner=inner), dynamic=True, fullgraph=True)
    with cpcompile.strategy("dual_chunk_swap", **spec):
        compiled(*fake_rank_inputs()).sum().backward()  # fake group: values are garbage, graphs are real
    return graphs


class ShardAttentionGraphs(FakeGroupTestCase):
    def shard(self, fn, spec=None):
        spec = spec or cpcompile.StrategySpec()
        gm = dynamo_graph(fn, *fake_rank_inputs())
        count = shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec)
        return gm, count

    def test_packed_attention_before_and_after(self):
        gm = dynamo_graph(packed_model, *fake_rank_inputs())
        self.assertExpectedInline(
            readable(gm),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s85: "Sym(s85)", s34: "Sym(s34)", s0: "Sym(s0)", L_q_: "f32[s85, s34, s0]", s25: "Sym(s25)", L_k_: "f32[s85, s25, s0]", L_v_: "f32[s85, s25, s0]", s40: "Sym(s40)", L_cu_seqlens_: "i32[s40]", L_max_seqlen_: "Sym(s7)"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_seqlens_ = L_cu_seqlens_
        l_max_seqlen_ = L_max_seqlen_

        packed_attention = torch.ops.cpcompile.packed_attention(l_q_, l_k_, l_v_, l_cu_seqlens_, None, l_max_seqlen_, True, None, None);  l_q_ = l_k_ = l_v_ = l_cu_seqlens_ = l_max_seqlen_ = None
        getitem_1: "f32[s85, s34, s0]" = packed_attention[0];  packed_attention = None
        return (getitem_1,)
""",
        )
        shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=cpcompile.StrategySpec())
        self.assertExpectedInline(
            readable(gm),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s85: "Sym(s85)", s34: "Sym(s34)", s0: "Sym(s0)", L_q_: "f32[s85, s34, s0]", s25: "Sym(s25)", L_k_: "f32[s85, s25, s0]", L_v_: "f32[s85, s25, s0]", s40: "Sym(s40)", L_cu_seqlens_: "i32[s40]", L_max_seqlen_: "Sym(s7)"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_seqlens_ = L_cu_seqlens_
        l_max_seqlen_ = L_max_seqlen_

        local_tokens: "Sym(s85)" = torch.ops.aten.sym_size.int(l_q_, 0)
        cp_tokens: "Sym(2*s85)" = local_tokens * 2;  local_tokens = None

        cp_plan = torch.ops.cpcompile.cp_plan.default(l_cu_seqlens_, None, cp_tokens, 2, 1, 'dual_chunk_swap', 1, group_name = '0', calls = ['cp_attention: causal, backward, torch.float32, scale None, kernel None, kv auto, kv_chunks 1'], dims = [s34, s25, s0, s0]);  l_cu_seqlens_ = cp_tokens = s34 = s25 = s0 = None

        gather_index: "i64[2*s85]" = cp_plan[0]
        cu_q: "i32[Min(s85, 3*s40 - 3) + 1]" = cp_plan[1]
        k_start: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[2]
        k_len_causal: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[3]
        cu_seqlens: "i32[s40]" = cp_plan[5]
        cu_seqlens_padded: "i32[s40]" = cp_plan[6];  cp_plan = None
        add: "Sym(s7 + 4)" = l_max_seqlen_ + 4
        sub: "Sym(s7 + 3)" = add - 1;  add = None
        floordiv: "Sym(((s7 + 3)//4))" = sub // 4;  sub = None
        mul: "Sym(2*(((s7 + 3)//4)))" = floordiv * 2;  floordiv = None

        cp_attention = torch.ops.cpcompile.cp_attention.default(l_q_, l_k_, l_v_, gather_index, cu_q, k_start, k_len_causal, '0', True, None, l_max_seqlen_, mul, None, 'auto', 1, cu_seqlens = cu_seqlens, cu_seqlens_padded = cu_seqlens_padded);  l_q_ = l_k_ = l_v_ = gather_index = cu_q = k_start = k_len_causal = l_max_seqlen_ = mul = cu_seqlens = cu_seqlens_padded = None
        getitem_1: "f32[s85, s34, s0]" = cp_attention[0];  cp_attention = None
        return (getitem_1,)
""",
        )

    def test_varlen_attn_before_and_after(self):
        gm = dynamo_graph(varlen_model, *fake_rank_inputs())
        self.assertExpectedInline(
            readable(gm),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s85: "Sym(s85)", s34: "Sym(s34)", s0: "Sym(s0)", L_q_: "f32[s85, s34, s0]", s25: "Sym(s25)", L_k_: "f32[s85, s25, s0]", L_v_: "f32[s85, s25, s0]", s40: "Sym(s40)", L_cu_seqlens_: "i32[s40]", L_max_seqlen_: "Sym(s7)"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_seqlens_ = L_cu_seqlens_
        l_max_seqlen_ = L_max_seqlen_

        _varlen_attn = torch.ops.torch_attn._varlen_attn(l_q_, l_k_, l_v_, l_cu_seqlens_, l_cu_seqlens_, l_max_seqlen_, l_max_seqlen_, True, None, [-1, 0], True, None, None, None);  l_q_ = l_k_ = l_v_ = l_cu_seqlens_ = l_max_seqlen_ = None
        out: "f32[s85, s34, s0]" = _varlen_attn[0];  _varlen_attn = None
        return (out,)
""",
        )
        shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=cpcompile.StrategySpec())
        self.assertExpectedInline(
            readable(gm),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s85: "Sym(s85)", s34: "Sym(s34)", s0: "Sym(s0)", L_q_: "f32[s85, s34, s0]", s25: "Sym(s25)", L_k_: "f32[s85, s25, s0]", L_v_: "f32[s85, s25, s0]", s40: "Sym(s40)", L_cu_seqlens_: "i32[s40]", L_max_seqlen_: "Sym(s7)"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_seqlens_ = L_cu_seqlens_
        l_max_seqlen_ = L_max_seqlen_

        local_tokens: "Sym(s85)" = torch.ops.aten.sym_size.int(l_q_, 0)
        cp_tokens: "Sym(2*s85)" = local_tokens * 2;  local_tokens = None

        cp_plan = torch.ops.cpcompile.cp_plan.default(l_cu_seqlens_, None, cp_tokens, 2, 1, 'dual_chunk_swap', 1, group_name = '0', calls = ['cp_attention: causal, backward, torch.float32, scale None, kernel None, kv auto, kv_chunks 1'], dims = [s34, s25, s0, s0]);  l_cu_seqlens_ = cp_tokens = s34 = s25 = s0 = None

        gather_index: "i64[2*s85]" = cp_plan[0]
        cu_q: "i32[Min(s85, 3*s40 - 3) + 1]" = cp_plan[1]
        k_start: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[2]
        k_len_causal: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[3]
        cu_seqlens: "i32[s40]" = cp_plan[5]
        cu_seqlens_padded: "i32[s40]" = cp_plan[6];  cp_plan = None
        add: "Sym(s7 + 4)" = l_max_seqlen_ + 4
        sub: "Sym(s7 + 3)" = add - 1;  add = None
        floordiv: "Sym(((s7 + 3)//4))" = sub // 4;  sub = None
        mul: "Sym(2*(((s7 + 3)//4)))" = floordiv * 2;  floordiv = None

        cp_attention = torch.ops.cpcompile.cp_attention.default(l_q_, l_k_, l_v_, gather_index, cu_q, k_start, k_len_causal, '0', True, None, l_max_seqlen_, mul, None, 'auto', 1, cu_seqlens = cu_seqlens, cu_seqlens_padded = cu_seqlens_padded);  l_q_ = l_k_ = l_v_ = gather_index = cu_q = k_start = k_len_causal = l_max_seqlen_ = mul = cu_seqlens = cu_seqlens_padded = None
        out: "f32[s85, s34, s0]" = cp_attention[0];  cp_attention = None
        return (out,)
""",
        )

    def test_each_strategy_gets_its_plan(self):
        plans = []
        for spec in (
            cpcompile.StrategySpec(cpcompile.Strategy.NO_LOAD_BALANCE),
            cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, stripe_size=4),
        ):
            gm, _ = self.shard(packed_model, spec)
            (plan,) = gm.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.cp_plan.default)
            plans.append(f"{plan.format_node()} -> {plan.meta['example_value'][1].shape}")
        self.assertExpectedInline(
            "\n".join(plans),
            """\
%cp_plan : [num_users=6] = call_function[target=torch.ops.cpcompile.cp_plan.default](args = (%l_cu_seqlens_, None, %cp_tokens, 2, 1, no_load_balance, 1), kwargs = {group_name: 0, calls: [cp_attention: causal, backward, torch.float32, scale None, kernel None, kv auto, kv_chunks 1], dims: [%s34, %s25, %s0, %s0]}) -> torch.Size([Min(s85, 2*s40 - 2) + 1])
%cp_plan : [num_users=6] = call_function[target=torch.ops.cpcompile.cp_plan.default](args = (%l_cu_seqlens_, None, %cp_tokens, 2, 1, striped, 4), kwargs = {group_name: 0, calls: [cp_attention: causal, backward, torch.float32, scale None, kernel None, kv auto, kv_chunks 1], dims: [%s34, %s25, %s0, %s0]}) -> torch.Size([Min(s85, 2*s40 + ((s85//4)) - 2) + 1])""",
        )

    def test_layers_share_one_plan(self):
        gm, count = self.shard(two_layers)
        self.assertEqual(count, 2)
        self.assertEqual(len(gm.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.cp_plan.default)), 1)

    def test_aot_forward_and_backward_graphs(self):
        graphs = aot_graphs(packed_model)
        self.assertExpectedInline(
            graphs["forward"],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "Sym(s85)", primals_2: "Sym(s34)", primals_3: "Sym(s0)", primals_4: "f32[s85, s34, s0]", primals_5: "Sym(s25)", primals_6: "f32[s85, s25, s0]", primals_7: "f32[s85, s25, s0]", primals_8: "Sym(s40)", primals_9: "i32[s40]", primals_10: "Sym(s7)"):
        mul: "Sym(2*s85)" = primals_1 * 2

        cp_plan = torch.ops.cpcompile.cp_plan.default(primals_9, None, mul, 2, 1, 'dual_chunk_swap', 1, group_name = '0', calls = ['cp_attention: causal, backward, torch.float32, scale None, kernel None, kv auto, kv_chunks 1'], dims = [primals_2, primals_5, primals_3, primals_3]);  primals_9 = mul = None
        getitem: "i64[2*s85]" = cp_plan[0]
        getitem_1: "i32[Min(s85, 3*s40 - 3) + 1]" = cp_plan[1]
        getitem_2: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[2]
        getitem_3: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[3]
        getitem_5: "i32[s40]" = cp_plan[5]
        getitem_6: "i32[s40]" = cp_plan[6];  cp_plan = None

        add_14: "Sym(s7 + 4)" = primals_10 + 4
        sub_7: "Sym(s7 + 3)" = add_14 - 1;  add_14 = None
        floordiv: "Sym(((s7 + 3)//4))" = sub_7 // 4;  sub_7 = None
        mul_8: "Sym(2*(((s7 + 3)//4)))" = floordiv * 2;  floordiv = None

        cp_attention = torch.ops.cpcompile.cp_attention.default(primals_4, primals_6, primals_7, getitem, getitem_1, getitem_2, getitem_3, '0', True, None, primals_10, mul_8, None, 'auto', 1, None, -1, -1, getitem_5, getitem_6)
        getitem_7: "f32[s85, s34, s0]" = cp_attention[0]
        getitem_8: "f32[s34, s85]" = cp_attention[1];  cp_attention = None
        detach: "f32[s85, s34, s0]" = torch.ops.aten.detach.default(getitem_7)
        return (getitem_7, primals_4, primals_6, primals_7, getitem, getitem_1, getitem_2, getitem_3, getitem_5, getitem_6, getitem_8, detach, primals_10, primals_3, primals_2, primals_1, primals_5, primals_8, mul_8)
""",
        )
        self.assertExpectedInline(
            graphs["backward"],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_10: "Sym(s7)", primals_3: "Sym(s0)", primals_2: "Sym(s34)", primals_1: "Sym(s85)", primals_5: "Sym(s25)", primals_8: "Sym(s40)", mul_8: "Sym(2*(((s7 + 3)//4)))", primals_4: "f32[s85, s34, s0]", primals_6: "f32[s85, s25, s0]", primals_7: "f32[s85, s25, s0]", getitem: "i64[2*s85]", getitem_1: "i32[Min(s85, 3*s40 - 3) + 1]", getitem_2: "i32[Min(s85, 3*s40 - 3)]", getitem_3: "i32[Min(s85, 3*s40 - 3)]", getitem_5: "i32[s40]", getitem_6: "i32[s40]", getitem_8: "f32[s34, s85]", detach: "f32[s85, s34, s0]", tangents_1: "f32[s85, s34, s0]"):
        detach_1: "f32[s85, s34, s0]" = torch.ops.aten.detach.default(detach);  detach = None
        cp_attention_backward = torch.ops.cpcompile.cp_attention_backward.default(tangents_1, primals_4, primals_6, primals_7, detach_1, getitem_8, getitem, getitem_1, getitem_2, getitem_3, '0', True, None, primals_10, mul_8, None, 'auto', 1, None, -1, -1, getitem_5, getitem_6);  tangents_1 = primals_4 = primals_6 = primals_7 = detach_1 = getitem_8 = getitem = getitem_1 = getitem_2 = getitem_3 = primals_10 = mul_8 = getitem_5 = getitem_6 = None
        getitem_9: "f32[s85, s34, s0]" = cp_attention_backward[0]
        getitem_10: "f32[s85, s25, s0]" = cp_attention_backward[1]
        getitem_11: "f32[s85, s25, s0]" = cp_attention_backward[2];  cp_attention_backward = None
        return (None, None, None, getitem_9, None, getitem_10, getitem_11, None, None, None)
""",
        )

    def test_windowed_varlen_attn_travels_in_the_cp_ops_arguments(self):
        """A sliding window: one window_keys per plan and window, its keys and the window in the CP ops'
        arguments (the causal window's alignment is bottom-right: no positions), on both paths."""

        def windows(q, k, v, cu, m):
            o = varlen_attn(q, k, v, cu, cu, m, m, window_size=(4, 0), **VARLEN_GQA)
            o = varlen_attn(o, k, v, cu, cu, m, m, window_size=(4, 0), **VARLEN_GQA)  # shares window_keys
            return varlen_attn(o, k, v, cu, cu, m, m, window_size=(2, 3), **VARLEN_GQA)

        for spec in (cpcompile.StrategySpec(), cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, kv="ring")):
            gm, count = self.shard(windows, spec)
            self.assertEqual(count, 3)
            nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
            keys = [n.args[4:] for n in nodes if n.target is torch.ops.cpcompile.window_keys.default]
            self.assertEqual(keys, [(4, 0), (2, 3)])
            op = torch.ops.cpcompile.cp_ring_attention if spec.kv == "ring" else torch.ops.cpcompile.cp_attention
            calls = [n for n in nodes if n.target is op.default]
            self.assertEqual([c.args[-2:] for c in calls], [(4, 0), (4, 0), (2, 3)])
            causal = 7 if spec.kv == "ring" else 8
            self.assertEqual([c.args[causal] for c in calls], [True, True, False])
            if spec.kv != "ring":
                self.assertEqual([c.args[-3] is None for c in calls], [True, True, False])  # q_pos

    def test_unsupported_variants_raise_unless_asked_to_stay_single_device(self):
        def window(q, k, v, cu, m):
            return varlen_attn(q, k, v, cu, cu, m, m, window_size=(-3, 0), **VARLEN_GQA)

        def cross(q, k, v, cu, m):
            return varlen_attn(q, k, v, cu, cu.clone(), m, m, **VARLEN_GQA)

        spec = cpcompile.StrategySpec()
        bad_window = r"window_size left must be -1 \(unbounded\) or >= 0, got \(-3, 0\)"
        for fn, reason in ((window, bad_window), (cross, "cu_seq_q and cu_seq_k differ")):
            gm = dynamo_graph(fn, *fake_rank_inputs())
            with self.assertRaisesRegex(
                UnsupportedAttentionError, f"_varlen_attn.*{reason}.*unsupported='single_device'"
            ):
                shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                count = shard_attention_pass(
                    gm, group_name=self.group, cp_size=2, rank=1, spec=spec, unsupported="single_device"
                )
            self.assertEqual(count, 0)
            self.assertEqual(len(caught), 1)
            self.assertRegex(str(caught[0].message), reason)
            self.assertEqual(len(find_packed_attention(gm)[1]), 1)  # still there, untouched
        with self.assertRaisesRegex(ValueError, "unsupported must be one of .*got 'warn'"):
            cpcompile.backend(unsupported="warn")

    def test_backend_refuses_to_compile_an_unsupported_call(self):
        def cross(q, k, v, cu, m):
            return varlen_attn(q, k, v, cu, cu.clone(), m, m, **VARLEN_GQA)

        torch._dynamo.reset()
        compiled = torch.compile(cross, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with self.assertRaisesRegex(Exception, r"cannot run 1 packed attention call.*cu_seq_q and cu_seq_k differ"):
            compiled(*fake_rank_inputs())

    def test_varlen_attn_out_is_refused(self):
        """torch 2.13's varlen_attn_out has no CP form yet: refused, not left single-device."""
        from torch.nn.attention import varlen

        if not hasattr(varlen, "varlen_attn_out"):
            self.skipTest("this torch has no varlen_attn_out")

        def into_buffer(q, k, v, cu, m):
            return varlen.varlen_attn_out(torch.empty_like(q), q, k, v, cu, cu, m, m, **VARLEN_GQA)

        gm = dynamo_graph(into_buffer, *fake_rank_inputs())
        spec = cpcompile.StrategySpec()
        with self.assertRaisesRegex(UnsupportedAttentionError, "varlen_attn_out writes into a given output buffer"):
            shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec)

    def test_strategy_switch_recompiles_and_returns_to_cached_graph(self):
        seen = []

        def capture(gm, example_inputs):
            (plan,) = gm.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.cp_plan.default)
            seen.append(plan.args[5])
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(varlen_model, backend=cpcompile.backend(inner=capture), dynamic=True)
        for name in ("dual_chunk_swap", "striped", "dual_chunk_swap", "no_load_balance"):
            # no_load_balance exchanges here, where rank 1 receives rows but sends none: the fake group fails
            with cpcompile.strategy(name, kv="all_gather"):
                compiled(*fake_rank_inputs(name))
        self.assertEqual(seen, ["dual_chunk_swap", "striped", "no_load_balance"])

    def test_the_last_graph_dynamo_would_compile_is_refused(self):
        """Past torch._dynamo.config.recompile_limit Dynamo runs the function eagerly, where attention is
        single-device on each rank's tokens: the graph that reaches the limit is refused, naming it."""
        torch._dynamo.reset()
        compiled = torch.compile(varlen_model, backend=cpcompile.backend(inner="eager"), dynamic=True)
        with torch._dynamo.config.patch(recompile_limit=3):
            for name in ("dual_chunk_swap", "striped", "dual_chunk_swap"):  # two graphs, the first reused
                with cpcompile.strategy(name, kv="all_gather"):
                    compiled(*fake_rank_inputs(name))
            with (
                cpcompile.strategy("no_load_balance", kv="all_gather"),
                self.assertRaisesRegex(
                    BackendCompilerFailed, r"this would be graph 3 .*recompile_limit is 3: past the limit Dynamo runs"
                ),
            ):
                compiled(*fake_rank_inputs("no_load_balance"))

    def test_sinks_travel_into_every_cp_op(self):
        """packed_attention's sinks become an input of the CP op each path inserts, so their gradient flows (the
        hybrid's slice of them, which needs cp >= 4, and every path's values: tests/attention/test_sinks.py)."""

        def fn(q, k, v, cu_seqlens, max_seqlen):
            return cpcompile.packed_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen, sinks=q[0, :, 0] * 0.5)

        specs = {
            "cp_attention": cpcompile.StrategySpec(),
            "cp_ring_attention": cpcompile.StrategySpec(kv="ring"),
            "cp_head_attention": cpcompile.StrategySpec(kv="heads", head_parallel=2),
        }
        for op, spec in specs.items():
            gm, count = self.shard(fn, spec)
            (node,) = [n for n in gm.graph.nodes if str(n.target) == f"cpcompile.{op}.default"]
            self.assertEqual(node.kwargs["sinks"].target, operator.mul, op)

    def test_ring_rewrite_shares_plan_and_key_ranges(self):
        """kv="ring": one cp_plan, one ring_key_ranges per causal flag, cp_ring_attention per call."""
        gm, count = self.shard(two_layers, cpcompile.StrategySpec(cpcompile.Strategy.STRIPED, kv="ring"))
        self.assertEqual(count, 2)
        self.assertExpectedInline(
            readable(gm),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, s85: "Sym(s85)", s34: "Sym(s34)", s0: "Sym(s0)", L_q_: "f32[s85, s34, s0]", s25: "Sym(s25)", L_k_: "f32[s85, s25, s0]", L_v_: "f32[s85, s25, s0]", s40: "Sym(s40)", L_cu_seqlens_: "i32[s40]", L_max_seqlen_: "Sym(s7)"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_cu_seqlens_ = L_cu_seqlens_
        l_max_seqlen_ = L_max_seqlen_

        local_tokens: "Sym(s85)" = torch.ops.aten.sym_size.int(l_q_, 0)
        cp_tokens: "Sym(2*s85)" = local_tokens * 2;  local_tokens = None

        cp_plan = torch.ops.cpcompile.cp_plan.default(l_cu_seqlens_, None, cp_tokens, 2, 1, 'striped', 1, group_name = '0', calls = ['cp_ring_attention: causal, backward, torch.float32, scale None, kernel None, kv ring, kv_chunks 1', 'cp_ring_attention: full, backward, torch.float32, scale None, kernel None, kv ring, kv_chunks 1'], dims = [s34, s25, s0, s0, s34, s25, s0, s0]);  l_cu_seqlens_ = cp_tokens = s34 = s25 = s0 = None

        gather_index: "i64[2*s85]" = cp_plan[0]
        cu_q: "i32[Min(s85, 2*s40 + s85 - 2) + 1]" = cp_plan[1]
        k_start: "i32[Min(s85, 2*s40 + s85 - 2)]" = cp_plan[2]
        k_len_causal: "i32[Min(s85, 2*s40 + s85 - 2)]" = cp_plan[3]
        k_len_full: "i32[Min(s85, 2*s40 + s85 - 2)]" = cp_plan[4];  cp_plan = None

        ring_key_ranges = torch.ops.cpcompile.ring_key_ranges.default(gather_index, k_start, k_len_causal, 2);  k_len_causal = None

        ring_start: "i32[2, Min(s85, 2*s40 + s85 - 2)]" = ring_key_ranges[0]
        ring_len: "i32[2, Min(s85, 2*s40 + s85 - 2)]" = ring_key_ranges[1];  ring_key_ranges = None

        cp_ring_attention = torch.ops.cpcompile.cp_ring_attention.default(l_q_, l_k_, l_v_, cu_q, ring_start, ring_len, '0', True, None, l_max_seqlen_, 1, None);  l_q_ = ring_start = ring_len = None
        o: "f32[s85, s34, s0]" = cp_ring_attention[0];  cp_ring_attention = None

        ring_key_ranges_1 = torch.ops.cpcompile.ring_key_ranges.default(gather_index, k_start, k_len_full, 2);  gather_index = k_start = k_len_full = None

        ring_start_1: "i32[2, Min(s85, 2*s40 + s85 - 2)]" = ring_key_ranges_1[0]
        ring_len_1: "i32[2, Min(s85, 2*s40 + s85 - 2)]" = ring_key_ranges_1[1];  ring_key_ranges_1 = None

        cp_ring_attention_1 = torch.ops.cpcompile.cp_ring_attention.default(o, l_k_, l_v_, cu_q, ring_start_1, ring_len_1, '0', False, None, l_max_seqlen_, 1, None);  o = l_k_ = l_v_ = cu_q = ring_start_1 = ring_len_1 = l_max_seqlen_ = None
        out: "f32[s85, s34, s0]" = cp_ring_attention_1[0];  cp_ring_attention_1 = None
        return (out,)
""",
        )

    def test_ring_aot_forward_and_backward_graphs(self):
        graphs = aot_graphs(packed_model, kv="ring")
        self.assertExpectedInline(
            graphs["forward"],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "Sym(s85)", primals_2: "Sym(s34)", primals_3: "Sym(s0)", primals_4: "f32[s85, s34, s0]", primals_5: "Sym(s25)", primals_6: "f32[s85, s25, s0]", primals_7: "f32[s85, s25, s0]", primals_8: "Sym(s40)", primals_9: "i32[s40]", primals_10: "Sym(s7)"):
        mul: "Sym(2*s85)" = primals_1 * 2

        cp_plan = torch.ops.cpcompile.cp_plan.default(primals_9, None, mul, 2, 1, 'dual_chunk_swap', 1, group_name = '0', calls = ['cp_ring_attention: causal, backward, torch.float32, scale None, kernel None, kv ring, kv_chunks 1'], dims = [primals_2, primals_5, primals_3, primals_3]);  primals_9 = mul = None
        getitem: "i64[2*s85]" = cp_plan[0]
        getitem_1: "i32[Min(s85, 3*s40 - 3) + 1]" = cp_plan[1]
        getitem_2: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[2]
        getitem_3: "i32[Min(s85, 3*s40 - 3)]" = cp_plan[3];  cp_plan = None
        ring_key_ranges = torch.ops.cpcompile.ring_key_ranges.default(getitem, getitem_2, getitem_3, 2);  getitem = getitem_2 = getitem_3 = None
        getitem_7: "i32[2, Min(s85, 3*s40 - 3)]" = ring_key_ranges[0]
        getitem_8: "i32[2, Min(s85, 3*s40 - 3)]" = ring_key_ranges[1];  ring_key_ranges = None

        add_20: "Sym(s7 + 4)" = primals_10 + 4
        sub_9: "Sym(s7 + 3)" = add_20 - 1;  add_20 = None
        floordiv: "Sym(((s7 + 3)//4))" = sub_9 // 4;  sub_9 = None
        mul_10: "Sym(2*(((s7 + 3)//4)))" = floordiv * 2;  floordiv = None

        cp_ring_attention = torch.ops.cpcompile.cp_ring_attention.default(primals_4, primals_6, primals_7, getitem_1, getitem_7, getitem_8, '0', True, None, primals_10, mul_10, None)
        getitem_9: "f32[s85, s34, s0]" = cp_ring_attention[0]
        getitem_10: "f32[s34, s85]" = cp_ring_attention[1];  cp_ring_attention = None
        detach: "f32[s85, s34, s0]" = torch.ops.aten.detach.default(getitem_9)
        return (getitem_9, primals_4, primals_6, primals_7, getitem_1, getitem_7, getitem_8, getitem_10, detach, primals_10, primals_3, primals_2, primals_1, primals_5, primals_8, mul_10)
""",
        )
        self.assertExpectedInline(
            graphs["backward"],
            """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_10: "Sym(s7)", primals_3: "Sym(s0)", primals_2: "Sym(s34)", primals_1: "Sym(s85)", primals_5: "Sym(s25)", primals_8: "Sym(s40)", mul_10: "Sym(2*(((s7 + 3)//4)))", primals_4: "f32[s85, s34, s0]", primals_6: "f32[s85, s25, s0]", primals_7: "f32[s85, s25, s0]", getitem_1: "i32[Min(s85, 3*s40 - 3) + 1]", getitem_7: "i32[2, Min(s85, 3*s40 - 3)]", getitem_8: "i32[2, Min(s85, 3*s40 - 3)]", getitem_10: "f32[s34, s85]", detach: "f32[s85, s34, s0]", tangents_1: "f32[s85, s34, s0]"):
        detach_1: "f32[s85, s34, s0]" = torch.ops.aten.detach.default(detach);  detach = None
        cp_ring_attention_backward = torch.ops.cpcompile.cp_ring_attention_backward.default(tangents_1, primals_4, primals_6, primals_7, detach_1, getitem_10, getitem_1, getitem_7, getitem_8, '0', True, None, primals_10, mul_10, None);  tangents_1 = primals_4 = primals_6 = primals_7 = detach_1 = getitem_10 = getitem_1 = getitem_7 = getitem_8 = primals_10 = mul_10 = None
        getitem_11: "f32[s85, s34, s0]" = cp_ring_attention_backward[0]
        getitem_12: "f32[s85, s25, s0]" = cp_ring_attention_backward[1]
        getitem_13: "f32[s85, s25, s0]" = cp_ring_attention_backward[2];  cp_ring_attention_backward = None
        return (None, None, None, getitem_11, None, getitem_12, getitem_13, None, None, None)
""",
        )

    def test_comm_switch_recompiles_and_returns_to_cached_graph(self):
        seen = []

        def capture(gm, example_inputs):
            (cp,) = [n for n in gm.graph.nodes if n.name in ("cp_attention", "cp_ring_attention")]
            seen.append(cp.target.name())
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(varlen_model, backend=cpcompile.backend(inner=capture), dynamic=True)
        for kv in ("auto", "ring", "auto", "ring"):
            with cpcompile.strategy("striped", kv=kv):
                compiled(*fake_rank_inputs("striped"))
        self.assertEqual(seen, ["cpcompile::cp_attention", "cpcompile::cp_ring_attention"])


class ManyPacks(FakeGroupTestCase):
    def test_one_graph_for_fifty_packs_of_any_composition(self):
        """50 packs whose token and document counts vary (1-token documents, single-document packs,
        hundreds of tokens or a few dozen) train through one compiled graph per strategy: nothing of
        a pack's composition is specialised on. (Dynamo does specialise sizes and ints of 0 and 1, so
        every pack here gives a rank 2+ tokens and has a document of 2+ tokens.)"""
        cfg = GPTConfig(vocab=32, dim=32, heads=2, kv_heads=1, layers=2, max_position=512)
        model = PackedGPT(cfg)
        # the fake group fills an all-to-all's output with its input, and fails where a rank
        # receives rows but sends none: the sparse exchange cannot run on it in general
        for strategy in ("balanced", "dual_chunk_swap"):
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
            g = torch.Generator().manual_seed(0)
            for i in range(50):
                docs = 1 if i % 7 == 0 else int(torch.randint(2, 12, (1,), generator=g))
                lengths = torch.randint(1, 60, (docs,), generator=g).tolist()
                lengths[0] = max(lengths[0], 4)  # a document of 2+ tokens, 2+ tokens per rank
                if docs > 1 and i % 3 == 0:  # a 1-token document somewhere after the first
                    lengths[1 + i % (docs - 1)] = 1
                pack = synthetic_pack(lengths, cfg.vocab, g)
                names = ("input_ids", "position_ids")
                batch = cpcompile.shard_batch(
                    {n: pack[n] for n in names}, pack["cu_seqlens"], cp_size=2, rank=1, strategy=strategy
                )
                with cpcompile.strategy(batch, kv="all_gather"):
                    out = compiled(*(batch.tensors[n] for n in names), batch.cu_seqlens, max(lengths))
                out.sum().backward()
            self.assertEqual(counters["stats"]["unique_graphs"], 1, strategy)


def test_backend_is_registered_by_name():
    """``torch.compile(backend="cpcompile")`` finds it through the package's entry point."""
    from torch._dynamo.backends.registry import lookup_backend

    from cpcompile.compiler.backend import default_backend

    assert lookup_backend("cpcompile") is default_backend

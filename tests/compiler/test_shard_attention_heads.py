"""The attention pass under ``head_parallel`` on a fake process group (shapes and graphs only).

The snapshot pins what the pass makes of a packed attention call under
``head_parallel == cp``: one ``cp_head_plan`` (the same on every rank: no rank argument)
and ``cp_head_attention`` on whole documents; arguments it cannot run fail the compile,
naming the argument. Refresh with ``EXPECTTEST_ACCEPT=1``.
"""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.compiler.shard_attention import shard_attention_pass
from tests.fixtures import readable
from tests.graphs import FakeGroupTestCase, dynamo_graph, fake_rank_inputs, two_layers

SPEC = cpcompile.StrategySpec("no_load_balance", kv="heads", head_parallel=2)


class HeadParallelGraphs(FakeGroupTestCase):
    def test_two_layers_share_one_head_plan(self):
        gm = dynamo_graph(two_layers, *fake_rank_inputs(SPEC))
        assert shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=SPEC) == 2
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

        cp_head_plan = torch.ops.cpcompile.cp_head_plan.default(l_cu_seqlens_, None, cp_tokens, 2, 'no_load_balance', 1, group_name = '0', calls = ['cp_head_attention: causal, backward, torch.float32, scale None, kernel None, kv heads, kv_chunks 1', 'cp_head_attention: full, backward, torch.float32, scale None, kernel None, kv heads, kv_chunks 1'], dims = [s34, s25, s0, s0, s34, s25, s0, s0]);  l_cu_seqlens_ = cp_tokens = s34 = s25 = s0 = None

        gather_index: "i64[2*s85]" = cp_head_plan[0]
        cu_q: "i32[Min(2*s85, 2*s40 - 2) + 1]" = cp_head_plan[1]
        k_start: "i32[Min(2*s85, 2*s40 - 2)]" = cp_head_plan[2]
        k_len_causal: "i32[Min(2*s85, 2*s40 - 2)]" = cp_head_plan[3]
        k_len_full: "i32[Min(2*s85, 2*s40 - 2)]" = cp_head_plan[4];  cp_head_plan = None

        cp_head_attention = torch.ops.cpcompile.cp_head_attention.default(l_q_, l_k_, l_v_, gather_index, cu_q, k_start, k_len_causal, '0', True, None, l_max_seqlen_, None);  l_q_ = k_len_causal = None
        o: "f32[s85, s34, s0]" = cp_head_attention[0];  cp_head_attention = None

        cp_head_attention_1 = torch.ops.cpcompile.cp_head_attention.default(o, l_k_, l_v_, gather_index, cu_q, k_start, k_len_full, '0', False, None, l_max_seqlen_, None);  o = l_k_ = l_v_ = gather_index = cu_q = k_start = k_len_full = l_max_seqlen_ = None
        out: "f32[s85, s34, s0]" = cp_head_attention_1[0];  cp_head_attention_1 = None
        return (out,)
""",
        )

    def test_heads_that_do_not_split_fail_the_compile(self):
        q, k, v, cu, max_seqlen = fake_rank_inputs(SPEC)
        gm = dynamo_graph(two_layers, q[:, :3], k[:, :1], v[:, :1], cu, max_seqlen)
        with pytest.raises(ValueError, match="head_parallel=2 must divide the number of query heads 3"):
            shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=SPEC)

    def test_head_parallel_that_does_not_divide_cp_is_refused(self):
        gm = dynamo_graph(two_layers, *fake_rank_inputs(SPEC))
        with pytest.raises(ValueError, match="head_parallel=2 must divide the CP size 3"):
            shard_attention_pass(gm, group_name=self.group, cp_size=3, rank=1, spec=SPEC)

    def test_compiled_model_trains_on_fake_ranks(self):
        """Through ``cpcompile.backend`` (AOT forward and backward ops traced; values are garbage)."""
        torch._dynamo.reset()
        compiled = torch.compile(two_layers, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        q, k, v, cu, max_seqlen = fake_rank_inputs(SPEC)
        with cpcompile.strategy(SPEC):
            out = compiled(q, k, v, cu, max_seqlen)
            out.sum().backward()
        assert out.shape == q.shape
        assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]

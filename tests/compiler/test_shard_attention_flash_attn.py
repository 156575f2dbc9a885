"""The attention pass rewrites flash-attn's own varlen ops (fake process group, graphs only).

flash-attn 2 (>= 2.7) and 3 register their kernels as ``torch.library`` ops, so a model
calling them compiles to a Dynamo graph holding ``flash_attn::_flash_attn_varlen_forward``
or ``flash_attn_3::_flash_attn_forward``. Without flash-attn installed (CPU CI), this
module registers ops with the published schemas (no kernel, a fake only) so that Dynamo
records them; the ops are never called. Refresh snapshots with ``EXPECTTEST_ACCEPT=1``.
"""

from __future__ import annotations

import functools
import importlib
import operator

import torch

import cpcompile
from cpcompile.compiler.shard_attention import UnsupportedAttentionError, find_packed_attention, shard_attention_pass
from tests import graphs as base
from tests.fixtures import readable

# fmt: off
# Published schemas (Dao-AILab/flash-attention at tag fa4-v4.0.0.beta27, 0251105a, flash_attn 2.8.4):
#
# flash_attn/flash_attn_interface.py (flash-attn 2; the op exists since 2.7.0, zero_tensors since
# 2.7.3, num_splits since 2026-04; the pass reads arguments by name, so each version matches):
#   @_torch_custom_op_wrapper("flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cuda")
#   def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
#       dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
#       window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
#       return_softmax: bool = False, block_table: Optional[Tensor] = None, leftpad_k: Optional[Tensor] = None,
#       seqused_k: Optional[Tensor] = None, zero_tensors: bool = False, num_splits: int = 0,
#   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]  # out, softmax_lse [heads, total_q] float32, S_dmask, rng_state
#
# hopper/flash_attn_interface.py (flash-attn 3; varlen when cu_seqlens_q is given):
#   @torch.library.custom_op("flash_attn_3::_flash_attn_forward", mutates_args=(), device_types="cuda")
#   def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
#       cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q: Optional[int] = None,
#       max_seqlen_k: Optional[int] = None, page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None,
#       rotary_sin=None, seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None,
#       softmax_scale: Optional[float] = None, causal: bool = False, window_size_left: int = -1,
#       window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0, rotary_interleaved: bool = True,
#       scheduler_metadata=None, num_splits: int = 1, pack_gqa: Optional[bool] = None, sm_margin: int = 0,
#   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]  # out, softmax_lse [heads, total_q] float32, out_accum, lse_accum
# fmt: on

FA2 = "flash_attn::_flash_attn_varlen_forward"
FA3 = "flash_attn_3::_flash_attn_forward"


def _has_op(name: str) -> bool:
    namespace, op = name.split("::")
    return hasattr(getattr(torch.ops, namespace), op)


# What torch.library.custom_op makes of the published signatures above (flash-attn registers them so)
SCHEMAS = {
    FA2: "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left=-1, "
    "SymInt window_size_right=-1, float softcap=0., Tensor? alibi_slopes=None, bool return_softmax=False, "
    "Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, bool zero_tensors=False, "
    "SymInt num_splits=0) -> (Tensor, Tensor, Tensor, Tensor)",
    FA3: "(Tensor q, Tensor k, Tensor v, Tensor? k_new=None, Tensor? v_new=None, Tensor? qv=None, Tensor? out_=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, "
    "Tensor? seqused_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? page_table=None, "
    "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
    "Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
    "float? softmax_scale=None, bool causal=False, SymInt window_size_left=-1, SymInt window_size_right=-1, "
    "SymInt attention_chunk=0, float softcap=0., bool rotary_interleaved=True, Tensor? scheduler_metadata=None, "
    "SymInt num_splits=1, bool? pack_gqa=None, SymInt sm_margin=0) -> (Tensor, Tensor, Tensor, Tensor)",
}


def _fake_flash_attn_2(q, k, v, *args, **kwargs):
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)  # [heads, total_q]
    return torch.empty_like(q), lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


def _fake_flash_attn_3(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, *args, **kwargs):
    # varlen: q [total_q, heads, dim], lse [heads, total_q]; batched: q [b, s, heads, dim], lse [b, heads, s]
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    return out, q.new_empty(lse_shape, dtype=torch.float32), q.new_empty(0), q.new_empty(0)


def _has_op(name: str) -> bool:
    namespace, op = name.split("::")
    return hasattr(getattr(torch.ops, namespace), op)


def _register_published_ops() -> None:
    """flash-attn's varlen ops: the installed package's, else stand-ins with the published schemas
    (no kernel: a call outside tracing fails; a fake for Dynamo)."""
    for name, module, fake in (
        (FA2, "flash_attn.flash_attn_interface", _fake_flash_attn_2),
        (FA3, "flash_attn_interface", _fake_flash_attn_3),
    ):
        if not _has_op(name):
            try:
                importlib.import_module(module)
            except ImportError:  # flash-attn absent (or without its CUDA extension)
                pass
        if not _has_op(name):
            torch.library.define(name, SCHEMAS[name])
            torch.library.register_fake(name, fake)


_register_published_ops()

SCALE = 0.35  # flash-attn 2 takes the scale as a float, never None


def fa2(q, k, v, cu, m, cross=False, dropout_p=0.0, **kwargs):
    cu_k = cu.clone() if cross else cu
    return torch.ops.flash_attn._flash_attn_varlen_forward(q, k, v, cu, cu_k, m, m, dropout_p, SCALE, **kwargs)


def fa3(q, k, v, cu, m, **kwargs):
    return torch.ops.flash_attn_3._flash_attn_forward(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, **kwargs
    )


def fa2_model(q, k, v, cu, m):
    return fa2(q, k, v, cu, m, causal=True)[0]


def fa3_model(q, k, v, cu, m):
    """Reads the lse too: ``cp_attention``'s has flash-attn's varlen layout, [heads, tokens]."""
    out, lse, *_ = fa3(q, k, v, cu, m, causal=True)
    return out * lse.t().unsqueeze(-1)


class FlashAttnGraphs(base.FakeGroupTestCase):
    def backend_graph(self, fn, kept=("cp_plan", "cp_attention", "return")) -> str:
        """The lines of the Dynamo graph ``cpcompile.backend`` hands its inner compiler (after one fake
        step) that mention one of ``kept``: the rest is ``test_shard_attention``'s rewrite, line for line."""
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(readable(gm))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(fn, backend=cpcompile.backend(inner=capture), dynamic=True, fullgraph=True)(
            *base.fake_rank_inputs()
        )
        (graph,) = graphs
        return "\n".join(line.strip() for line in graph.splitlines() if any(w in line for w in kept)) + "\n"

    def shard(self, fn, **kwargs) -> int:
        gm = base.dynamo_graph(fn, *base.fake_rank_inputs())
        return shard_attention_pass(
            gm, group_name=self.group, cp_size=2, rank=1, spec=cpcompile.StrategySpec(), **kwargs
        )

    def test_flash_attn_2_varlen_becomes_cp_attention(self):
        gm = base.dynamo_graph(fa2_model, *base.fake_rank_inputs())
        self.assertExpectedInline(
            [n.format_node() for n in gm.graph.nodes if n.op == "call_function"][0],
            """%_flash_attn_varlen_forward : [num_users=1] = call_function[target=torch.ops.flash_attn._flash_attn_varlen_forward](args = (%l_q_, %l_k_, %l_v_, %l_cu_, %l_cu_, %l_m_, %l_m_, %item, %item_1), kwargs = {causal: True})""",
        )
        self.assertExpectedInline(
            self.backend_graph(fa2_model),
            """\
cp_plan = torch.ops.cpcompile.cp_plan.default(l_cu_, None, cp_tokens, 2, 1, 'dual_chunk_swap', 1, group_name = '0', calls = ['cp_attention: causal, backward, torch.float32, scale item_1, kernel None, kv auto, kv_chunks 1'], dims = [s34, s25, s0, s0]);  l_cu_ = cp_tokens = s34 = s25 = s0 = None
gather_index: "i64[2*s85]" = cp_plan[0]
cu_q: "i32[Min(s85, 3*s42 - 3) + 1]" = cp_plan[1]
k_start: "i32[Min(s85, 3*s42 - 3)]" = cp_plan[2]
k_len_causal: "i32[Min(s85, 3*s42 - 3)]" = cp_plan[3]
cu_seqlens: "i32[s42]" = cp_plan[5]
cu_seqlens_padded: "i32[s42]" = cp_plan[6];  cp_plan = None
cp_attention = torch.ops.cpcompile.cp_attention.default(l_q_, l_k_, l_v_, gather_index, cu_q, k_start, k_len_causal, '0', True, item_1, l_m_, mul, None, 'auto', 1, cu_seqlens = cu_seqlens, cu_seqlens_padded = cu_seqlens_padded);  l_q_ = l_k_ = l_v_ = gather_index = cu_q = k_start = k_len_causal = item_1 = l_m_ = mul = cu_seqlens = cu_seqlens_padded = None
getitem: "f32[s85, s34, s0]" = cp_attention[0];  cp_attention = None
return (getitem,)
""",
        )

    def test_flash_attn_3_varlen_becomes_cp_attention_and_gives_its_lse(self):
        self.assertExpectedInline(
            self.backend_graph(fa3_model, kept=("cp_attention", "return")),
            """\
cp_plan = torch.ops.cpcompile.cp_plan.default(l_cu_, None, cp_tokens, 2, 1, 'dual_chunk_swap', 1, group_name = '0', calls = ['cp_attention: causal, backward, torch.float32, scale None, kernel None, kv auto, kv_chunks 1'], dims = [s34, s25, s0, s0]);  l_cu_ = cp_tokens = s34 = s25 = s0 = None
cp_attention = torch.ops.cpcompile.cp_attention.default(l_q_, l_k_, l_v_, gather_index, cu_q, k_start, k_len_causal, '0', True, None, l_m_, mul_1, None, 'auto', 1, cu_seqlens = cu_seqlens, cu_seqlens_padded = cu_seqlens_padded);  l_q_ = l_k_ = l_v_ = gather_index = cu_q = k_start = k_len_causal = l_m_ = mul_1 = cu_seqlens = cu_seqlens_padded = None
out: "f32[s85, s34, s0]" = cp_attention[0]
lse: "f32[s34, s85]" = cp_attention[1];  cp_attention = None
return (mul,)
""",
        )

    def test_flash_attn_3_batched_call_is_not_a_packed_call(self):
        def batched(q, k, v, cu, m):
            return torch.ops.flash_attn_3._flash_attn_forward(q[None], k[None], v[None], causal=True)[0][0]

        gm = base.dynamo_graph(batched, *base.fake_rank_inputs())
        self.assertEqual(find_packed_attention(gm), ([], []))

    def test_unsupported_variants_raise(self):
        cu = base.fake_rank_inputs()[3]
        variants = {
            FA2: (
                (dict(causal=True, dropout_p=0.1), "dropout_p=0.1"),
                (
                    dict(causal=False, window_size_left=-3, window_size_right=0),
                    r"window_size left must be -1 .*\(-3, 0\)",
                ),
                (dict(causal=True, cross=True), "cu_seqlens_q and cu_seqlens_k differ"),
                (dict(causal=True, seqused_k=cu[1:] - cu[:-1]), "seqused_k is not supported"),
                (dict(causal=True, alibi_slopes=torch.ones(4)), "alibi_slopes is not supported"),
                (dict(causal=True, softcap=-1.0), "softcap=-1.0 is not supported"),
                (dict(causal=True, return_softmax=True, output=2), "its S_dmask output is used"),
            ),
            FA3: (
                (
                    dict(causal=True, window_size_left=0, window_size_right=-2),
                    r"window_size right must be -1 .*\(0, -2\)",
                ),
                (dict(causal=True, seqused_q=cu[1:] - cu[:-1]), "seqused_q is not supported"),
                (dict(causal=True, attention_chunk=16), "attention_chunk=16"),
            ),
        }
        for op, cases in variants.items():
            for kwargs, reason in cases:
                with self.subTest(op=op, reason=reason):
                    kwargs = dict(kwargs)
                    output, call = kwargs.pop("output", 0), fa2 if op == FA2 else fa3

                    def fn(q, k, v, cu, m, call=call, kwargs=kwargs, output=output):
                        outs = call(q, k, v, cu, m, **kwargs)
                        return outs[0] + outs[output].sum() if output else outs[0]

                    name = op.split("::")[1]
                    with self.assertRaisesRegex(UnsupportedAttentionError, f"{name}.*{reason}"):
                        self.shard(fn)

    def test_sliding_windows_are_rewritten_with_their_window(self):
        """flash-attn's windows run context-parallel: a causal kernel ends each window at its query."""
        for call, kwargs, window in (
            (fa2, dict(causal=False, window_size_left=8, window_size_right=0), (8, 0)),
            (fa2, dict(causal=False, window_size_left=3, window_size_right=5), (3, 5)),
            (fa3, dict(causal=True, window_size_left=8, window_size_right=-1), (8, 0)),
        ):
            fn = functools.partial(lambda q, k, v, cu, m, call, kwargs: call(q, k, v, cu, m, **kwargs)[0], call=call)
            gm = base.dynamo_graph(functools.partial(fn, kwargs=kwargs), *base.fake_rank_inputs())
            spec = cpcompile.StrategySpec()
            self.assertEqual(shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec), 1)
            (cp,) = gm.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.cp_attention.default)
            self.assertEqual((cp.args[8], cp.args[-2:]), (window[1] == 0, window))

    def test_soft_capping_travels_to_the_cp_op(self):
        """flash-attn's ``softcap`` (Gemma 2's logit soft-capping) runs context-parallel: the CP op carries it."""
        for call in (fa2, fa3):
            fn = functools.partial(
                lambda q, k, v, cu, m, call: call(q, k, v, cu, m, causal=True, softcap=30.0)[0], call=call
            )
            gm = base.dynamo_graph(fn, *base.fake_rank_inputs())
            spec = cpcompile.StrategySpec()
            self.assertEqual(shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec), 1)
            (cp,) = gm.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.cp_attention.default)
            self.assertEqual(cp.kwargs["softcap"], 30.0)

    def test_backend_refuses_an_unsupported_flash_attn_call(self):
        def negative_cap(q, k, v, cu, m):
            return fa2(q, k, v, cu, m, causal=True, softcap=-1.0)[0]

        torch._dynamo.reset()
        compiled = torch.compile(negative_cap, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with self.assertRaisesRegex(Exception, r"cannot run 1 packed attention call.*softcap=-1.0"):
            compiled(*base.fake_rank_inputs())

    def test_dropout_is_guarded_not_read_once(self):
        """Dynamo lifts a float argument (``dropout_p``) under ``dynamic=True``: the pass's check
        guards the graph, so a step with dropout recompiles and is refused."""

        def model(q, k, v, cu, m, p):
            return fa2(q, k, v, cu, m, dropout_p=p, causal=True)[0]

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        compiled(*base.fake_rank_inputs(), 0.0)
        with self.assertRaisesRegex(Exception, "dropout_p=0.1 is not supported"):
            compiled(*base.fake_rank_inputs(), 0.1)

    def test_call_inside_an_autograd_function_is_refused(self):
        """flash-attn's ``flash_attn_varlen_func`` is an autograd.Function around the op: CP cannot
        replace its backward (flash-attn's own kernel on the CP output), so the call is refused, in
        the forward body Dynamo puts in the graph and in the forward it compiles alone when the
        Function gets one tensor twice (cu_seqlens for queries and keys: a graph break)."""

        class FlashAttnVarlenFunc(torch.autograd.Function):  # the shape of flash-attn's, trimmed
            @staticmethod
            def forward(ctx, q, k, v, cu_q, cu_k, m):
                out, lse, *_ = torch.ops.flash_attn._flash_attn_varlen_forward(
                    q, k, v, cu_q, cu_k, m, m, 0.0, SCALE, True
                )
                ctx.save_for_backward(q, k, v, out, lse)
                return out

            @staticmethod
            def backward(ctx, dout):
                q, k, v, out, lse = ctx.saved_tensors
                return dout * lse.t().unsqueeze(-1), k, v, None, None, None

        def forward_body(q, k, v, cu, m):
            # two tensors (cu and a view): Dynamo keeps the Function in the graph
            return FlashAttnVarlenFunc.apply(q, k, v, cu, cu[:], m)

        def forward_alone(q, k, v, cu, m):
            return FlashAttnVarlenFunc.apply(q, k, v, cu, cu, m)

        for model in (forward_body, forward_alone):
            with self.subTest(model.__name__):
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
                with self.assertRaisesRegex(Exception, "_flash_attn_varlen_forward.*inside a torch.autograd"):
                    compiled(*base.fake_rank_inputs())

    def test_no_grad_on_inputs_that_require_grad_names_both_causes(self):
        """Grad mode off on q/k/v that require grad is what a Function's forward compiled alone looks
        like, and what ``torch.no_grad()`` on such inputs looks like: the pass cannot tell them apart
        (the Function's backward would be wrong), so it refuses and names both."""
        torch._dynamo.reset()
        compiled = torch.compile(fa2_model, backend=cpcompile.backend(inner="aot_eager"), dynamic=True)
        with torch.no_grad(), self.assertRaisesRegex(Exception, r"or under torch.no_grad\(\) \(pass q, k, v detached"):
            compiled(*base.fake_rank_inputs())

    def test_an_argument_a_build_adds_is_refused_unless_at_its_default(self):
        """A build of flash-attn 3 with an argument the published schema lacks (vLLM's learnable sinks,
        ``s_aux``): the rewrite would drop it, so a call that sets it is refused, naming it."""
        from unittest import mock

        from cpcompile.compiler import shard_attention

        name = "cpcompile_tests::fa3_with_s_aux"
        if not _has_op(name):
            torch.library.define(
                name, SCHEMAS[FA3].replace(", SymInt sm_margin=0)", ", SymInt sm_margin=0, Tensor? s_aux=None)")
            )
            torch.library.register_fake(name, _fake_flash_attn_3)
        op = torch.ops.cpcompile_tests.fa3_with_s_aux

        def model(q, k, v, cu, m, s_aux=None):
            return op(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, causal=True, s_aux=s_aux)[0]

        with mock.patch.dict(shard_attention._VARLEN_SCHEMAS, {name: shard_attention._VARLEN_SCHEMAS[FA3]}):
            self.assertEqual(self.shard(model), 1)
            with self.assertRaisesRegex(UnsupportedAttentionError, r"s_aux=.* is not supported under CP"):
                self.shard(lambda *a: model(*a, s_aux=torch.zeros(4)))

    def test_unread_outputs_do_not_block_the_rewrite(self):
        """An unpacked output nobody reads (``out, lse, s_dmask, rng_state = ...``; Dynamo drops such
        nodes from the root graph, not always from subgraph bodies) does not make the call unsupported."""
        gm = base.dynamo_graph(fa2_model, *base.fake_rank_inputs())
        (call,) = gm.graph.find_nodes(op="call_function", target=torch.ops.flash_attn._flash_attn_varlen_forward)
        with gm.graph.inserting_after(call):
            for index in (2, 3):
                gm.graph.call_function(operator.getitem, (call, index))
        spec = cpcompile.StrategySpec()
        self.assertEqual(shard_attention_pass(gm, group_name=self.group, cp_size=2, rank=1, spec=spec), 1)
        (cp,) = gm.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.cp_attention.default)
        self.assertEqual([user.args[1] for user in cp.users], [0])

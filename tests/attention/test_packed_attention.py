"""``packed_attention`` against float64 per-document attention; opcheck on both ops;
argument errors before any work."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import cpcompile
from tests.fixtures import attention_case
from tests.reference import attention_fp64, relative_error


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("dv", "softcap"), [(None, None), (12, None), (None, 0.7), (4, 0.7)])  # MLA, Gemma 2
def test_packed_attention_matches_fp64(causal, heads, padded, dv, softcap):
    lengths = [1, 17, 6, 30]
    padded_lengths = [4, 20, 6, 33] if padded else None
    cu, cu_p, q, k, v, dout = attention_case(lengths, *heads, dv=dv, padded_lengths=padded_lengths)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = {"causal": causal, "cu_seqlens_padded": cu_p, "scale": 0.3, "softcap": softcap}
    out = cpcompile.packed_attention(*leaves, cu, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_fp64(*ref_leaves, cu, **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    assert relative_error(out, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 1e-5
    if padded:  # padding rows: zero output and zero gradient
        pad = torch.ones(q.shape[0], dtype=torch.bool)
        pad[cpcompile.batch.physical_positions(cu, cu_p)] = False
        assert out[pad].abs().max() == 0 and grads[0][pad].abs().max() == 0 and grads[1][pad].abs().max() == 0


def test_opcheck_packed_attention():
    cu, cu_p, q, k, v, _ = attention_case([3, 9, 4], padded_lengths=[4, 10, 6])
    for causal in (True, False):
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu_p, 10, causal, None)
        opcheck(torch.ops.cpcompile.packed_attention.default, args)
    # values of their own head dim, soft-capped
    v = torch.randn(*v.shape[:2], 4, requires_grad=True)
    opcheck(torch.ops.cpcompile.packed_attention.default, (q, k, v, cu, cu_p, 10, True, None), {"softcap": 2.0})


def test_opcheck_cp_attention(single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    plan = cpcompile.plan.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    for causal in (True, False):
        args = (
            q.requires_grad_(),
            k.requires_grad_(),
            v.requires_grad_(),
            plan.gather_index,
            plan.cu_q,
            plan.k_start,
            plan.k_len(causal),
            single_rank_group.group_name,
            causal,
            None,
            9,
            9,
            None,  # kernel, kv_exchange, kv_chunks: from the StrategySpec's kernel, kv and kv_chunks
            "auto",
            1,
        )
        opcheck(torch.ops.cpcompile.cp_attention.default, args)


def test_cp_attention_on_one_rank_is_packed_attention(single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    want = cpcompile.packed_attention(q, k, v, cu)
    got = cpcompile.cp_attention(q, k, v, cu, strategy="no_load_balance")
    assert torch.allclose(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
        (lambda a: {**a, "k": a["k"][:5]}, ValueError, "k and v must agree in tokens and heads"),
        (lambda a: {**a, "q": a["q"][0]}, ValueError, r"q must be \[tokens, heads, head_dim\]"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, ValueError, "cu_seqlens must have dtype torch.int32"),
        (
            lambda a: {**a, "cu_seqlens": torch.tensor([0, 9, 3, 16], dtype=torch.int32)},
            ValueError,
            "cu_seqlens must be non-decreasing",
        ),
        (
            lambda a: {**a, "cu_seqlens": torch.tensor([0, 3, 15], dtype=torch.int32)},
            ValueError,
            r"cu_seqlens\[-1\] = 15 must equal the number of tokens in q \(16\)",
        ),
        (
            lambda a: {**a, "cu_seqlens": torch.tensor([0, 3, 19], dtype=torch.int32)},
            ValueError,
            r"= 19 must equal the number of tokens in q \(16\) \(one CP rank's rows\? .*cpcompile.backend",
        ),
        (lambda a: {**a, "q": a["q"].int()}, ValueError, "q must be a floating-point tensor"),
        (
            lambda a: {**a, "cu_seqlens": a["cu_seqlens"].to("meta")},
            ValueError,
            r"cu_seqlens must be on the device of q \(cpu\), got meta",
        ),
        (
            lambda a: {**a, "max_seqlen": 8},
            ValueError,
            r"max_seqlen=8 is shorter than the longest document \(9 tokens\)",
        ),
        (lambda a: {**a, "max_seqlen": 0}, ValueError, "max_seqlen must be None or an int of at least 1"),
        (lambda a: {**a, "scale": float("nan")}, ValueError, "scale must be None .* a finite positive number, got nan"),
        (lambda a: {**a, "k": a["k"][:, :0], "v": a["v"][:, :0]}, ValueError, "k must have at least one head"),
        (lambda a: {**a, "softcap": -1.0}, ValueError, r"softcap must be None or 0 .* got -1.0"),
        (lambda a: {**a, "softcap": float("inf")}, ValueError, r"softcap must be None or 0 .* got inf"),
    ],
)
def test_packed_attention_rejects_bad_arguments(mutate, error, message):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    args = mutate({"q": q, "k": k, "v": v, "cu_seqlens": cu})
    with pytest.raises(error, match=message):
        cpcompile.packed_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens"), **args)


def test_compiled_packed_attention_checks_the_token_count():
    """A compiled graph calls the op, not ``packed_attention``'s checks: rows that cu_seqlens does not cover
    (a batch padded for CP, run on one device or a CP group of one) are an error there too, not an
    IndexError in the kernel."""
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    pad = [torch.cat([t, t.new_zeros(4, *t.shape[1:])]) for t in (q, k, v)]  # 4 rows of no document
    torch._dynamo.reset()
    compiled = torch.compile(cpcompile.packed_attention, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 16 must equal .* \(20\) .* pass cu_seqlens_padded"):
        compiled(*pad, cu)
    padded = torch.tensor([0, 3, 12, 20], dtype=torch.int32)
    got = compiled(*pad, cu, cu_seqlens_padded=padded)
    assert torch.equal(got[:16], cpcompile.packed_attention(q, k, v, cu)) and not got[16:].any()
    torch._dynamo.reset()


@pytest.mark.parametrize("softcap", [float("nan"), -1.0])
def test_compiled_packed_attention_checks_a_constant_softcap(softcap):
    """A softcap that is a constant while compiling is checked as in eager (only a symbolic one is left to
    the ops' schemas)."""
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: cpcompile.packed_attention(*a, softcap=softcap), backend="eager")
    with pytest.raises(ValueError, match=rf"softcap must be None or 0 .* got {softcap}"):
        compiled(q, k, v, cu)
    torch._dynamo.reset()


def test_ranks_agree_on_the_softcap_by_value():
    """What the ranks of a cp_attention call compare: the normalised softcap, so that None and 0, 30 and
    30.0 are the same call and 30 and 40 are not."""
    from cpcompile.attention.api import _call_record

    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    record = lambda softcap: _call_record(q, k, v, cu, None, cpcompile.StrategySpec(), (-1, 0), None, None, softcap)  # noqa: E731
    assert record(None) == record(0) == record(0.0)
    assert record(30) == record(30.0) and repr(record(30)) == repr(record(30.0))
    assert record(30) != record(40)


def test_cp_attention_rejects_bad_arguments(single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    with pytest.raises(TypeError, match="unexpected keyword argument 'comm'"):  # one channel: the spec's kv
        cpcompile.cp_attention(q, k, v, cu, comm="ring")
    with pytest.raises(ValueError, match=r"kernel must be one of \('reference', .*got 'fa9'"):
        cpcompile.packed_attention(q, k, v, cu, kernel="fa9")
    with pytest.raises(ValueError, match="strategy must be one of"):
        cpcompile.cp_attention(q, k, v, cu, strategy="zigzag")
    padded = torch.tensor([0, 4, 14, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_padded gives a document fewer tokens"):
        cpcompile.cp_attention(q, k, v, cu, cu_seqlens_padded=padded, strategy="no_load_balance")
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must be on the device of q \(cpu\), got meta"):
        cpcompile.cp_attention(q, k, v, cu, cu_seqlens_padded=padded.to("meta"), strategy="no_load_balance")


def test_packed_attention_compiles_with_inductor():
    """Without CP the op stays in the graph and Inductor lowers it as a fallback kernel, with
    every argument, the configuration's included, by name."""
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    torch._dynamo.reset()
    compiled = torch.compile(cpcompile.packed_attention, backend="inductor", dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, cu), cpcompile.packed_attention(q, k, v, cu))


def test_backend_keeps_the_group_by_name(single_rank_group):
    """Dynamo keeps compiled backends until ``torch._dynamo.reset()``: one holding the ``ProcessGroup``
    kept it past ``destroy_process_group()`` to interpreter exit, where gloo aborts the process. The
    backend keeps the group's name; a group of another type is an error when the backend is made."""
    import torch.distributed as dist

    backend = cpcompile.backend(group=single_rank_group)
    held = [cell.cell_contents for cell in backend.__closure__ or ()]
    assert not any(isinstance(x, dist.ProcessGroup) for x in held)
    assert single_rank_group.group_name in held
    with pytest.raises(TypeError, match="group must be a ProcessGroup, its name or None, got int"):
        cpcompile.backend(group=3)
    # what dist.new_group gives the ranks outside the group
    outside = r"group is torch.distributed's NON_GROUP_MEMBER: global rank 0 is not in the group passed .*mesh\['cp'\]"
    for call in (
        lambda g: cpcompile.backend(group=g),
        lambda g: cpcompile.cp_attention(*[torch.ones(2, 1, 2)] * 3, torch.tensor([0, 2], dtype=torch.int32), group=g),
    ):
        with pytest.raises(ValueError, match=outside):
            call(dist.GroupMember.NON_GROUP_MEMBER)


def test_compiled_packed_attention_checks_a_constant_scale():
    """A constant ``scale`` is checked while tracing as in eager: a NaN never reaches a compiled kernel."""
    cu, _, q, k, v, _ = attention_case([3, 9, 4])
    torch._dynamo.reset()
    compiled = torch.compile(cpcompile.packed_attention, backend="aot_eager")
    with pytest.raises(ValueError, match="scale must be None .* a finite positive number, got nan"):
        compiled(q, k, v, cu, scale=float("nan"))
    torch._dynamo.reset()

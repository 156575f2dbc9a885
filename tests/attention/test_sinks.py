"""Learnable attention sinks (``sinks=``, GPT-OSS's ``s_aux``) against float64 per-document attention whose
softmax has the sink's column (``tests.reference.attention_fp64``): single-device, then every CP path
on gloo (:func:`check_sinks_on_rank`, run inside the ring tests' spawns: a spawn costs more than the
cases), the sinks' gradient summed over the ranks equal to the single-device one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import cpcompile
from cpcompile.attention import sinks as sink_ops
from tests.fixtures import attention_case, doc_lengths, strategy_specs
from tests.reference import attention_fp64, attention_fp64_on_rank, relative_error

TOLERANCE = 1e-9  # float64 throughout


def _sinks(hq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, generator=g, dtype=torch.float64) * 2


@pytest.mark.parametrize("window", [None, (3, 0), (2, 2)])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_attention_with_sinks_matches_fp64(window, padded):
    cu, cu_p, q, k, v, dout = attention_case(
        [1, 17, 6, 30], 4, 2, padded_lengths=[4, 20, 6, 33] if padded else None, dtype=torch.float64
    )
    sinks = _sinks(4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    mask = {"causal": True} if window is None else {"causal": window[1] == 0, "window_size": window}
    out = cpcompile.packed_attention(*leaves[:3], cu, cu_seqlens_padded=cu_p, sinks=leaves[3], **mask)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref_mask = {"causal": True} if window is None else {"causal": False, "window": window}
    ref = attention_fp64(*ref_leaves[:3], cu, cu_seqlens_padded=cu_p, sinks=ref_leaves[3], **ref_mask)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    assert relative_error(out, ref) < TOLERANCE
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert relative_error(got, want) < TOLERANCE, name
    if padded:  # padding rows: no keys, so zero output and no share of the sinks' gradient
        pad = torch.ones(q.shape[0], dtype=torch.bool)
        pad[cpcompile.batch.physical_positions(cu, cu_p)] = False
        assert out[pad].abs().max() == 0


def test_sinks_in_float32_and_bfloat16_inputs():
    """Sinks of another dtype than q (a bfloat16 model's float32 sinks, or the reverse): the output in q's
    dtype, the gradient in the sinks'."""
    cu, _, q, k, v, dout = attention_case([5, 11], 4, 2)
    for sinks_dtype in (torch.float32, torch.bfloat16):
        sinks = _sinks(4).to(sinks_dtype).requires_grad_()
        out = cpcompile.packed_attention(q, k, v, cu, sinks=sinks)
        (grad,) = torch.autograd.grad(out, [sinks], dout)
        assert out.dtype == q.dtype and grad.dtype == sinks_dtype
        ref_sinks = sinks.detach().double().requires_grad_()
        ref = attention_fp64(q, k, v, cu, causal=True, sinks=ref_sinks)
        (ref_grad,) = torch.autograd.grad(ref, [ref_sinks], dout.double())
        tolerance = 1e-5 if sinks_dtype == torch.float32 else 1e-2
        assert relative_error(out, ref) < tolerance and relative_error(grad, ref_grad) < tolerance


def test_sink_math_at_rows_without_keys():
    """lse = -inf: w = 0, output 0, lse_final = the sink, and no gradient from the row."""
    out = torch.randn(3, 2, 4, dtype=torch.float64)
    out[1] = 0
    lse = torch.randn(2, 3, dtype=torch.float64)
    lse[:, 1] = float("-inf")
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    got, final = sink_ops.apply(out, lse, sinks)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(final[:, 1], sinks)
    w = torch.sigmoid(lse - sinks[:, None])
    assert torch.allclose(got, out * w.t().unsqueeze(-1)) and torch.allclose(
        final, torch.logaddexp(lse, sinks[:, None])
    )
    dout = torch.randn_like(out)
    want = -((1 - w) * (dout * got).sum(-1).t()).sum(1)
    assert torch.allclose(sink_ops.grad(dout, got, final, sinks), want)


def test_opcheck_sinks_grad():
    g = torch.Generator().manual_seed(4)
    dout, out = torch.randn(2, 5, 3, 8, generator=g)
    lse, sinks = torch.randn(3, 5, generator=g) + 1, torch.randn(3, generator=g)
    opcheck(torch.ops.cpcompile.sinks_grad.default, (dout, out, lse, sinks))
    # its fake refuses the shapes the kernel could not read by, as a traced graph would give them
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (dout, out, lse, sinks)]
        for bad, message in (
            ((fake[0][:4], *fake[1:]), "dout .* and out .* must both be"),
            ((fake[0], fake[1], fake[2].t(), fake[3]), r"lse \(5, 3\) must be \[Hq, T\]"),
            ((*fake[:3], fake[3][:2]), "sinks"),
        ):
            with pytest.raises(RuntimeError, match=message):
                torch.ops.cpcompile.sinks_grad(*bad)


def test_opcheck_packed_attention_with_sinks():
    cu, cu_p, q, k, v, _ = attention_case([3, 9, 4], padded_lengths=[4, 10, 6], dtype=torch.float64)
    sinks = _sinks(4).requires_grad_()
    for causal in (True, False):
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu_p, 10, causal, None)
        opcheck(torch.ops.cpcompile.packed_attention.default, args, {"sinks": sinks})


def test_opcheck_cp_ops_with_sinks(single_rank_group):
    """The all-gather, ring and head-parallel ops with sinks (their autograd, fakes and schemas) on one rank."""
    from cpcompile.plan.ring import make_ring_plan

    cu, _, q, k, v, _ = attention_case([3, 9, 4], dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = {"sinks": _sinks(4).requires_grad_()}
    group = single_rank_group.group_name
    plan = cpcompile.plan.make_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    ring = make_ring_plan(cu, cp_size=1, rank=0, strategy="no_load_balance")
    heads = torch.ops.cpcompile.cp_head_plan(cu, None, q.shape[0], 1, "no_load_balance", 1)
    for causal in (True, False):
        pieces = (plan.gather_index, plan.cu_q, plan.k_start, plan.k_len(causal))
        args = (*pieces, group, causal, None, 9, 9, None, "auto", 1)
        opcheck(torch.ops.cpcompile.cp_attention.default, (q, k, v, *args), kw)
        args = (ring.cu_q, ring.k_start, ring.k_len(causal), group, causal, None, 9, 9, None)
        opcheck(torch.ops.cpcompile.cp_ring_attention.default, (q, k, v, *args), kw)
        args = (*heads[:3], heads[3 if causal else 4], group, causal, None, 9, None)
        opcheck(torch.ops.cpcompile.cp_head_attention.default, (q, k, v, *args), kw)


@pytest.mark.parametrize(
    "sinks, error, message",
    [
        (torch.zeros(3), ValueError, r"sinks must have shape \[Hq\] = \[4\].*got \(3,\)"),
        (torch.zeros(1, 4), ValueError, r"sinks must have shape \[Hq\] = \[4\].*got \(1, 4\)"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "sinks must be a floating-point tensor, got dtype torch.int64"),
        ([0.0] * 4, TypeError, "sinks must be a tensor of one logit per query head, got list"),
        (torch.zeros(4, device="meta"), ValueError, "sinks must be on the device of q"),
    ],
)
def test_bad_sinks_are_refused_naming_the_argument(sinks, error, message, single_rank_group):
    cu, _, q, k, v, _ = attention_case([3, 9])
    with pytest.raises(error, match=message):
        cpcompile.packed_attention(q, k, v, cu, sinks=sinks)
    with pytest.raises(error, match=message):
        cpcompile.cp_attention(q, k, v, cu, strategy="no_load_balance", sinks=sinks)


# --- every CP path on gloo ------------------------------------------------------------------------


#: the masks per path: causal, full, a causal window and a two-sided one (the head-parallel paths take no window)
WINDOWS = {
    "all_gather": [None, (-1, -1), (3, 0), (2, 1)],
    "exchange": [None, (2, 1)],
    "ring": [None, (3, 0)],
    "heads": [None, (-1, -1)],
    "hybrid": [None, (-1, -1)],
    "split": [],  # compiled only: backend(overlap_kv=True)'s all-gathers as graph nodes
    "split_exchange": [],  # compiled only: backend(overlap_kv=True)'s exchange as graph nodes (kv="auto")
}


def _paths(world: int) -> list[tuple[str, dict]]:
    """``(name, StrategySpec keywords)`` of every path at this CP size."""
    paths = [
        ("all_gather", {"kv": "all_gather"}),
        ("exchange", {"kv": "exchange"}),
        ("ring", {"kv": "ring"}),
        ("heads", {"kv": "heads", "head_parallel": world}),
        ("split", {"kv": "all_gather"}),
        ("split_exchange", {}),
    ]
    if world == 4:
        paths.append(("hybrid", {"kv": "heads", "head_parallel": 2}))
    return paths


#: per path, the mask its compiled case runs (compiling is the slow part: one case a path, at one CP size)
COMPILED = {
    "all_gather": (3, 0), "exchange": (2, 1), "ring": (3, 0), "heads": None, "hybrid": None, "split": (2, 1),
    "split_exchange": (3, 0),
}  # fmt: skip


def check_sinks_on_rank(rank: int, world: int, compiled_at: int = 4) -> None:
    """Every path and layout, masks causal, full and windowed (the head-parallel paths take no window),
    against float64 with sinks: output, dq, dk, dv at this rank's rows, and the sinks' gradient summed
    over the group equal to the single-device one. At CP size ``compiled_at``, also one case a path
    through ``torch.compile`` with :func:`cpcompile.backend` (the pass carries the sinks into the CP op)."""
    hq, hkv = (6, 2) if world == 3 else (4, 2)
    specs = strategy_specs(stripe_size=2, auto=False)
    case = 0
    for name, spec_kw in _paths(world):
        runs = [(window, False) for window in WINDOWS[name]] + (
            [(COMPILED[name], True)] if world == compiled_at else []
        )
        for window, compiled in runs:
            base = specs[case % len(specs)]
            spec = cpcompile.StrategySpec(base.strategy, base.stripe_size, **spec_kw)
            cu, _, q, k, v, dout = attention_case(doc_lengths(world, case), hq, hkv, 8, seed=case, dtype=torch.float64)
            sinks = _sinks(hq, seed=case)
            tensors = {"q": q, "k": k, "v": v, "dout": dout}
            sharded = cpcompile.shard_batch(tensors, cu, cp_size=world, rank=rank, strategy=spec)
            causal = window is None or (window[1] == 0 and window[0] < 0)
            ref_window = None if window in (None, (-1, -1)) else window
            want = attention_fp64_on_rank(cu, sharded, tensors, causal=causal, window=ref_window, sinks=sinks)
            leaves = [sharded.tensors[n].clone().requires_grad_() for n in "qkv"] + [sinks.clone().requires_grad_()]
            mask = {"causal": causal} if ref_window is None else {"causal": False, "window_size": window}
            if compiled:
                out = _compiled(
                    leaves, cu, sharded, mask, split={"split": "split", "split_exchange": "exchange"}.get(name)
                )
            else:
                out = cpcompile.cp_attention(
                    *leaves[:3], cu, cu_seqlens_padded=sharded.cu_seqlens_padded, strategy=sharded, sinks=leaves[3],
                    **mask,
                )  # fmt: skip
            got = [out, *torch.autograd.grad(out, leaves, sharded.tensors["dout"])]
            dist.all_reduce(got[4])  # each rank's rows' share
            label = f"rank {rank}/{world} {name} {spec} window={window} compiled={compiled}"
            for what, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
                assert relative_error(a, b) < TOLERANCE, f"{what}, {label}"
            case += 1


def _compiled(leaves, cu, sharded, mask: dict, split: str | None) -> torch.Tensor:
    """The single-device call with sinks, compiled with the backend and run in the batch's strategy block;
    the graph must hold no packed_attention left (every call rewritten, the sinks an input of the CP op).
    ``split``: with ``overlap_kv``, and the graph must hold ``cp_attention_split`` (``"split"``) or
    ``cp_attention_exchange`` (``"exchange"``)."""
    from torch._dynamo.backends.registry import lookup_backend

    ops = []

    def inner(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    def model(q, k, v, cu_seqlens, sinks):
        return cpcompile.packed_attention(q, k, v, cu_seqlens, sinks=sinks, **mask)

    torch._dynamo.reset()
    backend = cpcompile.backend(inner=inner, overlap_kv=split is not None)
    fn = torch.compile(model, backend=backend, dynamic=True)
    with cpcompile.strategy(sharded):
        out = fn(*leaves[:3], cu, leaves[3])
    assert "cpcompile.packed_attention.default" not in ops and any("cpcompile.cp_" in op for op in ops), ops
    assert split is None or f"cpcompile.cp_attention_{split}.default" in ops, ops
    return out

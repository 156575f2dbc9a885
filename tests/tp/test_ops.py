"""``ag_gemm`` and ``gemm_rs`` (``cpcompile.tp.ops``, on ``cpcompile.comm.ring``'s buffers).

Opcheck and argument errors on one rank; real gloo ranks (tp = 2 and 3)
against float64 references built from every rank's inputs with plain matmuls, for the ops
and for the compiled sequence-parallel block.

One spawn per world size runs every case: process start-up is the expensive part.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.library import opcheck
from torch.utils.checkpoint import checkpoint

import cpcompile
from cpcompile.comm import ring as ring_comm
from tests.dist import run_ranks
from tests.fixtures import OverlapBackend, all_gather, reduce_scatter, sp_mlp
from tests.reference import relative_error

TOLERANCE = 1e-5
K, N = 8, 6


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(fn, inputs, dout):
    """``fn`` on float32 leaves; returns the output and the gradients of every leaf."""
    leaves = [t.float().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dout.float())


def _assert_close(got, want, label):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and relative_error(g, w) < TOLERANCE, f"{label}: output {i}"


# --- float64 references: every rank's inputs are known on every rank (same seeds) ---------------


def _ag_gemm_case(tp, rank, shape, bias, seed):
    """Inputs and float64 reference of ``all_gather(x) @ w.T + b`` on ``rank``: output and grads."""
    xs = [_randn(*shape, K, seed=seed + r).requires_grad_() for r in range(tp)]
    ws = [_randn(N, K, seed=seed + 10 + r).requires_grad_() for r in range(tp)]
    bs = [_randn(N, seed=seed + 20 + r).requires_grad_() for r in range(tp)]
    douts = [_randn(tp * shape[0], *shape[1:], N, seed=seed + 30 + r) for r in range(tp)]
    gathered = torch.cat(xs)
    outs = [gathered @ ws[r].T + (bs[r] if bias else 0) for r in range(tp)]
    leaves = [xs[rank], ws[rank]] + ([bs[rank]] if bias else [])
    grads = torch.autograd.grad(sum((o * d).sum() for o, d in zip(outs, douts, strict=True)), leaves)
    return [t.detach() for t in leaves], douts[rank], outs[rank].detach(), grads


def _gemm_rs_case(tp, rank, shape, seed):
    """Inputs and float64 reference of ``reduce_scatter(x @ w.T)`` on ``rank``: output and grads."""
    xs = [_randn(tp * shape[0], *shape[1:], K, seed=seed + r).requires_grad_() for r in range(tp)]
    ws = [_randn(N, K, seed=seed + 10 + r).requires_grad_() for r in range(tp)]
    douts = [_randn(*shape, N, seed=seed + 30 + r) for r in range(tp)]
    outs = sum(x @ w.T for x, w in zip(xs, ws, strict=True)).chunk(tp)
    grads = torch.autograd.grad(sum((o * d).sum() for o, d in zip(outs, douts, strict=True)), [xs[rank], ws[rank]])
    return [xs[rank].detach(), ws[rank].detach()], douts[rank], outs[rank].detach(), grads


def _check_ops(tp, rank, group, *, capacity, seed):
    """Both ops, 2-D and 3-D tokens, bias or not, t varying per call."""
    for i, t in enumerate((3, 1, 5)):
        for shape, bias in (((t,), True), ((t,), False), ((t, 2), False)):
            inputs, dout, ref, ref_grads = _ag_gemm_case(tp, rank, shape, bias, seed + 100 * i)
            fn = (
                (lambda x, w, b: cpcompile.tp.ag_gemm(x, w, bias=b, group=group, capacity_tokens=capacity))
                if bias
                else (lambda x, w: cpcompile.tp.ag_gemm(x, w, group=group, capacity_tokens=capacity))
            )
            out, grads = _run(fn, inputs, dout)
            _assert_close([out, *grads], [ref, *ref_grads], f"ag_gemm tp={tp} rank={rank} x={shape} bias={bias}")
        for shape in ((t,), (t, 2)):
            inputs, dout, ref, ref_grads = _gemm_rs_case(tp, rank, shape, seed + 100 * i)
            out, grads = _run(
                lambda x, w: cpcompile.tp.gemm_rs(x, w, group=group, capacity_tokens=capacity), inputs, dout
            )
            _assert_close([out, *grads], [ref, *ref_grads], f"gemm_rs tp={tp} rank={rank} x={shape}")


def _sp_mlp_reference(tp, t, seed):
    """The whole (unsharded) MLP in float64 and each rank's shards, output and gradients."""
    hidden, ffn = K, 3 * tp
    x, w1, b1, w2 = (
        _randn(*s, seed=seed + i).requires_grad_()
        for i, s in enumerate(((tp * t, hidden), (ffn, hidden), (ffn,), (hidden, ffn)))
    )
    b2s = [_randn(hidden, seed=seed + 5).requires_grad_() for _ in range(tp)]  # replicated: one leaf per rank
    douts = _randn(tp * t, hidden, seed=seed + 6).chunk(tp)
    y = (F.gelu(x @ w1.T + b1) @ w2.T).chunk(tp)
    loss = sum(((yr + b2) * d).sum() for yr, b2, d in zip(y, b2s, douts, strict=True))
    grads = torch.autograd.grad(loss, [x, w1, b1, w2, *b2s])
    shard = lambda r, a, b, c, d, e: [a.chunk(tp)[r], b.chunk(tp)[r], c.chunk(tp)[r], d.chunk(tp, dim=1)[r], e]  # noqa: E731
    inputs = [shard(r, x.detach(), w1.detach(), b1.detach(), w2.detach(), b2s[r].detach()) for r in range(tp)]
    ref_grads = [shard(r, *grads[:4], grads[4 + r]) for r in range(tp)]
    return inputs, douts, [(yr + b2).detach() for yr, b2 in zip(y, b2s, strict=True)], ref_grads


def _check_compiled_block(tp, rank, group, *, capacity, seed):
    backend = OverlapBackend(capacity_tokens=capacity)
    step = torch.compile(sp_mlp, backend=backend, fullgraph=True)
    for i, t in enumerate((4, 2, 7, 5)):
        inputs, douts, refs, ref_grads = _sp_mlp_reference(tp, t, seed + 10 * i)
        leaves = [a.float().requires_grad_() for a in inputs[rank]]
        if i == 0:
            torch._dynamo.mark_dynamic(leaves[0], 0)
        out = step(*leaves, group.group_name)  # a ProcessGroup argument would outlive destroy_process_group (README)
        grads = torch.autograd.grad(out, leaves, douts[rank].float())
        _assert_close([out, *grads], [refs[rank], *ref_grads[rank]], f"compiled sp_mlp tp={tp} rank={rank} t={t}")
        if i == 0:
            allocations = ring_comm.BUFFERS.allocations
    assert backend.rewrites == [2], f"one compilation, both matmuls rewritten: {backend.rewrites}"
    assert ring_comm.BUFFERS.allocations == allocations, "a call within capacity reallocated a buffer"


def _matmuls(x, w1, b1, w2, group):
    """:func:`sp_mlp`'s two matmuls' results (its bias ``b2`` would promote them back to float32 under autocast)."""
    h = F.linear(all_gather(x, 0, group), w1, b1)
    return h, reduce_scatter(F.gelu(h) @ w2.T, "sum", 0, group)


def _checkpointed_sp_mlp(x, w1, b1, w2, b2, group):
    return checkpoint(sp_mlp, x, w1, b1, w2, b2, group, use_reentrant=False)


def _check_compiled_variants(tp, rank, group, *, seed):
    """The block checkpointed (Dynamo puts it in a body of its own, which the pass rewrites too), under
    autocast (the ops get the dtype autocast gives the matmuls), and ``gemm_rs`` given its group by name
    in a full graph."""
    backend = OverlapBackend(capacity_tokens=8)
    inputs, douts, refs, ref_grads = _sp_mlp_reference(tp, 4, seed)
    leaves = [a.float().requires_grad_() for a in inputs[rank]]
    out = torch.compile(_checkpointed_sp_mlp, backend=backend, fullgraph=True)(*leaves, group.group_name)
    grads = torch.autograd.grad(out, leaves, douts[rank].float())
    _assert_close([out, *grads], [refs[rank], *ref_grads[rank]], f"checkpointed sp_mlp tp={tp} rank={rank}")
    assert backend.rewrites == [2], f"the checkpointed body's matmuls rewritten: {backend.rewrites}"

    torch._dynamo.reset()
    backend = OverlapBackend(capacity_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(_matmuls, backend=backend, fullgraph=True)(*leaves[:4], group.group_name)
        want = _matmuls(*leaves[:4], group.group_name)  # eager: both matmuls in bfloat16
    assert backend.rewrites == [2] and [t.dtype for t in got] == [torch.bfloat16] * 2, (backend.rewrites, got)
    for g, w in zip(got, want, strict=True):  # bfloat16 products, summed in another order by the reduce-scatter
        assert relative_error(g, w) < 1e-2, f"autocast tp={tp} rank={rank}: {relative_error(g, w)}"

    torch._dynamo.reset()
    inputs, dout, ref, ref_grads = _gemm_rs_case(tp, rank, (3,), seed)
    step = torch.compile(
        lambda x, w: cpcompile.tp.gemm_rs(x, w, group=group.group_name), backend="aot_eager", fullgraph=True
    )
    out, grads = _run(step, inputs, dout)
    _assert_close([out, *grads], [ref, *ref_grads], f"compiled gemm_rs(group=name) tp={tp} rank={rank}")
    torch._dynamo.reset()


def _check_errors(tp, rank, group):
    x, w = torch.randn(2 + rank, K), torch.randn(N, K)
    listed = "; ".join(f"rank {r}: {2 + r}" for r in range(tp))
    with pytest.raises(ValueError, match=f"disagree on token count \\(rows per TP rank\\) \\({listed}\\)"):
        cpcompile.tp.ag_gemm(x, w, group=group)
    with pytest.raises(ValueError, match=f"disagree on token count \\(rows per TP rank\\) \\({listed}\\)"):
        cpcompile.tp.gemm_rs(torch.randn(tp * (2 + rank), K), w, group=group)
    # Rows of other widths or dtypes: garbage with the same bytes per row, else an aborted transport.
    x = torch.randn(2, K + rank)
    widths = "; ".join(f"rank {r}: {K + r}" for r in range(tp))
    with pytest.raises(ValueError, match=f"disagree on row width \\({widths}\\)"):
        cpcompile.tp.ag_gemm(x, torch.randn(N, K + rank), group=group)
    dtype = torch.float64 if rank else torch.float32
    with pytest.raises(ValueError, match="disagree on dtype \\(rank 0: 'torch.float32'; rank"):
        cpcompile.tp.gemm_rs(torch.randn(tp * 2, K, dtype=dtype), torch.randn(N, K, dtype=dtype), group=group)
    # Only the last rank is over capacity: it says so, the others are told, none hangs.
    x = torch.randn(8 + (rank == tp - 1), K)
    over = "9 tokens per rank exceed capacity_tokens=8"
    message = over if rank == tp - 1 else f"rank {tp - 1} rejected its arguments .*{over}"
    with pytest.raises(ValueError, match=message):
        cpcompile.tp.ag_gemm(x, w, group=group, capacity_tokens=8)
    with pytest.raises(ValueError, match=f"x.shape\\[0\\] = {tp + 1} must be a multiple of the group size {tp}"):
        cpcompile.tp.gemm_rs(torch.randn(tp + 1, K), w, group=group)
    # The same rows in other shapes come back in other shapes; ranks in different ops exchange rows that
    # fit (K = N here) yet mean something else.
    shape = (2, 3, K) if rank % 2 == 0 else (3, 2, K)
    listed = rf"ranks? 0(, 2)?: \(2, 3, {K}\); rank 1: \(3, 2, {K}\)"
    with pytest.raises(ValueError, match=rf"disagree on input shape \({listed}\); this is rank {rank}"):
        cpcompile.tp.ag_gemm(torch.randn(*shape), w, group=group)
    square = torch.randn(K, K)
    with pytest.raises(ValueError, match="disagree on op \\(rank 0: 'ag_gemm'; rank"):
        if rank == 0:
            cpcompile.tp.ag_gemm(torch.randn(2, K), square, group=group)
        else:
            cpcompile.tp.gemm_rs(torch.randn(2 * tp, K), square, group=group)


def _check_rank(rank: int, tp: int) -> None:
    group = dist.group.WORLD
    ring_comm.BUFFERS.clear()
    _check_ops(tp, rank, group, capacity=16, seed=0)
    allocations = ring_comm.BUFFERS.allocations
    _check_ops(tp, rank, group, capacity=16, seed=7)  # t within capacity: the same buffers
    assert ring_comm.BUFFERS.allocations == allocations, (allocations, ring_comm.BUFFERS.allocations)
    # Without capacity the buffer grows to a power of two: t = 3 -> 4 rows, t = 5 -> 8 rows.
    ring_comm.BUFFERS.clear()
    counts = []
    for t in (3, 4, 5, 8, 2):
        cpcompile.tp.ag_gemm(torch.randn(t, K), torch.randn(N, K), group=group)
        counts.append(ring_comm.BUFFERS.allocations - allocations)
    assert counts == [1, 1, 2, 2, 2], counts
    _check_ops(tp, rank, group, capacity=None, seed=3)
    _check_compiled_block(tp, rank, group, capacity=8, seed=11)
    _check_compiled_variants(tp, rank, group, seed=17)
    _check_errors(tp, rank, group)
    if tp == 3:  # a subgroup: group ranks differ from global ranks, the group travels by name
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            _check_ops(2, rank - 1, sub, capacity=10, seed=5)
            _check_compiled_block(2, rank - 1, sub, capacity=8, seed=13)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 3])
def test_ops_and_compiled_block_match_fp64_on_gloo(tp):
    run_ranks(_check_rank, tp)


# --- one rank, in process ---------------------------------------------------------------------


def test_opcheck(single_rank_group):
    name = single_rank_group.group_name
    x, x3, w, b = (torch.randn(*s, requires_grad=True) for s in ((5, K), (5, 2, K), (N, K), (N,)))
    dy, dy3 = torch.randn(5, N), torch.randn(5, 2, N)
    # transposed views, as the pass hands over a [K, N] weight (W.T) and as callers may pass x
    xt, wt = torch.randn(K, 5).t(), torch.randn(K, N).t()
    ops = torch.ops.cpcompile
    for op, args in [
        (ops.ag_gemm, (x, w, b, name, 8, "p2p")),
        (ops.ag_gemm, (x3, w, None, name, None, "symm_mem")),
        (ops.gemm_rs, (x, w, name, 8, "p2p")),
        (ops.gemm_rs, (x3, w, name, None, "symm_mem")),
        (ops.ag_gemm_backward, (dy, x.detach(), w.detach(), name, 8, "p2p")),
        (ops.gemm_rs_backward, (dy3, x3.detach(), w.detach(), name, None, "symm_mem")),
        (ops.ag_gemm, (xt, wt, None, name, 8, "p2p")),
        (ops.gemm_rs, (xt, wt, name, None, "p2p")),
        (ops.ag_gemm_backward, (dy, xt, wt, name, 8, "p2p")),  # the fake kernels' strides: the ops'
        (ops.gemm_rs_backward, (dy, xt, wt, name, None, "p2p")),
    ]:
        opcheck(op.default, args)


def test_one_rank_is_a_plain_matmul(single_rank_group):
    inputs, dout, ref, ref_grads = _ag_gemm_case(1, 0, (4, 3), True, seed=0)
    out, grads = _run(lambda x, w, b: cpcompile.tp.ag_gemm(x, w, bias=b, capacity_tokens=12), inputs, dout)
    _assert_close([out, *grads], [ref, *ref_grads], "ag_gemm tp=1")
    inputs, dout, ref, ref_grads = _gemm_rs_case(1, 0, (4, 3), seed=0)
    out, grads = _run(lambda x, w: cpcompile.tp.gemm_rs(x, w, capacity_tokens=12), inputs, dout)
    _assert_close([out, *grads], [ref, *ref_grads], "gemm_rs tp=1")


@pytest.mark.parametrize(
    "args, error, message",
    [
        ({"x": [[1.0]]}, TypeError, "x must be a torch.Tensor, got list"),
        ({"x": torch.ones(4, K, dtype=torch.int64)}, ValueError, "x must be a floating-point tensor, got torch.int64"),
        ({"x": torch.ones(K)}, ValueError, r"x must be \[tokens, ..., K\] \(at least 2-D, K >= 1\), got shape \(8,\)"),
        ({"x": torch.ones(4, 0), "w": torch.ones(N, 0)}, ValueError, r"\(at least 2-D, K >= 1\), got shape \(4, 0\)"),
        ({"w": torch.ones(N, K + 1)}, ValueError, r"w must be \[N, K\] with K = x.shape\[-1\] = 8, got shape \(6, 9\)"),
        ({"w": torch.ones(N, K, dtype=torch.float64)}, ValueError, "w must match x's dtype and device"),
        ({"bias": torch.ones(N + 1)}, ValueError, r"bias must be \[N\] = \[6\], got shape \(7,\)"),
        ({"bias": 1.0}, TypeError, "bias must be a torch.Tensor or None, got float"),
        ({"capacity_tokens": 0}, ValueError, "capacity_tokens must be None or an int >= 1, got 0"),
        ({"capacity_tokens": True}, ValueError, "capacity_tokens must be None or an int >= 1, got True"),
        (
            {"capacity_tokens": 3},
            ValueError,
            r"4 tokens per rank exceed capacity_tokens=3.*backend's tp_capacity_tokens",
        ),
        ({"group": 0}, TypeError, "group must be a ProcessGroup, its name or None, got int"),
    ],
)
def test_rejects_bad_arguments(single_rank_group, args, error, message):
    args = {"x": torch.ones(4, K), "w": torch.ones(N, K), "bias": None, "capacity_tokens": None, "group": None, **args}
    with pytest.raises(error, match=message):
        cpcompile.tp.ag_gemm(
            args["x"], args["w"], bias=args["bias"], capacity_tokens=args["capacity_tokens"], group=args["group"]
        )
    if args["bias"] is None:
        with pytest.raises(error, match=message):
            cpcompile.tp.gemm_rs(args["x"], args["w"], capacity_tokens=args["capacity_tokens"], group=args["group"])

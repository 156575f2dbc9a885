"""Attention under inductor on q, k, v of any layout (issue 57 item 15).

Inductor checks that every custom op returns the strides its fake reported. The fakes said
``empty_like(q)`` (head-major for a head-major q) while the kernels return contiguous outputs, so
``packed_attention(q.transpose(0, 1), k, v, cu)`` with ``q`` a contiguous ``[H, T, D]`` tensor (what
partial-rotary models produce after transformers' transpose) failed under inductor: ``expected size
12==12, stride 64==16 at dim=0``. The ops now return contiguous outputs and gradients whatever their
inputs' layouts, and their fakes say so. Each case compiles one function holding one attention call
per layout, forward and backward, and compares it with the same function run eagerly.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import cpcompile
from tests.dist import run_ranks
from tests.fixtures import cu_seqlens

T, HQ, HKV, D = 24, 4, 2, 8
LENGTHS = [5, 11, 1, 7]


def _layouts(t: torch.Tensor) -> dict[str, tuple]:
    """``t`` ``[T, H, D]`` in several layouts: name -> ``(base, view)``, ``view(base)`` holding ``t``'s values."""
    n, h, d = t.shape
    head_major = t.transpose(0, 1).contiguous()  # [H, T, D]
    wide = torch.zeros(n, h, 2 * d)
    wide[..., :d] = t  # head_dim a slice of a wider buffer (partial rotary)
    strided = torch.zeros(n, h, 2 * d)
    strided[..., ::2] = t  # every other element: a last dim of stride 2
    fused = torch.zeros(n, 3 * h, d)
    fused[:, h : 2 * h] = t  # heads a slice of a fused qkv projection
    return {
        "contiguous": (t.clone(), lambda b: b),
        "head-major": (head_major, lambda b: b.transpose(0, 1)),
        "sliced": (wide, lambda b: b[..., :d]),
        "strided": (strided, lambda b: b[..., ::2]),
        "fused": (fused, lambda b: b[:, h : 2 * h]),
    }


#: (q, k, v) layouts: each layout for q and for k/v at least once, head-major everywhere
CASES = [
    ("head-major", "contiguous", "contiguous"),
    ("contiguous", "head-major", "head-major"),
    ("head-major", "head-major", "head-major"),
    ("sliced", "fused", "strided"),
    ("fused", "sliced", "head-major"),
    ("strided", "contiguous", "fused"),
]
#: under CP, compiled (the other paths are checked eagerly, op by op against their fakes)
CP_CASES = [CASES[0], ("sliced", "head-major", "fused")]


def _inputs(q, k, v, cases=CASES):
    """Per case, the leaves (bases) and the views giving q, k, v of them in the case's layouts."""
    layouts = [_layouts(t) for t in (q, k, v)]
    leaves, views = [], []
    for case in cases:
        picked = [layouts[i][name] for i, name in enumerate(case)]
        leaves.append([base.clone().requires_grad_() for base, _ in picked])
        views.append([view for _, view in picked])
    return leaves, views


def _compare(compiled, eager, label: str) -> None:
    for kind, got_all, want_all in zip(("out", "grad"), compiled, eager):
        for i, (got, want) in enumerate(zip(got_all, want_all)):
            assert got.shape == want.shape, f"{label} {kind} {i}"
            assert torch.equal(got, want), f"{label} {kind} {i}: max diff {(got - want).abs().max()}"


def test_packed_attention_any_layout_under_inductor():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(T, h, D, generator=g) for h in (HQ, HKV, HKV, HQ))
    cu = cu_seqlens(LENGTHS)
    leaves, views = _inputs(q, k, v)

    def run(*flat_leaves):
        it = iter(flat_leaves)
        per_case = [[next(it) for _ in range(3)] for _ in CASES]
        outs = []
        for lv, vw in zip(per_case, views):
            q, k, v = (view(leaf) for view, leaf in zip(vw, lv))
            outs.append(cpcompile.packed_attention(q, k, v, cu, causal=True))
        return outs

    flat = [leaf for lv in leaves for leaf in lv]
    with inductor_config.patch(force_disable_caches=True):  # a cached graph would keep an older fake's strides
        torch._dynamo.reset()
        compiled_run = torch.compile(run, backend="inductor", fullgraph=True)
        outs = compiled_run(*flat)
        grads = torch.autograd.grad(outs, flat, [dout] * len(outs))
    want_outs = run(*flat)
    want_grads = torch.autograd.grad(want_outs, flat, [dout] * len(want_outs))
    assert len(outs) == len(CASES) and len(grads) == len(flat)  # every layout compared, none skipped
    _compare((outs, grads), (want_outs, want_grads), "packed_attention")


class _Calls(TorchDispatchMode):
    """Records every cpcompile op call below autograd: ``(op, args, kwargs, outputs)``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "cpcompile":
            self.calls.append((func, args, kwargs or {}, out))
        return out


def _fake(mode: FakeTensorMode, x):
    return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x


def _check_fakes(calls, label: str) -> int:
    """Each recorded op's outputs have the shapes, strides and dtypes its fake reports for the same
    inputs (what inductor asserts); returns how many outputs were compared."""
    compared = 0
    for func, args, kwargs, real in calls:
        mode = FakeTensorMode()
        fake_args, fake_kwargs = (tree_map(functools.partial(_fake, mode), a) for a in (args, kwargs))
        with mode:
            fake = func(*fake_args, **fake_kwargs)
        for i, (r, f) in enumerate(zip(tree_leaves(real), tree_leaves(fake), strict=True)):
            if isinstance(r, torch.Tensor):
                got, want = (r.shape, r.stride(), r.dtype), (f.shape, f.stride(), f.dtype)
                assert got == want, f"{label} {func} output {i}: real {got}, fake {want}"
                compared += 1
    return compared


def _cp_any_layout(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(1)
    cu = cu_seqlens(LENGTHS)
    full = {name: torch.randn(T, h, D, generator=g) for name, h in (("q", HQ), ("k", HKV), ("v", HKV), ("dout", HQ))}
    # eager, every CP attention op in both directions: what each returns is what its fake says
    dual = cpcompile.Strategy.DUAL_CHUNK_SWAP
    paths = [
        cpcompile.StrategySpec(dual, kv="all_gather"),
        cpcompile.StrategySpec(dual, kv="exchange"),
        cpcompile.StrategySpec(dual, kv="ring"),
        cpcompile.StrategySpec(dual, kv="heads", head_parallel=world),
    ]
    for spec in paths:
        batch = cpcompile.shard_batch(full, cu, cp_size=world, rank=rank, strategy=spec)
        leaves, views = _inputs(batch.tensors["q"], batch.tensors["k"], batch.tensors["v"])
        calls = _Calls()
        with calls:
            for lv, vw in zip(leaves, views):
                qkv = (view(leaf) for view, leaf in zip(vw, lv))
                out = cpcompile.cp_attention(*qkv, batch.cu_seqlens, strategy=batch)
                torch.autograd.grad(out, lv, batch.tensors["dout"])
        label = f"rank {rank} {spec}"
        assert _check_fakes(calls.calls, label) == 5 * len(CASES), label  # (out, lse) and (dq, dk, dv) per case

    # compiled with inductor through the backend: head-major and sliced inputs, forward and backward
    spec = cpcompile.StrategySpec(dual)
    batch = cpcompile.shard_batch(full, cu, cp_size=world, rank=rank, strategy=spec)
    local = batch.tensors
    leaves, views = _inputs(local["q"], local["k"], local["v"], CP_CASES)
    flat = [leaf for lv in leaves for leaf in lv]

    def run(*flat_leaves, cu):
        it = iter(flat_leaves)
        outs = []
        for vw in views:
            q, k, v = (view(next(it)) for view in vw)
            outs.append(cpcompile.packed_attention(q, k, v, cu, causal=True))
        return outs

    with cpcompile.strategy(batch), inductor_config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        backend = cpcompile.backend(inner="inductor")
        outs = torch.compile(run, backend=backend, dynamic=True, fullgraph=True)(*flat, cu=batch.cu_seqlens)
        grads = torch.autograd.grad(outs, flat, [local["dout"]] * len(outs))
        # eager: cp_attention, which the backend's pass makes of packed_attention
        want = [
            cpcompile.cp_attention(*(view(leaf) for view, leaf in zip(vw, lv)), batch.cu_seqlens, strategy=batch)
            for lv, vw in zip(leaves, views)
        ]
    want_grads = torch.autograd.grad(want, flat, [local["dout"]] * len(want))
    _compare((outs, grads), (want, want_grads), f"rank {rank} {spec}")
    torch._dynamo.reset()


@pytest.mark.distributed
def test_cp_attention_any_layout():
    run_ranks(_cp_any_layout, 2)

"""``cp_attention_captured``: CP attention that a CUDA graph captures with the rest of the step.

``cp_attention`` and its backward derive host-side data from the plan's values (kernel launch
bounds, scratch sizes, the exchange's counts, which kept dK/dV rows to zero) and so stay out of
CUDA graphs (``common.NOT_CAPTURED``): a capture would replay the pack it was recorded on. This op
pair computes the same attention with every size fixed by the shapes and a bucket's bounds, and
every value read on the device, so that a compiled step on packs padded to a capacity
(``StrategySpec.capacity``) is one CUDA graph forward and one backward, replayed for every pack
of the bucket (docs/cuda-graphs.md). What it gives up for that:

- K/V come by the all-gather (the sparse exchange's counts follow the pack);
- the kernel is FlashAttention-4's (``reference`` off CUDA), whose varlen calls take their pieces
  on the device: its backward runs one call per layer of pieces in place (``kernels.varlen``),
  ``layers`` being the strategy's bound (:data:`LAYERS`), or the pack's own count where a
  :class:`cpcompile.CapturedStep` keeps a graph per count (``plan.slots.layers_in_capture``), and
  writes every dK/dV row into new buffers of the capture rather than the read rows into kept ones;
- no window (a window's keys come from ``window_keys``, not captured yet), no head parallelism.

Nothing derived from the plan is cached across captures (``cache.uncached``): each capture derives
its own on the device, and cudagraph trees' first call of a part, run in the graphs' memory pool
without a capture, may leave nothing alive there. Within the one capture of a whole step that a
:class:`cpcompile.CapturedStep` makes, the first layer's derivations serve the others
(``cache.within_capture``), as a step's plan derivations do outside a graph. The plan op (``cp_plan``) stays outside the
capture, on the host, once per step: the compiler places it at the start of the graph
(``compiler.shard_attention``), so that the rest of the forward is one captured part, and its device
tensors are the capture's inputs, copied in at each replay.
The ranks' agreement (``comm.groups.agree``, where enabled) runs in calls outside a capture (the
first, eager, step), not in the capture.
"""

from __future__ import annotations

import torch

from cpcompile import kernels
from cpcompile.attention import gathered
from cpcompile.attention.common import (
    check_fake_gather,
    check_fake_qkv,
    dense,
    dense_grads,
    out_and_lse,
    register_attention_autograd,
    softmax_scale,
)
from cpcompile.cache import uncached
from cpcompile.comm.groups import resolve_group
from cpcompile.plan.slots import layers_in_capture
from cpcompile.plan.window import UNBANDED
from cpcompile.spec import Strategy, StrategySpec

#: The most live pieces of a rank that read one key, per strategy: a rank holds at most two runs of
#: a document under dual_chunk_swap (chunks r and 2cp-1-r) and balanced (a head and a tail range), one
#: under no_load_balance; every piece of a document reads its first key (causal and full).
#: ``tests/attention/test_captured.py`` checks the bounds on random packs. Striped has as many as a document has
#: stripes on a rank: not captured.
LAYERS = {Strategy.NO_LOAD_BALANCE: 1, Strategy.DUAL_CHUNK_SWAP: 2, Strategy.BALANCED: 2}

#: Kernels a captured call runs: FA4 (``None`` and ``auto`` pick it) on CUDA, ``reference`` elsewhere.
CAPTURED_KERNELS = (None, "auto", "fa4", "reference")


def capturable(
    spec: StrategySpec, q: torch.Tensor, kernel_name: str | None, window, v: torch.Tensor | None = None
) -> str | None:
    """Why a call on ``q`` and ``v`` (fake tensors will do; ``v`` for its value head dim, default q's) under
    ``spec`` cannot be a captured op, or ``None`` where it can."""
    if spec.kv not in ("auto", "all_gather"):
        return f"kv={spec.kv!r} (captured: the all-gather, kv 'auto' or 'all_gather')"
    if spec.strategy not in LAYERS:
        return f"strategy {spec.strategy.value!r} (captured: {', '.join(s.value for s in LAYERS)})"
    if window not in UNBANDED:
        return f"window_size={window} (captured: causal or full attention)"
    if kernel_name not in CAPTURED_KERNELS:
        return f"kernel {kernel_name!r} (captured: FlashAttention-4)"
    if q.is_cuda:
        from cpcompile.kernels import fa4

        if kernel_name == "reference" or not fa4.supports(q, v):
            dims = f"head dim {q.shape[-1]}" + ("" if v is None else f", value head dim {v.shape[-1]}")
            return f"kernel {kernel_name!r} on {q.dtype} {dims} (captured: FlashAttention-4, installed)"
    elif kernel_name not in (None, "reference"):
        return f"kernel {kernel_name!r} on {q.device} (captured off CUDA: reference)"
    return None


def _kernel(q: torch.Tensor, kernel_name: str | None, v: torch.Tensor):
    if q.is_cuda:
        from cpcompile.kernels import fa4

        if kernel_name in (None, "auto", "fa4") and fa4.supports(q, v):
            return fa4
        raise ValueError(
            f"captured CP attention runs FlashAttention-4 on CUDA (pip install 'cpcompile[fa4]'), got kernel "
            f"{kernel_name!r} for {q.dtype} head dim {q.shape[-1]}, value head dim {v.shape[-1]}, FA4 installed: "
            f"{fa4.available()}"
        )
    return kernels.select(q, kernel_name, v=v)


def _call(q, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name):
    """What both directions run with: the group, the kernel, the pieces and the kernel keywords."""
    group = resolve_group(group_name)
    kern = _kernel(q, kernel_name, v)  # before any communication
    pieces = kernels.Pieces(cu_q, k_start, k_len, max_q=max_seqlen_q, max_k=max_seqlen)
    kw = {"causal": causal, "scale": softmax_scale(q, scale), "window": (-1, 0) if causal else (-1, -1)}
    return group, kern, pieces, kw


@torch.library.custom_op("cpcompile::cp_attention_captured", mutates_args=())
def _cp_attention_captured(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gather_index: torch.Tensor,
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
    max_seqlen: int | None,
    max_seqlen_q: int | None,
    kernel_name: str | None,
    kv_chunks: int,
    layers: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = (gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name)
    group, kern, pieces, kw = _call(q, v, *plan)
    with uncached():
        return dense(*gathered.forward(kern, q, k, v, gather_index, pieces, group, kv_chunks, **kw))


@_cp_attention_captured.register_fake
def _(q, k, v, gather_index, cu_q, k_start, k_len, group_name, *rest):
    check_fake_qkv(q, k, v)
    check_fake_gather(q, gather_index, resolve_group(group_name).size())
    return out_and_lse(q, v)


@torch.library.custom_op("cpcompile::cp_attention_captured_backward", mutates_args=())
def _cp_attention_captured_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    gather_index: torch.Tensor,
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
    max_seqlen: int | None,
    max_seqlen_q: int | None,
    kernel_name: str | None,
    kv_chunks: int,
    layers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = (gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name)
    group, kern, pieces, kw = _call(q, v, *plan)
    grads = (dout, q, k, v, out, lse, gather_index, pieces, group, kv_chunks)
    with uncached():
        return dense(*gathered.backward(kern, *grads, layers=layers_in_capture(layers), **kw))


@_cp_attention_captured_backward.register_fake
def _(dout, q, k, v, *rest):
    return dense_grads(q, k, v)


# plan: gather_index, cu_q, k_start, k_len
register_attention_autograd(_cp_attention_captured, torch.ops.cpcompile.cp_attention_captured_backward, num_plan=4)

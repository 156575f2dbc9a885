"""Learnable attention sinks (GPT-OSS; ``s_aux`` in transformers): a logit ``sinks[h]`` per query head
that joins each query's softmax denominator as a key of no value.

For one query row of head ``h`` with scores ``s_j`` over its keys, ``Z = sum_j exp(s_j)`` and
``lse = log Z`` (what every attention path computes, the ring after its merge):

    p_j = exp(s_j) / (Z + exp(sinks[h])),   out_final = sum_j p_j v_j = out * w,
    w = Z / (Z + exp(sinks[h])) = sigmoid(lse - sinks[h]),   lse_final = logaddexp(lse, sinks[h]).

So the sink applies after the attention, exactly, from its ``(out, lse)`` (:func:`apply`): once per
row, after the ring's merged ``lse``, never per block. A row with no keys (``lse = -inf``) gets
``w = 0``: output 0, and ``lse_final = sinks[h]``. Where each row comes from one kernel call (the
all-gather, the exchange, one device), the kernel takes the sinks (``AttentionKernel.forward(sinks=)``):
FA4 joins them in its softmax, with no pass over the output; the other kernels apply them after it.

Backward. With ``p_j = exp(s_j - lse_final)`` and the sink's probability ``1 - w = exp(sinks[h] -
lse_final)``, the softmax gradient over the keys and the sink column (whose value is 0) is

    dS_j = p_j (dO . v_j - D'),   D' = dO . out_final,
    d sinks[h] = -sum over rows of (1 - w) D'                                     (:func:`grad`).

That is the ordinary FlashAttention backward run with ``out_final`` and ``lse_final``: it recomputes
``p_j = exp(s_j - lse)`` from the ``lse`` it gets and takes ``D = rowsum(dO * out)`` from the ``out``
it gets. So each op applies the sink at the end of its forward and returns ``(out_final, lse_final)``;
its autograd (``common.register_attention_autograd``) saves those for the op's backward, unchanged,
and adds :func:`grad`. (A post-hoc multiply outside the op would need the op's backward to take an
``lse`` gradient, which the kernels' interface has no place for.)

Under CP each rank's :func:`grad` sums its own query rows (under head parallelism, its heads' rows):
the sink's gradient is the sum of the ranks' gradients, as for every other parameter of a CP model,
whose gradients the trainer sums over the CP group (with the data-parallel group). The op does not
all-reduce it: summed again, it would be counted ``cp`` times.
"""

from __future__ import annotations

import torch

from cpcompile.checks import check_device
from cpcompile.kernels.sinks import apply
from cpcompile.kernels.triton import sink_grad

__all__ = ["apply", "check_fake_sinks", "check_sinks", "grad", "head_slice"]


def check_sinks(sinks: object, q: torch.Tensor, what: str = "sinks") -> None:
    """``sinks``: ``None`` or a floating ``[Hq]`` tensor on q's device, ``Hq = q.shape[1]``: the query
    heads of this call (a model split over heads by tensor parallelism passes its own heads' sinks)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{what} must be a tensor of one logit per query head, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"{what} must have shape [Hq] = [{q.shape[1]}] (one logit per query head of q {tuple(q.shape)}), "
            f"got {tuple(sinks.shape)}"
        )
    check_device(q, **{what: sinks})


def check_fake_sinks(q: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """An op's fake: ``sinks`` ``None`` or ``[Hq]``."""
    if sinks is not None:
        torch._check(
            sinks.dim() == 1 and sinks.shape[0] == q.shape[1],
            lambda: f"sinks {tuple(sinks.shape)} must be [Hq] for q {tuple(q.shape)}",
        )


@torch.library.custom_op("cpcompile::sinks_grad", mutates_args=())
def _grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    return sink_grad.grad(dout, out, lse, sinks)


@_grad.register_fake
def _(dout, out, lse, sinks):
    # the shapes the kernel reads by (its grid and strides come from out): a traced graph that gave it
    # others fails here, not in the kernel
    torch._check(
        dout.shape == out.shape and out.dim() == 3,
        lambda: f"sinks_grad: dout {tuple(dout.shape)} and out {tuple(out.shape)} must both be [T, Hq, Dv]",
    )
    torch._check(
        lse.dim() == 2 and lse.shape[0] == out.shape[1] and lse.shape[1] == out.shape[0],
        lambda: f"sinks_grad: lse {tuple(lse.shape)} must be [Hq, T] for out {tuple(out.shape)}",
    )
    check_fake_sinks(out, sinks)
    return sinks.new_empty(sinks.shape)


def grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sinks [Hq]`` (sinks' dtype) of this call's rows: ``dout``, and ``out``, ``lse`` as :func:`apply`
    returned them (``lse_final``). One pass over ``dout`` and ``out`` on CUDA (``kernels.triton.sink_grad``),
    in an op: the autograd functions that call it are traced under torch.compile."""
    return _grad(dout, out, lse, sinks)


def head_slice(sinks: torch.Tensor | None, index: int, parts: int) -> torch.Tensor | None:
    """The sinks of part ``index`` of ``parts`` equal, consecutive parts of the heads (what a rank
    keeps of ``[T, Hq, D]`` after the head all-to-all: ``comm.heads.heads_to_tokens``)."""
    if sinks is None:
        return None
    return sinks.unflatten(0, (parts, -1))[index]

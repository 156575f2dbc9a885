"""A causal LM's summed cross-entropy straight from hidden states, without whole-pack logits.

The usual loss materialises ``[T, V]`` logits, upcasts them to float32 and keeps them
for the backward: at 131,072 tokens and a 32,000-token vocabulary that is tens of
GiB, more than several decoder layers' activations, which decides whether a
long-context model fits on one GPU at all (docs/end-to-end.md). :func:`linear_cross_entropy`
computes the loss and its gradients chunk by chunk in the forward (as Liger's fused
linear cross-entropy does) and keeps only ``dL/dhidden`` and ``dL/dweight``: the same
FLOPs as the usual loss, no recomputation, transient memory of one chunk's logits.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        total = hidden.new_zeros((), dtype=acc)
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            logits = (h @ weight.T).to(acc)  # [c, V]
            keep = t != IGNORE_INDEX
            rows = torch.arange(t.shape[0], device=t.device)
            target = t.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            total += torch.where(keep, lse - logits[rows, target], 0).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[rows, target] -= 1
            grad = grad.mul_(keep[:, None]).to(hidden.dtype)  # d(sum of losses)/d(logits)
            d_hidden[start : start + chunk] = grad @ weight
            d_weight += (grad.T @ h).to(acc)
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        d_hidden, d_weight = ctx.saved_tensors
        return d_hidden * grad_total.to(d_hidden.dtype), (d_weight * grad_total).to(ctx.weight_dtype), None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk: int = 8192
) -> torch.Tensor:
    """``sum over t of cross_entropy(hidden[t] @ weight.T, targets[t])``, rows whose target is -100 left out.

    Args:
        hidden: ``[T, H]`` (float32 or lower: the loss sums in float32, float64 for float64).
        weight: ``[V, H]``, the output projection (``lm_head.weight``), ``hidden``'s dtype.
        targets: ``[T]`` int64 next-token ids, ``-100`` for rows without one.
        chunk: rows whose logits exist at a time (``[chunk, V]`` in float32).

    Returns:
        The summed loss, a 0-d tensor; divide by the labelled tokens for the mean.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        shapes = f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        raise ValueError(f"hidden [T, H] and weight [V, H] expected, got {shapes}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk)


class LinearCrossEntropy(torch.nn.Linear):
    """``nn.Linear`` (no bias) whose forward, given ``targets``, returns :func:`linear_cross_entropy`
    of its input rather than logits: ``x [T, H]``, ``targets [T]`` -> the summed loss, a 0-d tensor.

    The loss then runs inside the module's forward, where FSDP2 (``fully_shard`` of this module)
    has gathered the weight and from where its gradient is reduce-scattered; the function on
    ``lm_head.weight`` outside a forward would read a shard. Without ``targets`` it is the
    plain linear layer. Make one of a model's output projection with :func:`fuse_loss`.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, *, chunk: int = 8192) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, chunk=chunk)


def fuse_loss(linear: torch.nn.Linear) -> LinearCrossEntropy:
    """``linear`` made a :class:`LinearCrossEntropy` in place: the same parameters, state-dict keys
    and outputs without targets. Before ``fully_shard``, which subclasses the module's class."""
    if type(linear) is not torch.nn.Linear or linear.bias is not None:
        raise ValueError(
            f"fuse_loss takes a plain torch.nn.Linear without bias (before fully_shard), got {type(linear).__name__}"
        )
    linear.__class__ = LinearCrossEntropy
    return linear

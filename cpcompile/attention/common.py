"""What the attention ops share: fake-tensor checks, output allocation, the softmax
scale, the accumulation dtype, the agreement an op runs where no wrapper ran one (forward)
and before its backward's collectives, the naming of a collective's failure, and the autograd
that ties each op to its backward op."""

from __future__ import annotations

import functools
import inspect

import torch

from cpcompile.attention.sinks import grad as sinks_grad
from cpcompile.cache import NOT_CAPTURED  # noqa: F401  (the ops' tags, imported from here)
from cpcompile.checks import agreement_enabled
from cpcompile.comm.groups import (
    agree,
    collective_failure,
    failed_inside,
    raised_on_every_rank,
    resolve_group,
)


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def check_fake_qkv(q, k, v) -> None:
    """An attention op's fake: q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]`` (a rank's tokens, or a
    pack's)."""
    torch._check(
        q.dim() == 3 and k.dim() == 3 and v.dim() == 3, lambda: f"q, k, v must be [T, H, D], got {q.shape}, {k.shape}"
    )
    torch._check(k.shape[:2] == v.shape[:2], lambda: f"k {k.shape} and v {v.shape} differ in tokens or heads")
    torch._check(k.shape[0] == q.shape[0], lambda: f"q {q.shape} and k {k.shape} differ in tokens")
    torch._check(q.shape[2] == k.shape[2], lambda: f"head_dim of q {q.shape} and k {k.shape} differ")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")


def check_fake_gather(q, gather_index, cp_size) -> None:
    """A gathering op's fake: its plan's ``gather_index`` covers the ``cp_size`` ranks' tokens."""
    torch._check(
        gather_index.shape[0] == q.shape[0] * cp_size,
        lambda: f"plan covers {gather_index.shape[0]} tokens, q holds {q.shape[0]} x cp {cp_size}",
    )


def check_fake_tokens(num_tokens, cp_size: int, spec) -> None:
    """A plan op's fake: state the divisibility its layout relies on as a ``torch._check`` (a
    run-time assert where the shape environment cannot prove it)."""
    from cpcompile.layouts.partition import padding_multiple

    multiple, _ = padding_multiple(spec, cp_size)
    torch._check(
        num_tokens % multiple == 0,
        lambda: f"{spec.strategy.value} with cp_size={cp_size} needs a token count that is a multiple of {multiple}",
    )


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What sums and ``lse`` are kept in: float32, or float64 for float64 inputs (so that float64
    runs are exact to float64, not to the float32 of a statistic)."""
    return torch.promote_types(dtype, torch.float32)


def out_and_lse(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fake's ``(out [T, Hq, Dv], lse [Hq, T])`` (``Dv``: ``v``'s head dim): ``out`` contiguous, as
    :func:`dense` makes the real one."""
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=accumulation_dtype(q.dtype))
    return q.new_empty((*q.shape[:2], v.shape[2])), lse


def dense_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A backward fake's ``(dq, dk, dv)``: contiguous, in q's, k's and v's shapes and dtypes."""
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def dense(*outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An op's outputs contiguous, as its fake says (:func:`out_and_lse`, :func:`dense_grads`), whatever
    the layout of q, k, v (a head-major q, say) and whatever the kernel made of it; a no-op for
    contiguous outputs. Inductor lays out what follows by the fake's strides, so they must agree."""
    return tuple(t.contiguous() for t in outputs)


def communicates(op: str, phase: str | None = "forward"):
    """Decorates the implementation of an op that runs collectives over its ``group_name`` argument;
    ``op`` names it in messages (``"cp_attention (all_gather)"``), ``phase`` is ``"forward"``,
    ``"backward"`` or ``None`` (an op used both ways: ``head_all_to_all``).

    The first backward op of a backward pass (an autograd graph task) first runs an agreement
    (``comm.groups.agree``, where ``checks.agreement_enabled``, alike on every rank: gloo always,
    elsewhere only with ``CPCOMPILE_VALIDATE=1``, so a compiled step on NCCL gains no host sync): a
    rank that skipped the backward, or started the next step's forward, meets the others there and
    every rank raises, rather than waiting in mismatched collectives. The forward's agreement is the
    step's entry's, once per step: ``cp_attention``'s, or in a compiled step the plan op's, which
    compares what every call it feeds does (``attention.plan_op.agree_on_plan``).

    An error of a collective inside the op (the group's timeout: no other rank came; a closed
    connection: another rank's process ended) is raised again naming the op, the step, the rank
    and the timeout (``comm.groups.collective_failure``). Any other error raised on one rank inside
    the op, once its collectives may have begun (a kernel's), leaves the others in them: it gets a
    note saying so, and the rank tells the others at its next agreement on the group.
    """
    step = op if phase is None else f"{phase} of {op}"

    def decorate(fn):
        params = list(inspect.signature(fn).parameters)
        at = {name: params.index(name) if name in params else None for name in ("group_name", "q")}

        def argument(name: str, args, kwargs):
            i = at[name]
            return args[i] if i is not None and i < len(args) else kwargs.get(name)

        @functools.wraps(fn)  # custom_op reads the schema from fn's signature (followed through __wrapped__)
        def run(*args, **kwargs):
            # the group: ``group_name``, or in ops that take the rest as ``*call``, their first str argument
            name = argument("group_name", args, kwargs) or next(a for a in args if isinstance(a, str))
            group = resolve_group(name)
            if phase == "backward" and agreement_enabled(group, argument("q", args, kwargs)):
                agree_once_per_backward(group, step)
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if raised_on_every_rank(e):
                    raise
                if _from_collective(e):
                    raise collective_failure(e, group, step) from e
                failed_inside(group, step)
                _note(e, f"cpcompile: raised on rank {group.rank()} inside the {step}; ranks that went on wait in its "
                      "collectives until the process group's timeout, then raise (docs/failures.md)")  # fmt: skip
                raise

        return run

    return decorate


_backward_agreed: dict[str, int] = {}  # group name -> the autograd graph task whose ranks agreed


def agree_once_per_backward(group, step: str) -> None:
    """:func:`agree` at the first backward op of a backward pass on ``group``; the pass's later ops
    (its other layers) run where the ranks already met."""
    task = torch._C._current_graph_task_id()
    if task == -1 or _backward_agreed.get(group.group_name) != task:
        agree(group, None, {}, where=step)
        _backward_agreed[group.group_name] = task


def _from_collective(error: Exception) -> bool:
    """Whether ``error`` is a collective's failure: torch's ``DistError`` kinds (NCCL's among them), or
    the ``RuntimeError`` gloo raises (its message names a gloo source file or a pair's closure)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("/gloo/" in text or "caused pair closure" in text)


def _note(error: Exception, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)


def register_attention_autograd(op, backward_op, num_plan: int) -> None:
    """Autograd for an attention op ``op(q, k, v, *plan, *args) -> (out, lse)`` whose backward is
    the op ``backward_op(dout, q, k, v, out, lse, *plan, *args) -> (dq, dk, dv)``.

    ``plan``: the ``num_plan`` tensor inputs after ``q, k, v`` (``None`` allowed), saved with
    them and ``out, lse``; ``args``: the other inputs, kept as they are. ``lse`` is not
    differentiable, and nothing but ``q, k, v`` gets a gradient, and ``sinks`` where the op takes
    them (an input of that name, not passed to ``backward_op``): the op returns the sink's
    ``(out_final, lse_final)``, which are what ``backward_op`` needs (``attention.sinks``), and
    their gradient is ``attention.sinks.grad``.
    """
    names = [a.name for a in op._opoverload._schema.arguments]
    at = names.index("sinks") if "sinks" in names else None

    def setup_context(ctx, inputs, output):
        inputs = list(inputs)
        sinks = inputs.pop(at) if at is not None else None
        q, k, v, *rest = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *rest[:num_plan], sinks)
        ctx.args = tuple(rest[num_plan:])
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv = backward_op(dout, *saved, *ctx.args)
        grads = [dq, dk, dv, *(None,) * (num_plan + len(ctx.args))]
        if at is not None:
            _, _, _, out, lse, *_ = saved
            need = sinks is not None and ctx.needs_input_grad[at]
            grads.insert(at, sinks_grad(dout, out, lse, sinks) if need else None)
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup_context)

"""Argument checks shared by the layouts, the data loader side and the ops.

Every check raises before any communication or autograd and names the argument,
the value and what is accepted. Shape and dtype checks always run. Checks that read
tensor data run on CPU tensors; on CUDA they would force a host sync on every
call, so there they run only when ``CPCOMPILE_VALIDATE=1`` (a debug switch), and
never on fake tensors while tracing.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch._subclasses.fake_tensor import is_fake

from cpcompile.config import VALIDATE


def data_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks may read the values of ``t`` (no tracing, no forced host sync)."""
    if torch.compiler.is_compiling() or is_fake(t) or t.device.type == "meta":
        return False
    return t.device.type == "cpu" or VALIDATE


def agreement_enabled(group, q: object) -> bool:
    """Whether ranks compare their arguments before an op's collectives (``comm.groups.agree``).

    Decided alike on every rank, from the group and the mode, never from one rank's
    arguments (a rank that skipped the comparison would leave the others waiting in it):
    on gloo always, on other backends only with ``CPCOMPILE_VALIDATE=1`` (on CUDA it
    costs a host sync); never while tracing or on the fake process group.
    """
    if torch.compiler.is_compiling() or (isinstance(q, torch.Tensor) and is_fake(q)):
        return False
    return group_agrees(group)


def group_agrees(group) -> bool:
    """:func:`agreement_enabled` as the group and the mode decide it, for code that runs outside any
    op (the backend, while it compiles a graph: ``torch.compiler.is_compiling()`` holds there, yet
    nothing is being traced)."""
    import torch.distributed as dist

    if group.size() == 1:
        return False
    backend = dist.get_backend(group)
    return backend != "fake" and (backend == "gloo" or VALIDATE)


def rows_are_real(group) -> bool:
    """Whether attention over ``group`` runs on real rows, so that it must know whose they are
    (``batch.check_rows``): a group of more than one rank, not the fake process group (tracing and
    per-rank timing, whose collectives return garbage)."""
    import torch.distributed as dist

    return group.size() > 1 and dist.get_backend(group) != "fake"


def check_device(q: torch.Tensor, **metadata: torch.Tensor | None) -> None:
    """Metadata tensors (``cu_seqlens`` and the like) must live on ``q``'s device: kernels read
    them there, and one on another device would be read as garbage, not copied."""
    for name, t in metadata.items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")


def check_has_values(what: str, **metadata: torch.Tensor | None) -> None:
    """Metadata tensors that ``what`` plans from must hold values: a tensor on the ``meta`` device has
    none to read (fake tensors, while tracing, are planned by the plan ops' fakes instead)."""
    meta = [name for name, t in metadata.items() if isinstance(t, torch.Tensor) and t.is_meta and not is_fake(t)]
    if meta:
        raise ValueError(
            f"{' and '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device, which holds no values: "
            f"{what} reads the offsets to plan which keys each rank reads. Pass them with their values, on q's "
            "device (to trace shapes without data, use torch.compile or FakeTensorMode)"
        )


def check_int(name: str, value: object, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_cp(cp_size: object, rank: object | None = None, *, rank_given: bool = False) -> None:
    """``cp_size`` an int >= 1 and ``rank`` an int in ``[0, cp_size)``; ``None``: no rank, unless
    ``rank_given`` (the caller's parameter is one that must be set)."""
    check_int("cp_size", cp_size, minimum=1)
    if (rank is not None or rank_given) and (
        not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < cp_size
    ):
        raise ValueError(f"rank must be an int in [0, {cp_size}), got {rank!r}")


def check_cu_seqlens(name: str, cu: object) -> None:
    """``cu``: ``[B + 1]`` int32 (:func:`check_offsets_type`), starting at 0, non-decreasing, with at least
    one token (values read where no host sync: the module's note)."""
    check_offsets_type(name, cu)
    if not data_checks_enabled(cu):
        return
    _check_offset_values(name, cu)


def check_offsets_type(name: str, cu: object) -> None:
    """``cu``: a ``[B + 1]`` int32 tensor (what its type, dtype and shape say; no values read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries ([B + 1]), got shape {tuple(cu.shape)}")


def _check_offset_values(name: str, cu: torch.Tensor) -> None:
    if int(cu[0]) != 0:
        raise ValueError(
            f"{name} must start at 0, got {int(cu[0])} (under CP: the whole pack's offsets, not offsets made from "
            "one rank's rows)"
        )
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths), got {cu.tolist()}")
    if int(cu[-1]) <= 0:
        raise ValueError(f"{name} must describe at least one token, got {cu.tolist()}")


def check_offsets(cu_seqlens: object, cu_seqlens_padded: object | None = None) -> None:
    """A pack's offsets, checked once at a public entry (what runs below it takes them as checked):
    ``cu_seqlens`` (:func:`check_cu_seqlens`) and, where given, ``cu_seqlens_padded`` too, of the same
    documents, each at least as long (:func:`check_padding`)."""
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    if cu_seqlens_padded is not None:
        check_cu_seqlens("cu_seqlens_padded", cu_seqlens_padded)
        check_padding(cu_seqlens, cu_seqlens_padded)


def check_padding(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> None:
    """``cu_seqlens_padded`` must describe the same documents as ``cu_seqlens``, each at least as long
    (both already checked as offsets)."""
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"cu_seqlens_padded must have the shape of cu_seqlens {tuple(cu_seqlens.shape)}, "
            f"got {tuple(cu_seqlens_padded.shape)}"
        )
    if not (data_checks_enabled(cu_seqlens) and data_checks_enabled(cu_seqlens_padded)):
        return
    real = cu_seqlens[1:] - cu_seqlens[:-1]
    padded = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
    if bool((padded < real).any()):
        raise ValueError(
            "cu_seqlens_padded gives a document fewer tokens than cu_seqlens: "
            f"padded lengths {padded.tolist()}, real lengths {real.tolist()}"
        )


def check_pack_tokens(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, *, given: bool, num_tokens, cp_size: int, spec
) -> None:
    """Under CP the offsets describe the whole pack, which the ranks' rows are shares of: the padded
    pack must hold ``num_tokens`` (local tokens x ``cp_size``) rows. ``cu_seqlens_padded``: the caller's
    (``given``) or ``pad_for_cp``'s of ``cu_seqlens`` for ``spec``; named only where the caller gave
    it. Reads values (see the module's note)."""
    if not isinstance(num_tokens, int) or not data_checks_enabled(cu_seqlens_padded):
        return
    capacity = getattr(spec, "capacity", None)
    if capacity is not None and num_tokens != capacity.tokens:
        return  # another capacity's batch: layouts.partition.check_layout_values names the capacity
    total = int(cu_seqlens_padded[-1])
    if total == num_tokens:
        return
    from cpcompile.spec import layout_name

    local = num_tokens // cp_size
    held = f"the {cp_size} ranks hold {num_tokens} rows ({local} local tokens in q x cp_size {cp_size})"
    if given:
        what = f"cu_seqlens_padded[-1] = {total}, but {held}: cu_seqlens and cu_seqlens_padded"
        source = "ShardedBatch.cu_seqlens and .cu_seqlens_padded"
    else:
        padding = "" if total == int(cu_seqlens[-1]) else f", {total} once padded for {layout_name(spec)}"
        what = f"cu_seqlens describes {int(cu_seqlens[-1])} tokens{padding}, but {held}: cu_seqlens"
        source = "ShardedBatch.cu_seqlens"
    raise ValueError(
        f"{what} must describe the whole (global) pack, which this rank's tokens are a share of ({source} "
        "from cpcompile.shard_batch), not offsets made from this rank's own rows (its position_ids, say)"
    )


def check_scale_and_bound(scale: object, max_seqlen: object) -> None:
    """``scale``: ``None`` or a finite positive number; ``max_seqlen``: ``None`` or an int of at least 1
    (a launch bound: it is never read as a tensor)."""
    if torch.compiler.is_compiling():
        # While tracing, inspecting them would specialise or break the graph: the ops check ``scale`` again
        # when they run (``attention.api``), so a NaN never reaches a compiled kernel.
        return
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0
    ):
        raise ValueError(f"scale must be None (head_dim ** -0.5) or a finite positive number, got {scale!r}")
    if max_seqlen is not None and (
        isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 1
    ):
        raise ValueError(f"max_seqlen must be None or an int of at least 1 (the longest document), got {max_seqlen!r}")


def check_softcap(softcap: object) -> float:
    """``softcap``: ``None`` or 0 (none) or a finite positive number (Gemma 2's logit soft-capping);
    returned as a float, 0.0 for none."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (torch.SymFloat, torch.SymInt)):
        return softcap  # symbolic while tracing: the ops' schemas type it (a constant is checked as in eager)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(
            f"softcap must be None or 0 (no soft-capping) or a finite positive number (scores become "
            f"softcap * tanh(score / softcap)), got {softcap!r}"
        )
    return float(softcap)


def check_longest(cu_seqlens: torch.Tensor, max_seqlen: int | None) -> None:
    """``max_seqlen`` must bound the documents of ``cu_seqlens``: GPU kernels size their grids by it
    and would leave longer documents' last rows uncomputed. Reads values (see the module's note)."""
    if max_seqlen is None or not data_checks_enabled(cu_seqlens):  # nothing traced while compiling
        return
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest document ({longest} tokens)")


def check_qkv(q: object, k: object, v: object) -> None:
    """q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]`` with ``Hq % Hkv == 0`` (``Dv``, the value
    head dim, may differ from ``D``: multi-head latent attention's 192/128)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if torch.compiler.is_compiling():
        return  # shapes are symbolic here: the ops' fake implementations check them
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must agree in tokens and heads (dims 0 and 1; their head dims may differ), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in tokens (dim 0) and head_dim (dim 2)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1] == 0 or t.shape[2] == 0:
            raise ValueError(f"{name} must have at least one head and a head_dim of at least 1, got {tuple(t.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) for grouped-query attention"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device}"
        )

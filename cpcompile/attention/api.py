"""Attention ops: ``packed_attention`` (one device) and ``cp_attention`` (CP-sharded).

Both run the same piece kernel (``kernels``) over an :class:`AttentionPlan`:
single-device attention is the plan of one rank that holds everything.
``cp_attention`` brings each rank the K/V rows its pieces read, runs one kernel call over
its pieces, and in backward fetches K/V again (autograd saves nothing of size ``T``),
keeps dQ local and returns the float32 dK/dV sums to their owners. Per plan, the rows
go by a sparse all-to-all of only those rows (``exchange``) where ranks read few of
the others' keys, else by an all-gather and reduce-scatter (``gathered``).

Each op: ``custom_op`` -> ``register_fake`` -> ``register_autograd``, whose backward
is again a custom op. Groups travel by name.
"""

from __future__ import annotations

import torch

from cpcompile import kernels
from cpcompile.attention import exchange, gathered, heads, hybrid  # noqa: F401  (heads registers cpcompile::cp_head_attention)
from cpcompile.attention.common import (
    NOT_CAPTURED,
    check_fake_gather,
    check_fake_qkv,
    communicates,
    dense,
    dense_grads,
    out_and_lse,
    register_attention_autograd,
    softmax_scale,
)
from cpcompile.attention.sinks import check_fake_sinks, check_sinks
from cpcompile.batch import check_rows
from cpcompile.cache import on_host, per_plan, twin
from cpcompile.checks import (
    agreement_enabled,
    check_device,
    check_has_values,
    check_longest,
    check_offsets,
    check_offsets_type,
    check_qkv,
    check_scale_and_bound,
    check_softcap,
    data_checks_enabled,
    rows_are_real,
)
from cpcompile.comm.groups import agree_on, digest, resolve_group
from cpcompile.config import DEFAULTS, KERNELS, check_choice
from cpcompile.plan.exchange import exchange_plan
from cpcompile.plan.pieces import AttentionPlan, max_piece_len, plan_extras, plan_of, spec_step_plan, step_plan
from cpcompile.plan.ring import RingPlan, block_key_ranges, ring_plan_of, ring_window_plan
from cpcompile.plan.window import UNBANDED, beyond_gpu, is_causal, resolve_window, window_keys
from cpcompile.spec import (
    Strategy,
    StrategyLike,
    check_head_parallel,
    current_rows,
    layout_in_force,
    layout_name,
)


@per_plan
def _single_device_plan(cu_seqlens, cu_seqlens_padded, num_tokens: int) -> AttentionPlan:
    # once per plan: the kernels' own metadata is keyed on these plan tensors, so
    # every layer reusing them reuses it too
    if cu_seqlens_padded is None:
        # No padding: the documents are the pieces, one kernel sequence each, keys
        # consecutive (what kernels' ``disjoint_keys`` means). No all-gather: no index.
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        index = cu_seqlens.new_empty(0, dtype=torch.int64)
        return AttentionPlan(index, cu_seqlens, cu_seqlens[:-1], lengths, lengths, cu_seqlens, cu_seqlens)
    return plan_of(
        cu_seqlens, cu_seqlens_padded, cp_size=1, rank=0, strategy=Strategy.NO_LOAD_BALANCE, num_tokens=num_tokens
    )


def _single_device_pieces(q, cu_seqlens, cu_seqlens_padded, max_seqlen, window) -> kernels.Pieces:
    """The kernel's pieces for single-device attention: the documents, or the padded plan's."""
    plan = _single_device_plan(cu_seqlens, cu_seqlens_padded, q.shape[0])
    k_start, k_len, q_pos = window_keys(*plan.pieces, window)
    whole = cu_seqlens_padded is None  # each piece a whole document, reading its own rows
    bounds = {"max_q": max_seqlen, "max_k": max_seqlen, "disjoint_keys": whole}
    return kernels.Pieces(plan.cu_q, k_start, k_len, q_pos=None if whole or is_causal(window) else q_pos, **bounds)


def op_window(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """The window of an attention op's ``(causal, window_left, window_right)``: a window's right side
    is 0 when causal (``(-1, 0)`` is causal, ``(-1, -1)`` full attention)."""
    return window_left, 0 if causal else window_right


def kernel_keywords(q, scale, window, softcap: float = 0.0) -> dict:
    """What an attention op passes its kernel (``kernels.contract``) by name."""
    return {"causal": is_causal(window), "scale": softmax_scale(q, scale), "window": window, "softcap": softcap}


def op_extras(sinks=None, softcap: float = 0.0) -> dict:
    """An op's ``sinks`` and ``softcap`` keywords, each only where it is on: off, the op's default applies,
    so a call without them is one op call (one graph node), however the caller said off (``None``, 0)."""
    return ({} if sinks is None else {"sinks": sinks}) | ({"softcap": softcap} if softcap else {})


# --- packed_attention --------------------------------------------------------------


@torch.library.custom_op("cpcompile::packed_attention", mutates_args=(), tags=NOT_CAPTURED)
def _packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_seqlen: int | None,
    causal: bool,
    scale: float | None,
    kernel_name: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = op_window(causal, window_left, window_right)
    # the offsets' values (and the scale) are checked here, where both an eager call and a compiled graph
    # (a CP group of one, say, on a batch that shard_batch padded to a capacity) run; the backward op gets
    # the same
    check_scale_and_bound(scale, None)
    _check_pack_of(q, cu_seqlens, cu_seqlens_padded, max_seqlen)
    pieces = _single_device_pieces(q, cu_seqlens, cu_seqlens_padded, max_seqlen, window)
    band = beyond_gpu(window, whole_documents=cu_seqlens_padded is None)
    kern = kernels.select(q, kernel_name, band=band, v=v, softcap=softcap)
    return dense(*kern.forward(q, k, v, pieces, sinks=sinks, **kernel_keywords(q, scale, window, softcap)))


@_packed_attention.register_fake
def _(
    q,
    k,
    v,
    cu_seqlens,
    cu_seqlens_padded,
    max_seqlen,
    causal,
    scale,
    kernel_name=None,
    window_left=-1,
    window_right=-1,
    sinks=None,
    softcap=0.0,
):
    check_fake_qkv(q, k, v)
    check_device(q, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, sinks=sinks)
    check_fake_sinks(q, sinks)
    return out_and_lse(q, v)


@torch.library.custom_op("cpcompile::packed_attention_backward", mutates_args=(), tags=NOT_CAPTURED)
def _packed_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_seqlen: int | None,
    causal: bool,
    scale: float | None,
    kernel_name: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = op_window(causal, window_left, window_right)
    pieces = _single_device_pieces(q, cu_seqlens, cu_seqlens_padded, max_seqlen, window)
    band = beyond_gpu(window, whole_documents=cu_seqlens_padded is None)
    kern = kernels.select(q, kernel_name, band=band, v=v, softcap=softcap)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, pieces, **kernel_keywords(q, scale, window, softcap))
    return dense(dq, dk.to(k.dtype), dv.to(v.dtype))


@_packed_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens_padded, max_seqlen, causal, scale, kernel_name=None,
      window_left=-1, window_right=-1, softcap=0.0):  # fmt: skip
    return dense_grads(q, k, v)


# plan: cu_seqlens, cu_seqlens_padded
register_attention_autograd(_packed_attention, torch.ops.cpcompile.packed_attention_backward, num_plan=2)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Single-device attention over packed documents (THD).

    Args:
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]``; v: ``[T, Hkv, Dv]`` with ``Hq % Hkv == 0`` (GQA); ``Dv``
            may differ from ``D`` (multi-head latent attention: 192/128).
        cu_seqlens: ``[B + 1]`` int32 cumulative real document lengths.
        cu_seqlens_padded: ``[B + 1]`` int32 physical offsets when documents carry
            padding at their ends (default: none, ``T = cu_seqlens[-1]``).
        max_seqlen: longest document, a launch bound for GPU kernels (optional).
        causal: causal within each document. scale: default ``D ** -0.5``.
        window_size: ``(left, right)``, ``varlen_attn``'s sliding window (``cpcompile.plan.window``): query
            ``i`` sees its document's keys ``j`` with ``i - left <= j <= i + right`` (-1: unbounded);
            ``None``: from ``causal``. With ``causal=True`` its right side must be 0.
        sinks: ``[Hq]`` learnable sink logits (GPT-OSS), one per query head, each joining its head's
            softmax denominators as a key of no value (``cpcompile.attention.sinks``); differentiable.
        softcap: ``c > 0``: each scaled score ``s`` becomes ``c * tanh(s / c)`` before the softmax
            (Gemma 2's logit soft-capping); ``None`` or 0: none.
        kernel: one of :data:`cpcompile.config.KERNELS` (``StrategySpec.kernel``'s; this call has no strategy);
            ``None``: the default the environment seeded (``cpcompile.config.DEFAULTS``), else chosen by
            what is installed.
    Returns:
        ``[T, Hq, Dv]``; padding rows are 0 and padding keys are never attended.
    """
    window = resolve_window(causal, window_size)
    check_qkv(q, k, v)
    check_sinks(sinks, q)
    check_scale_and_bound(scale, max_seqlen)
    softcap = check_softcap(softcap)
    check_offsets_type("cu_seqlens", cu_seqlens)
    if cu_seqlens_padded is not None:
        check_offsets_type("cu_seqlens_padded", cu_seqlens_padded)
    check_device(q, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
    # the offsets' values: by the op (_check_pack_of), which a compiled graph calls too
    kernel = DEFAULTS.kernel if kernel is None else check_choice("kernel", kernel, KERNELS)
    args = (q, k, v, cu_seqlens, cu_seqlens_padded, max_seqlen, is_causal(window), scale, kernel)
    window_args = () if window in UNBANDED else window
    extras = op_extras(sinks, softcap)
    return torch.ops.cpcompile.packed_attention(*args, *window_args, **extras)[0]


def _check_not_sharded(q: torch.Tensor) -> None:
    """Raise where ``q`` holds one rank's share of a CP batch: single-device attention over it would attend
    within the rank's share alone. The batch: the strategy block's (entered with it, else the last
    ``shard_batch`` made in it); a share is its rank's row count (a block's batch may sit beside a
    single-device reference over the whole pack). This op runs only
    where nothing made it context-parallel: a model whose attention is ``packed_attention`` (or
    ``attn_implementation="cpcompile"``) not compiled with :func:`cpcompile.backend`."""
    rows, _ = current_rows()
    if rows is not None and rows.cp_size > 1 and q.shape[0] == rows.local_rows:
        whole = int(rows.pack[-1]) == q.shape[0]  # the share's rows are as many as the pack's tokens
        raise ValueError(
            f"packed_attention ran single-device on q of {q.shape[0]} rows, rank {rows.rank}'s share of a batch "
            f"sharded for cp_size={rows.cp_size}: it would attend within this rank's rows alone. Compile the "
            "model with torch.compile(model, backend=cpcompile.backend(group=cp_group), dynamic=True), which "
            "makes its attention context-parallel, or call cpcompile.cp_attention"
            + (" (if q is the whole pack, run it outside the strategy block)" if whole else "")
        )


def _check_pack_of(q: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded, max_seqlen) -> None:
    """The single-device call's checks of its offsets' values, once: the offsets themselves, every row
    of ``q`` covered (by ``cu_seqlens``, or by ``cu_seqlens_padded`` where given), ``max_seqlen`` a
    bound, and ``q`` not one rank's share of a CP batch."""
    check_offsets(cu_seqlens, cu_seqlens_padded)
    _check_not_sharded(q)
    if cu_seqlens_padded is None:
        _check_token_count("cu_seqlens", cu_seqlens, q.shape[0])
    else:
        _check_token_count("cu_seqlens_padded", cu_seqlens_padded, q.shape[0])
    check_longest(cu_seqlens, max_seqlen)


def _check_token_count(name: str, cu: torch.Tensor, expected: int) -> None:
    if isinstance(expected, int) and data_checks_enabled(cu) and int(cu[-1]) != expected:
        padded = " (rows padded for CP, as shard_batch pads them: pass cu_seqlens_padded too)"
        # fewer rows than the pack: most likely one rank's shard in single-device attention
        shard = (
            " (one CP rank's rows? packed_attention runs single-device unless the model is compiled with "
            "cpcompile.backend(group=...); eager CP attention is cpcompile.cp_attention)"
        )
        hint = padded if name == "cu_seqlens" and int(cu[-1]) < expected else shard if int(cu[-1]) > expected else ""
        raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the number of tokens in q ({expected})" + hint)


# --- cp_attention ------------------------------------------------------------------


def _cp_call(q, v, plan: tuple, group_name, scale, kernel_name, kv_exchange, window, softcap):
    """What both directions of ``cp_attention`` run with: the group, the kernel, the plan's
    :class:`~cpcompile.plan.exchange.Exchange` (``None``: all-gather) and the kernel keywords;
    ``plan``: ``(gather_index, k_start, k_len, cu_seqlens, cu_seqlens_padded)``, the last two the pack's
    offsets the plan carries (``None`` where the op was not given them)."""
    check_scale_and_bound(scale, None)  # a compiled graph's constant scale, unchecked while tracing
    group = resolve_group(group_name)
    kern = kernels.select(q, kernel_name, band=beyond_gpu(window), v=v, softcap=softcap)  # before any communication
    ex = exchange_plan(*plan, window, group_name, kv_exchange)  # StrategySpec.exchange
    return group, kern, ex, kernel_keywords(q, scale, window, softcap)


@torch.library.custom_op("cpcompile::cp_attention", mutates_args=(), tags=NOT_CAPTURED)
@communicates("cp_attention (all_gather)")
def _cp_attention(
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
    kv_exchange: str,
    kv_chunks: int,
    q_pos: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = op_window(causal, window_left, window_right)
    plan = (gather_index, k_start, k_len, cu_seqlens, cu_seqlens_padded)  # the exchange's: the pack, this rank's keys
    group, kern, ex, kw = _cp_call(q, v, plan, group_name, scale, kernel_name, kv_exchange, window, softcap)
    pieces = kernels.Pieces(cu_q, k_start, k_len, max_q=max_seqlen_q, max_k=max_seqlen, q_pos=q_pos)
    if ex is not None:
        return dense(*exchange.forward(kern, q, k, v, ex, pieces, group, sinks=sinks, **kw))
    return dense(*gathered.forward(kern, q, k, v, gather_index, pieces, group, kv_chunks, sinks=sinks, **kw))


@_cp_attention.register_fake
def _(q, k, v, gather_index, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name,
      kv_exchange, kv_chunks, q_pos=None, window_left=-1, window_right=-1, cu_seqlens=None, cu_seqlens_padded=None,
      sinks=None, softcap=0.0):  # fmt: skip
    check_fake_qkv(q, k, v)
    check_device(q, gather_index=gather_index, cu_q=cu_q, k_start=k_start, k_len=k_len, q_pos=q_pos)
    check_device(q, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, sinks=sinks)
    check_fake_sinks(q, sinks)
    check_fake_gather(q, gather_index, resolve_group(group_name).size())
    return out_and_lse(q, v)


@torch.library.custom_op("cpcompile::cp_attention_backward", mutates_args=(), tags=NOT_CAPTURED)
@communicates("cp_attention (all_gather)", "backward")
def _cp_attention_backward(
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
    kv_exchange: str,
    kv_chunks: int,
    q_pos: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = op_window(causal, window_left, window_right)
    plan = (gather_index, k_start, k_len, cu_seqlens, cu_seqlens_padded)
    group, kern, ex, kw = _cp_call(q, v, plan, group_name, scale, kernel_name, kv_exchange, window, softcap)
    pieces = kernels.Pieces(cu_q, k_start, k_len, max_q=max_seqlen_q, max_k=max_seqlen, q_pos=q_pos)
    if ex is not None:
        return dense(*exchange.backward(kern, dout, q, k, v, out, lse, ex, pieces, group, **kw))
    return dense(*gathered.backward(kern, dout, q, k, v, out, lse, gather_index, pieces, group, kv_chunks, **kw))


@_cp_attention_backward.register_fake
def _(dout, q, k, v, out, lse, gather_index, cu_q, k_start, k_len, group_name, causal, scale, *rest):
    return dense_grads(q, k, v)


# plan: gather_index, cu_q, k_start, k_len
register_attention_autograd(_cp_attention, torch.ops.cpcompile.cp_attention_backward, num_plan=4)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    group=None,
    strategy: StrategyLike = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    scale: float | None = None,
    max_seqlen: int | None = None,
    plan: AttentionPlan | RingPlan | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Context-parallel attention over packed documents; call it on every rank of ``group``.

    Args:
        q: ``[T_local, Hq, D]``; k: ``[T_local, Hkv, D]``; v: ``[T_local, Hkv, Dv]``: this rank's tokens
            in layout order (as :func:`cpcompile.shard_batch` produces them); ``Dv`` may differ from ``D``.
        cu_seqlens: ``[B + 1]`` int32 *global* cumulative real lengths.
        cu_seqlens_padded: ``[B + 1]`` int32 global physical offsets (default:
            :func:`cpcompile.layouts.pad_for_cp` of ``cu_seqlens``).
        group: the CP process group, its name, or ``None`` (default group).
        strategy: layout of q/k/v and how attention runs (a :class:`cpcompile.StrategySpec`: ``kv``,
            ``kernel``, ``kv_chunks``): a strategy, a spec, or this rank's :class:`cpcompile.ShardedBatch`
            (its spec, and what its rows were laid out for, checked); default: the active
            :func:`cpcompile.strategy` block's. Under CP one of them must give the layout, and attention
            must know which rank the rows are for (a batch, or the batch's own ``cu_seqlens``:
            ``batch.check_rows``). With ``kv="heads"``, ``head_parallel`` equal to the group's size runs
            head-parallel (Ulysses) attention (``cpcompile.attention.heads``), a smaller one the hybrid
            (``cpcompile.attention.hybrid``); either needs ``Hq`` divisible by it and takes no ``plan``.
        window_size: ``(left, right)``, ``varlen_attn``'s sliding window (``cpcompile.plan.window``):
            query ``i`` sees its document's keys ``j`` with ``i - left <= j <= i + right`` (-1:
            unbounded); ``None``: from ``causal``; with ``causal=True`` its right side must be 0.
            Pieces then read only their windows' keys: the exchange moves fewer rows, the ring
            skips blocks no piece reads. Not with ``kv="heads"``. GPU kernels run windows
            ``(left, 0)`` on the all-gather and exchange paths; others run the reference kernel.
        max_seqlen: longest document, a launch bound for GPU kernels (optional).
        plan: a prebuilt :func:`cpcompile.plan.make_plan` (``kv`` other than ring) or
            :func:`cpcompile.plan.ring.make_ring_plan` (ring) for this rank, to share across layers;
            moved to the GPU with :func:`cpcompile.cache.upload` (host twins: what derives from it,
            and the check that it is this call's plan, read no value from the GPU).
        sinks: ``[Hq]`` learnable sink logits (GPT-OSS), one per query head of q, joining every query's
            softmax denominator (``cpcompile.attention.sinks``), on every path. Their gradient on each
            rank is its own rows' share: summed over the CP group with the model's other gradients
            (as a data-parallel trainer sums them over dp x cp), it is the single-device gradient.
        softcap: logit soft-capping, as :func:`packed_attention` takes it, on every path.
    Returns:
        ``[T_local, Hq, Dv]`` in layout order; padding rows are 0.
    """
    pg = resolve_group(group)
    cp, rank = pg.size(), pg.rank()
    # Every check that can fail on one rank alone runs before the ranks agree (agree_on): a rank
    # that raised here while the others entered a collective would leave them waiting.

    def prepare():
        """``(spec, window, plan, max_seqlen_q)`` of the call, resolved and checked."""
        check_qkv(q, k, v)
        check_sinks(sinks, q)
        check_scale_and_bound(scale, max_seqlen)
        check_softcap(softcap)
        check_device(q, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        check_has_values("cp_attention", cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        check_offsets(cu_seqlens, cu_seqlens_padded)
        check_longest(cu_seqlens, max_seqlen)
        window = resolve_window(causal, window_size)
        spec, rows = layout_in_force(strategy, cp_size=cp, what="cp_attention")
        check_head_parallel(spec.head_parallel, cp, q.shape[1])
        # q/k/v are this rank's rows of spec's layout (a plan says which rank it is for, not whose rows q holds)
        check_rows(cu_seqlens, cp, rank, spec, rows, required=rows_are_real(pg))
        made, bound = _plan_for_call(plan, spec, window, q, cu_seqlens, cu_seqlens_padded, max_seqlen, cp, rank)
        return spec, window, made, bound

    def record(prepared) -> dict[str, object]:
        spec, window, *_ = prepared
        return _call_record(q, k, v, cu_seqlens, cu_seqlens_padded, spec, window, scale, sinks, softcap)

    spec, window, plan, max_seqlen_q = agree_on(pg, agreement_enabled(pg, q), prepare, record)
    softcap = check_softcap(softcap)  # checked in prepare: a float, 0.0 for none
    return _run_cp_op(q, k, v, plan, pg, spec, window, scale, max_seqlen, max_seqlen_q, sinks, softcap)


def _plan_for_call(plan, spec, window, q, cu_seqlens, cu_seqlens_padded, max_seqlen, cp: int, rank: int):
    """``(plan, max_seqlen_q)`` a ``cp_attention`` call runs from: the caller's ``plan``, checked
    (:func:`_check_plan`), else the step plan of ``spec`` (:func:`spec_step_plan`), or the ring's without
    a window; and the bound on a piece's query rows (``max_seqlen`` for a caller's plan, which may be of
    any strategy: the safe bound)."""
    if spec.head_parallel > 1:
        if window not in UNBANDED:
            raise ValueError(f"window_size={window} is not supported with head_parallel > 1: use head_parallel=1")
        if plan is not None:
            raise ValueError("plan is not accepted with head_parallel > 1: the head-parallel plan is made here")
        return spec_step_plan(cu_seqlens, cu_seqlens_padded, q.shape[0] * cp, cp, rank, spec), max_seqlen
    if plan is not None:
        _check_plan(plan, spec.kv, window, q.shape[0], cp, rank, cu_seqlens, cu_seqlens_padded, spec)
        return plan, max_seqlen
    tokens = q.shape[0] * cp
    if spec.kv == "ring" and window in UNBANDED:
        made = ring_plan_of(cu_seqlens, cu_seqlens_padded, cp_size=cp, rank=rank, strategy=spec, num_tokens=tokens)
    else:  # once per step: every layer's call shares it (a host sync at most, on GPUs)
        made = spec_step_plan(cu_seqlens, cu_seqlens_padded, tokens, cp, rank, spec)
    return made, None if max_seqlen is None else max_piece_len(spec, cp, max_seqlen)


def _run_cp_op(q, k, v, plan, pg, spec, window, scale, max_seqlen, max_seqlen_q, sinks, softcap: float) -> torch.Tensor:
    """The op of ``spec``'s path (head-parallel, hybrid, ring, all-gather or exchange) over ``plan``:
    ``cp_attention``'s output ``[T_local, Hq, Dv]``."""
    cp = pg.size()
    # the window decides, on every path: causal=False with window_size=(-1, 0) is causal attention
    causal = is_causal(window)
    # by name: the ops' arguments before them keep their defaults
    extras = op_extras(sinks, softcap)
    if 1 < spec.head_parallel < cp:
        kw = {"causal": causal, "scale": scale, "max_seqlen": max_seqlen, "kernel": spec.kernel}
        return hybrid.hybrid_attention(q, k, v, plan, pg, spec.head_parallel, sinks=sinks, softcap=softcap, **kw)
    if spec.head_parallel > 1:
        args = (q, k, v, *plan[:3], plan.k_len(causal), pg.group_name, causal, scale, max_seqlen, spec.kernel)
        return torch.ops.cpcompile.cp_head_attention(*args, **extras)[0]
    if spec.kv == "ring" and isinstance(plan, RingPlan):
        args = (q, k, v, plan.cu_q, plan.k_start, plan.k_len(causal), pg.group_name, causal, scale)
        return torch.ops.cpcompile.cp_ring_attention(*args, max_seqlen, max_seqlen_q, spec.kernel, **extras)[0]
    k_start, k_len, q_pos = window_keys(*plan.pieces, window)
    if spec.kv == "ring":  # a window: the ring's key ranges and positions of the windowed pieces
        ranges = ring_window_plan(plan.gather_index, k_start, k_len, cp)
        args = (q, k, v, plan.cu_q, *ranges[:2], pg.group_name, causal, scale, max_seqlen, max_seqlen_q)
        return torch.ops.cpcompile.cp_ring_attention(*args, spec.kernel, q_pos, ranges[2], *window, **extras)[0]
    args = (q, k, v, plan.gather_index, plan.cu_q, k_start, k_len, pg.group_name, causal, scale)
    kv = (spec.kernel, spec.exchange, spec.kv_chunks, None if causal else q_pos)
    pack = (plan.cu_seqlens, plan.cu_seqlens_padded)  # for the sparse exchange
    return torch.ops.cpcompile.cp_attention(*args, max_seqlen, max_seqlen_q, *kv, *window, *pack, **extras)[0]


def _call_record(
    q, k, v, cu_seqlens, cu_seqlens_padded, spec, window, scale, sinks=None, softcap=None
) -> dict[str, object]:
    """What every rank of one ``cp_attention`` call must agree on (``comm.groups.agree``)."""
    return {
        "local tokens (q.shape[0])": q.shape[0],
        "q/k/v heads and head dims": (q.shape[1], k.shape[1], q.shape[2], v.shape[2]),
        "dtype": str(q.dtype),
        "strategy": spec.strategy.value,
        "stripe_size": spec.stripe_size,
        "windows": spec.windows,
        "capacity": spec.capacity,
        "kv": spec.kv,
        "head_parallel": spec.head_parallel,
        "kernel": spec.kernel,
        "kv_chunks": spec.kv_chunks,
        "window": window,
        "scale": scale,
        "sinks": sinks is not None,
        "softcap": check_softcap(softcap),  # normalised: None and 0, 30 and 30.0 are the same call
        "cu_seqlens": digest(cu_seqlens),
        "cu_seqlens_padded": None if cu_seqlens_padded is None else digest(cu_seqlens_padded),
        # a rank whose output needs no gradient would leave the others alone in the backward's collectives
        "gradients (grad mode; q, k, v requires_grad)": (
            torch.is_grad_enabled(),
            *(t.requires_grad for t in (q, k, v)),
        ),
    }


def _check_plan(plan, kv: str, window, local_tokens: int, cp: int, rank: int, cu_seqlens, cu_seqlens_padded, spec):
    """A caller's plan must be of the kind ``kv`` runs (a windowed ring runs from an
    :class:`AttentionPlan`), made for this rank's token count and cp, and, where its values can be read
    without a host sync (on the host, through host twins, or with data checks on:
    ``checks.data_checks_enabled``), be the plan this call makes for ``rank``, ``strategy``,
    ``cu_seqlens`` and ``cu_seqlens_padded`` (:func:`_plan_differs`): a plan of another rank, layout or
    pack would compute other documents' attention without an error, or leave ranks in mismatched
    collectives."""
    kind = RingPlan if kv == "ring" and window in UNBANDED else AttentionPlan
    if not isinstance(plan, kind):
        what = f"kv={kv!r}" + (f" with window_size={window}" if kv == "ring" and window not in UNBANDED else "")
        raise TypeError(f"plan must be a {kind.__name__} for {what}, got {type(plan).__name__}")
    if kind is RingPlan and plan.k_start.shape[0] != cp:
        raise ValueError(f"plan has key ranges for {plan.k_start.shape[0]} ranks, the group has cp_size {cp}")
    if kind is AttentionPlan and plan.gather_index.shape[0] != local_tokens * cp:
        raise ValueError(f"plan covers {plan.gather_index.shape[0]} tokens, q holds {local_tokens} x cp_size {cp}")
    tensors = (*plan, cu_seqlens, *(() if cu_seqlens_padded is None else (cu_seqlens_padded,)))
    if not data_checks_enabled(cu_seqlens) and any(twin(t) is None for t in tensors):
        return  # reading the values would wait for the stream
    layout = (spec.strategy.value, spec.stripe_size, *plan_extras(spec))
    args = (local_tokens * cp, cp, rank, layout, layout_name(spec), kind is RingPlan)
    problem = _plan_differs(cu_seqlens, cu_seqlens_padded, *args, *plan)
    if problem is not None:
        raise ValueError(problem)


@per_plan
def _plan_differs(
    cu_seqlens, cu_seqlens_padded, tokens: int, cp: int, rank: int, layout: tuple, name: str, ring: bool, *plan
):
    """How the plan of tensors ``plan`` (a :class:`RingPlan`'s where ``ring``, else an :class:`AttentionPlan`'s)
    differs from the one this call makes (``step_plan`` of the arguments, ``layout`` its strategy, stripe
    size and extras, ``name`` the layout's name), in a message, or ``None`` where it is that plan. Once
    per plan, on the host: its twins, else its values (no call reaches here where reading them would
    wait for the stream)."""
    given = _live_pieces((RingPlan if ring else AttentionPlan)(*on_host(*plan)))

    def made(r: int):
        """This call's plan for rank ``r``, on the host (the step plan's twins)."""
        p = AttentionPlan(*on_host(*step_plan(cu_seqlens, cu_seqlens_padded, tokens, cp, r, *layout)))
        if ring:
            ranges = block_key_ranges(p.gather_index, p.k_start, (p.k_len_causal, p.k_len_full), cp_size=cp)
            p = RingPlan(p.cu_q, *ranges, p.cu_seqlens, p.cu_seqlens_padded)
        return _live_pieces(p)

    def same(a, b) -> bool:
        return all(x.shape == y.shape and torch.equal(x, y.to(x.dtype)) for x, y in zip(a, b, strict=True))

    want = made(rank)
    if same(given, want):
        return None
    (cu,) = on_host(cu_seqlens)
    if not same((given.cu_seqlens,), (cu,)):
        return f"plan was made from other cu_seqlens: {_first_difference(given.cu_seqlens, cu)}"
    for r in range(cp):
        if r != rank and same(given, made(r)):
            return f"plan was made for rank {r} of cp_size {cp}, but this is rank {rank} of a group of {cp}"
    padded = "the given cu_seqlens_padded" if cu_seqlens_padded is not None else "the layout's padding"
    detail = "has other pieces"
    if not same((given.cu_seqlens_padded,), (want.cu_seqlens_padded,)):
        detail = "differs: " + _first_difference(given.cu_seqlens_padded, want.cu_seqlens_padded, "cu_seqlens_padded")
    return f"plan was made for another layout or padding: this call's is {name} with {padded}, and its plan {detail}"


def _live_pieces(plan):
    """``plan`` (on the host) without its trailing empty piece slots, whose number depends on how the plan
    was made (``auto`` keeps slots for whichever layout it picks), not on what it computes."""
    live = int((plan.cu_q[1:] > plan.cu_q[:-1]).sum())  # the pieces with queries come first
    kept = {"cu_q": plan.cu_q[: live + 1]}
    kept |= {f: getattr(plan, f)[..., :live] for f in ("k_start", "k_len_causal", "k_len_full")}
    return plan._replace(**kept)


def _first_difference(plan_offsets: torch.Tensor, call_offsets: torch.Tensor, name: str = "cu_seqlens") -> str:
    """Where the plan's offsets ``name`` and the call's part, in a few words (a pack may hold thousands)."""
    if plan_offsets.shape != call_offsets.shape:
        return f"the plan's pack holds {plan_offsets.shape[0] - 1} document(s), {name} {call_offsets.shape[0] - 1}"
    i = int((plan_offsets != call_offsets.to(plan_offsets.dtype)).nonzero()[0, 0])
    return f"{name}[{i}] is {int(call_offsets[i])}, the plan's {int(plan_offsets[i])}"

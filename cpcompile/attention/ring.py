"""Ring CP attention: K/V blocks pass around the ring, partial results merge by log-sum-exp.

``cp_ring_attention`` is the point-to-point alternative to the all-gather
``cp_attention`` (docs/design.md, "How K/V move"; MaxText runs packed sequences this way). At
step ``i`` rank ``r`` holds rank ``(r - i) % cp``'s K/V block, in that rank's storage
order, while the next block is already in flight (``batch_isend_irecv``, double
buffered). Each step is one kernel call over all of the rank's pieces with the
block's key ranges of the :class:`~cpcompile.plan.ring.RingPlan` (causal only for
the own block), and its ``(out, lse)`` merges into the running result. Memory per
layer stays ``O(T_local)``: at most three blocks exist at a time.

Backward runs the ring again with the final ``out`` and ``lse``, so each step's
kernel backward yields the exact share of the gradients. dQ stays local; each
block's dK/dV (float32) travels one step behind its block, collecting every rank's
share, and a last step hands it to its owner.

Each op: ``custom_op`` -> ``register_fake`` -> ``register_autograd``, whose backward
is again a custom op. Groups travel by name.
"""

from __future__ import annotations

import torch

from cpcompile import kernels
from cpcompile.attention.common import (
    NOT_CAPTURED,
    accumulation_dtype,
    check_fake_qkv,
    communicates,
    out_and_lse,
    register_attention_autograd,
    softmax_scale,
)
from cpcompile.attention.sinks import check_fake_sinks
from cpcompile.cache import per_plan, readable
from cpcompile.checks import check_device
from cpcompile.comm.groups import resolve_group
from cpcompile.comm.ring import rotate, shift
from cpcompile.kernels.sinks import joined
from cpcompile.plan.ring import block_key_ranges, ring_window_plan
from cpcompile.plan.window import beyond_gpu


@torch.library.custom_op("cpcompile::ring_key_ranges", mutates_args=(), tags=NOT_CAPTURED)
def ring_key_ranges(
    gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cpcompile.plan.ring.block_key_ranges` as an op, fed by ``cp_plan``:
    ``(k_start, k_len)``, each ``[cp_size, P]`` int32."""
    return block_key_ranges(gather_index, k_start, (k_len,), cp_size=cp_size)


@ring_key_ranges.register_fake
def _(gather_index, k_start, k_len, cp_size):
    torch._check(
        gather_index.shape[0] % cp_size == 0,
        lambda: f"plan covers {gather_index.shape[0]} tokens, not a multiple of cp_size {cp_size}",
    )
    return tuple(k_start.new_empty((cp_size, k_start.shape[0])) for _ in range(2))


@torch.library.custom_op("cpcompile::ring_window_plan", mutates_args=(), tags=NOT_CAPTURED)
def ring_window_plan_op(
    gather_index: torch.Tensor, k_start: torch.Tensor, k_len: torch.Tensor, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cpcompile.plan.ring.ring_window_plan` as an op, fed by ``cp_plan`` and ``window_keys``:
    ``(k_start, k_len)`` ``[cp_size, P]`` int32 and the blocks' positions ``[cp_size, T_local]`` int64."""
    return ring_window_plan(gather_index, k_start, k_len, cp_size)


@ring_window_plan_op.register_fake
def _(gather_index, k_start, k_len, cp_size):
    torch._check(
        gather_index.shape[0] % cp_size == 0,
        lambda: f"plan covers {gather_index.shape[0]} tokens, not a multiple of cp_size {cp_size}",
    )
    ranges = [k_start.new_empty((cp_size, k_start.shape[0])) for _ in range(2)]
    return *ranges, gather_index.new_empty((cp_size, gather_index.shape[0] // cp_size))


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint keys (docs/design.md, "How K/V move").

    out ``[Tq, Hq, D]`` and lse ``[Hq, Tq]`` so far, in the accumulation dtype; block_out
    ``[Tq, Hq, D]`` and block_lse ``[Hq, Tq]`` from one kernel call. Rows no key has
    reached keep ``lse = -inf`` and ``out = 0``.
    """
    hi, lo = torch.maximum(lse, block_lse), torch.minimum(lse, block_lse)
    none = hi == float("-inf")
    merged = torch.where(none, hi, hi + torch.log1p(torch.exp(lo - hi)))  # lo - hi is NaN only where none
    ref = torch.where(none, 0.0, merged)  # finite, so rows without keys get weights exp(-inf) = 0
    w_old = torch.exp(lse - ref).t().unsqueeze(-1)  # [Tq, Hq, 1]
    w_new = torch.exp(block_lse - ref).t().unsqueeze(-1)
    return out * w_old + block_out.to(out.dtype) * w_new, merged


def _joined(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V (``[T, Hkv, D]``, ``[T, Hkv, Dv]``, or their gradients) as one message ``[T, Hkv (D + Dv)]``."""
    return torch.cat([k.flatten(1), v.flatten(1)], dim=1)


def _parted(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mirror of :func:`_joined`: views of ``kv`` in ``k``'s and ``v``'s head shapes."""
    k_part, v_part = kv.split([k[0].numel(), v[0].numel()], dim=1)
    return k_part.unflatten(1, k.shape[1:]), v_part.unflatten(1, v.shape[1:])


@per_plan
def _live_blocks(k_len: torch.Tensor) -> list[bool]:
    """Per block ``[cp]``, whether a piece reads a key of it (``k_len`` ``[cp, P]``): a window leaves
    far blocks unread, and their kernel calls are skipped. Once per plan, read on the host twin
    (a host sync where the plan has none)."""
    return readable(k_len)[0].gt(0).any(1).tolist()


def _steps(k, v, cu_q, k_start, k_len, group, causal, max_seqlen, max_seqlen_q, q_pos=None, k_pos=None):
    """Per ring step, for the block in hand: ``(k_src, v_src, pieces, causal)``, with ``pieces``
    ``None`` where no piece reads the block (its kernel call is skipped; the block still passes).
    Only windowed calls look (their plan is the step's, with host twins): a causal call's ring plan
    is made per call, and finding its unread blocks would cost a host sync per layer on GPUs."""
    live = _live_blocks(k_len) if k_pos is not None else [True] * k_len.shape[0]
    # one message for both, [T_local, Hkv (D + Dv)]: their head dims may differ
    for src, kv in rotate(_joined(k, v), group):
        k_src, v_src = _parted(kv, k, v)
        own = src == group.rank()  # only the own block holds the pieces' rows: causal; others are full
        pieces = None
        if live[src]:
            positions = {} if k_pos is None else {"q_pos": q_pos, "k_pos": k_pos[src]}  # a window's alignment
            pieces = kernels.Pieces(cu_q, k_start[src], k_len[src], max_q=max_seqlen_q, max_k=max_seqlen, **positions)
        yield k_src, v_src, pieces, causal and own


@torch.library.custom_op("cpcompile::cp_ring_attention", mutates_args=(), tags=NOT_CAPTURED)
@communicates("cp_ring_attention (ring)")
def _ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
    max_seqlen: int | None,
    max_seqlen_q: int | None,
    kernel_name: str | None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    group = resolve_group(group_name)
    window = (window_left, 0 if causal else window_right)
    kern = kernels.select(q, kernel_name, band=beyond_gpu(window, ring=True), v=v, softcap=softcap)
    lse_dtype = accumulation_dtype(q.dtype)
    out, lse = torch.zeros((*q.shape[:2], v.shape[2]), dtype=lse_dtype, device=q.device), None
    # without positions the plan's ranges are the whole mask (causal in the own block alone)
    kw = {"scale": softmax_scale(q, scale), "window": window if k_pos is not None else (-1, -1), "softcap": softcap}
    steps = _steps(k, v, cu_q, k_start, k_len, group, causal, max_seqlen, max_seqlen_q, q_pos, k_pos)
    for k_src, v_src, pieces, step_causal in steps:
        if pieces is None:
            continue
        block = kern.forward(q, k_src, v_src, pieces, causal=step_causal, **kw)
        out, lse = (block[0].to(lse_dtype), block[1]) if lse is None else merge(out, lse, *block)
    if lse is None:  # no piece reads a key
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=lse_dtype, device=q.device)
    out, lse = joined((out, lse), sinks)  # once, on the merged lse: the sink is one more term of every row
    # contiguous whatever q's layout (a head-major q, say) and the kernel made of it, as the fake says
    return out.to(q.dtype, memory_format=torch.contiguous_format), lse.contiguous()


@_ring_attention.register_fake
def _(q, k, v, cu_q, k_start, k_len, group_name, causal, scale, max_seqlen, max_seqlen_q, kernel_name,
      q_pos=None, k_pos=None, window_left=-1, window_right=-1, sinks=None, softcap=0.0):  # fmt: skip
    check_fake_qkv(q, k, v)
    check_device(q, cu_q=cu_q, k_start=k_start, k_len=k_len, q_pos=q_pos, k_pos=k_pos, sinks=sinks)
    check_fake_sinks(q, sinks)
    cp = resolve_group(group_name).size()
    torch._check(k_start.shape[0] == cp, lambda: f"ring plan has {k_start.shape[0]} blocks for cp {cp}")
    torch._check(k_start.shape[1] + 1 == cu_q.shape[0], lambda: f"{k_start.shape} key ranges for {cu_q.shape} cu_q")
    return out_and_lse(q, v)  # out contiguous, as the op returns it


@torch.library.custom_op("cpcompile::cp_ring_attention_backward", mutates_args=(), tags=NOT_CAPTURED)
@communicates("cp_ring_attention (ring)", "backward")
def _ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    k_start: torch.Tensor,
    k_len: torch.Tensor,
    group_name: str,
    causal: bool,
    scale: float | None,
    max_seqlen: int | None,
    max_seqlen_q: int | None,
    kernel_name: str | None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = resolve_group(group_name)
    window = (window_left, 0 if causal else window_right)
    kern = kernels.select(q, kernel_name, band=beyond_gpu(window, ring=True), v=v, softcap=softcap)
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    arrived = None  # dK/dV of the block in hand from the ranks it visited before, [T_local, Hkv (D + Dv)] fp32
    works = []
    # without positions the plan's ranges are the whole mask (causal in the own block alone)
    kw = {"scale": softmax_scale(q, scale), "window": window if k_pos is not None else (-1, -1), "softcap": softcap}
    steps = _steps(k, v, cu_q, k_start, k_len, group, causal, max_seqlen, max_seqlen_q, q_pos, k_pos)
    for step, (k_src, v_src, pieces, step_causal) in enumerate(steps):
        if pieces is None:  # no piece reads this block: its share is 0
            dkv = torch.zeros((k.shape[0], k[0].numel() + v[0].numel()), dtype=acc, device=k.device)
        else:
            dq_step, dk, dv = kern.backward(dout, q, k_src, v_src, out, lse, pieces, causal=step_causal, **kw)
            dq += dq_step
            dkv = _joined(dk, dv).to(acc)  # this rank's share, rounded once at the end
        if step > 0:
            for work in works:
                work.wait()
            dkv += arrived
        if group.size() == 1:
            arrived = dkv
            break
        # to rank + 1 (next holder of this block, its owner after the last step); while the
        # next step computes, the next block's dK/dV arrives from rank - 1
        arrived = torch.empty_like(dkv) if arrived is None else arrived
        works = shift(dkv, arrived, group)
    for work in works:
        work.wait()
    # Copied into fresh tensors, not returned as views of one buffer: with one local row
    # the two halves are contiguous views already, and an op's outputs must not alias.
    # Contiguous, whatever k's and v's layouts, as the fake says.
    dk, dv = (t.new_empty(t.shape).copy_(part) for t, part in zip((k, v), _parted(arrived, k, v)))
    return dq.to(q.dtype, memory_format=torch.contiguous_format), dk, dv


@_ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, k_start, k_len, group_name, causal, scale, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op returns them


# plan: cu_q, k_start, k_len
register_attention_autograd(_ring_attention, torch.ops.cpcompile.cp_ring_attention_backward, num_plan=3)

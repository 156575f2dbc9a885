"""Layout math: which physical tokens each CP rank holds, in which order.

Pure tensor functions of ``cu_seqlens_padded``, ``cp_size`` and ``rank``: they never
touch ``torch.distributed``, loop over documents in Python, or read tensor values
on the host (pass ``num_tokens`` when the tensors live on CUDA), so they run inside
CUDA graphs and under ``torch.compile``. The one exception is balanced, whose cut
points are chosen from the document lengths on the host (see ``balanced.py``).

Layouts (``T`` = padded token count, ``T_local = T / cp``):

- dual_chunk_swap: each document is cut into ``2 * cp`` equal chunks; rank ``r``
  holds chunks ``r`` and ``2 * cp - 1 - r`` of every document, documents in order
  (TransformerEngine's ``thd_get_partitioned_indices``).
- no_load_balance: rank ``r`` holds ``[r * T_local, (r + 1) * T_local)``.
- striped: rank ``r`` holds token ``t`` where ``(t // stripe) % cp == r``.
- balanced: ``T_local`` tokens per rank, cut so that every rank has the same causal
  work (:func:`cpcompile.layouts.balanced.balanced_layout`); padding only to a multiple of cp.
  Under a capacity it also reads ``cu_seqlens``: the capacity's padding costs no work.

auto is not a layout: it is resolved per batch to one of these from ``cu_seqlens``
(:func:`cpcompile.cost.model.resolve_auto`), so these functions reject it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import torch

from cpcompile.checks import check_cp, check_cu_seqlens, check_padding, data_checks_enabled
from cpcompile.layouts.balanced import balanced_runs
from cpcompile.layouts.balanced_op import balanced_layout_op
from cpcompile.spec import Capacity, Strategy, StrategyLike, StrategySpec, resolve_strategy


def padding_multiple(spec: StrategySpec, cp_size: int) -> tuple[int, bool]:
    """``(m, per_document)``: lengths must be multiples of ``m``, per document or in total.

    For auto: what every strategy it may pick guarantees (the total, a multiple of cp).
    One rank holds everything in order under every strategy, so it needs no padding: the
    model then sees the pack as it is, which is what the backend (which leaves a graph
    alone at cp=1) and single-device attention expect.
    """
    if cp_size == 1:
        return 1, False
    if spec.strategy is Strategy.DUAL_CHUNK_SWAP:
        return 2 * cp_size, True
    if spec.strategy is Strategy.STRIPED:
        return cp_size * spec.stripe_size, False
    return cp_size, False


def layout_spec(strategy: StrategyLike) -> StrategySpec:
    """The spec of a strategy that has a layout: auto is rejected (it is resolved per batch)."""
    spec = resolve_strategy(strategy)
    if spec.strategy is Strategy.AUTO:
        raise ValueError(
            "strategy 'auto' has no layout of its own: it is picked per batch from cu_seqlens; pass the "
            "concrete spec of cpcompile.cost.model.resolve_auto(spec, cu_seqlens, cp_size=...) or ShardedBatch.spec"
        )
    return spec


def pad_for_cp(cu_seqlens: torch.Tensor, *, cp_size: int, strategy: StrategyLike = None) -> torch.Tensor:
    """The least padding the strategy needs, at the end of documents.

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths.
    Returns:
        ``cu_seqlens_padded``: ``[B + 1]`` int32 physical offsets. dual_chunk_swap pads
        every document to a multiple of ``2 * cp``; the others pad only the total
        (to a multiple of ``cp``, or ``cp * stripe_size``), at the end of the last document.
        ``auto`` is rejected: resolve it first (:func:`cpcompile.cost.model.resolve_auto`). With the
        spec's ``capacity``, the last document's padding runs on to ``capacity.tokens``
        (``ValueError`` where the pack does not fit).
    """
    check_cp(cp_size)
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    return padded_offsets(cu_seqlens, layout_spec(strategy), cp_size)


def padded_offsets(cu_seqlens: torch.Tensor, spec: StrategySpec, cp_size: int) -> torch.Tensor:
    """:func:`pad_for_cp` of offsets a public entry checked, for ``spec`` (a layout: not ``auto``)."""
    m, per_document = padding_multiple(spec, cp_size)
    cu = cu_seqlens.long()
    if per_document:
        lengths = cu[1:] - cu[:-1]
        padded = torch.cat([cu[:1], ((lengths + m - 1) // m * m).cumsum(0)])
    else:
        pad = (-cu[-1:]) % m  # [1], kept as a tensor: no host read
        padded = torch.cat([cu[:-1], cu[-1:] + pad])
    if spec.capacity is not None:
        padded = _to_capacity(padded, spec, cp_size, m)
    return padded.to(torch.int32)


def _to_capacity(padded: torch.Tensor, spec: StrategySpec, cp_size: int, m: int) -> torch.Tensor:
    """``padded`` (``[B + 1]`` int64) with the last document's padding run on to ``spec.capacity.tokens``."""
    tokens = spec.capacity.tokens
    if tokens % m:
        raise ValueError(
            f"capacity.tokens={tokens} must be a multiple of {m} for {spec.strategy.value} with cp_size={cp_size}"
        )
    if data_checks_enabled(padded) and int(padded[-1]) > tokens:
        raise ValueError(
            f"the pack needs {int(padded[-1])} tokens with {spec.strategy.value}'s padding at cp_size={cp_size}, "
            f"more than capacity.tokens={tokens}: use a larger capacity (or bucket)"
        )
    return torch.cat([padded[:-1], padded.new_full((1,), tokens)])


def check_capacity_documents(cu_seqlens: torch.Tensor, capacity: Capacity) -> None:
    """Attention under a capacity takes the batch's ``cu_seqlens`` (``ShardedBatch.cu_seqlens``: the pack's,
    with zero-length documents after the last, ``capacity.documents`` in all). The pack's own, with fewer,
    has the same token count but puts the padding in its last document, which dual_chunk_swap and
    balanced lay out otherwise than ``shard_batch`` laid out the rows: silently wrong, so refused. A
    shape check (a symbolic count is checked when the plan is made)."""
    count = cu_seqlens.shape[0] - 1
    if isinstance(count, int) and count != capacity.documents:
        raise ValueError(
            f"under capacity={tuple(capacity)} attention takes the batch's cu_seqlens (ShardedBatch.cu_seqlens, "
            f"{capacity.documents} documents: the pack's, with zero-length ones after the last), got {count} "
            "documents: pass batch.cu_seqlens, not the pack's own"
        )


def capacity_for(packs: Iterable[torch.Tensor], *, cp_size: int, strategy: StrategyLike = None) -> Capacity:
    """The smallest :class:`~cpcompile.spec.Capacity` that holds every pack of ``packs`` (each
    its ``cu_seqlens``, ``[B + 1]``) under ``strategy`` at ``cp_size``: the most tokens a pack needs
    with the strategy's padding (a multiple of what the layout needs), and the most documents. A
    loader that sorts its packs into buckets ahead of training gives each bucket this capacity; every
    pack of a bucket then runs one compiled graph under ``dynamic=False``."""
    check_cp(cp_size)
    spec = resolve_strategy(strategy)
    if spec.strategy is Strategy.AUTO:
        raise ValueError(
            "capacity_for needs the layout the bucket's packs will use, got strategy 'auto' (it picks one per "
            "pack): pass that layout's strategy"
        )
    if spec.head_parallel > 1:
        raise ValueError(f"capacity buckets are not supported with head_parallel={spec.head_parallel} yet")
    spec = dataclasses.replace(spec, capacity=None)
    tokens = documents = 0
    for cu in packs:
        check_cu_seqlens("cu_seqlens", cu)
        tokens = max(tokens, int(padded_offsets(cu, spec, cp_size)[-1]))
        documents = max(documents, cu.shape[0] - 1)
    if documents == 0:
        raise ValueError("packs must hold at least one pack, got none")
    return Capacity(tokens, documents)


def check_layout_values(
    cu_seqlens_padded: torch.Tensor, spec: StrategySpec, cp_size: int, num_tokens: int | None
) -> None:
    """Raise if ``cu_seqlens_padded`` (checked as offsets) or ``num_tokens`` cannot be split by ``spec``."""
    m, per_document = padding_multiple(spec, cp_size)
    capacity = spec.capacity
    if isinstance(num_tokens, int) and capacity is not None and num_tokens != capacity.tokens:
        # A batch sharded under another capacity (or none) has another token count; named as such, since
        # the offsets' mismatch below would not say why.
        raise ValueError(
            f"under capacity={tuple(capacity)} a batch holds {capacity.tokens} tokens ({capacity.tokens // cp_size} "
            f"per rank at cp_size={cp_size}), got {num_tokens} (local tokens x cp_size): shard the batch with "
            "the same capacity (shard_batch(..., strategy=spec))"
        )
    if isinstance(num_tokens, int) and num_tokens % m:
        raise ValueError(
            f"{spec.strategy.value} with cp_size={cp_size} needs a token count that is a multiple of {m}, "
            f"got {num_tokens}"
        )
    if not data_checks_enabled(cu_seqlens_padded):
        return
    total = int(cu_seqlens_padded[-1])
    if isinstance(num_tokens, int) and total != num_tokens:
        raise ValueError(
            f"cu_seqlens_padded[-1] = {total} does not match the token count {num_tokens} "
            "(for attention: local tokens x cp_size)"
        )
    lengths = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
    if per_document and bool((lengths % m != 0).any()):
        raise ValueError(
            f"cu_seqlens_padded is not usable by {spec.strategy.value} with cp_size={cp_size}: every document "
            f"must be padded to a multiple of {m}, got lengths {lengths.tolist()} (use pad_for_cp)"
        )
    if total % m:
        raise ValueError(
            f"cu_seqlens_padded is not usable by {spec.strategy.value} with cp_size={cp_size}: the total "
            f"{total} must be a multiple of {m} (use pad_for_cp)"
        )


def _real_offsets(
    spec: StrategySpec, cu_seqlens: torch.Tensor | None, cu_seqlens_padded: torch.Tensor
) -> torch.Tensor | None:
    """The real offsets the layout of ``spec`` reads: balanced's under a capacity (whose padding it lays out
    as free, :func:`cpcompile.layouts.balanced.free_padding`), else none."""
    if spec.strategy is not Strategy.BALANCED or spec.capacity is None:
        return None
    if cu_seqlens is None:
        raise ValueError(
            f"balanced under capacity={tuple(spec.capacity)} lays the capacity's padding out from the real lengths: "
            "pass cu_seqlens (ShardedBatch.cu_seqlens) with cu_seqlens_padded"
        )
    return cu_seqlens


def _indices(
    cu_padded: torch.Tensor, spec: StrategySpec, cp: int, ranks: torch.Tensor, t_local, cu_real: torch.Tensor | None
) -> torch.Tensor:
    """Physical positions held by ``ranks`` (``[R, 1]`` int64): ``[R, t_local]`` int64. ``cu_real``: the
    real offsets where the layout reads them (:func:`_real_offsets`)."""
    if spec.strategy is Strategy.BALANCED:
        windows = list(spec.windows) if spec.windows else None
        # only the arguments that are set: the op's call as it was without windows and a capacity
        args = (windows, cu_real) if cu_real is not None else (windows,) if windows else ()
        layout = balanced_layout_op(cu_padded, cp, t_local * cp, *args)
        return layout if ranks.shape[0] == cp else layout[ranks[:, 0]]  # every rank's: no copy
    j = torch.arange(t_local, device=cu_padded.device)  # [t_local] local positions
    if spec.strategy is Strategy.NO_LOAD_BALANCE:
        return ranks * t_local + j
    if spec.strategy is Strategy.STRIPED:
        s = spec.stripe_size
        return ((j // s) * cp + ranks) * s + j % s
    # dual_chunk_swap: doc d occupies local positions [cu[d] / cp, cu[d + 1] / cp).
    cu = cu_padded.long()
    cu_local = cu // cp
    doc = torch.searchsorted(cu_local, j, right=True) - 1  # right: empty documents are skipped
    pos = j - cu_local[doc]  # position inside the rank's part of the document
    chunk = (cu[doc + 1] - cu[doc]) // (2 * cp)
    shift = torch.where(pos < chunk, ranks, 2 * cp - 2 - ranks) * chunk
    return pos + cu[doc] + shift


def _num_tokens(cu_seqlens_padded: torch.Tensor, num_tokens):
    # Reading the total is a host sync on CUDA; callers that know it (ops) pass it.
    return int(cu_seqlens_padded[-1]) if num_tokens is None else num_tokens


def partition_indices(
    cu_seqlens_padded: torch.Tensor,
    *,
    cp_size: int,
    rank: int,
    strategy: StrategyLike = None,
    num_tokens: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The physical positions rank ``rank`` holds, in its storage order.

    Args:
        cu_seqlens_padded: ``[B + 1]`` int32 physical document offsets (see :func:`pad_for_cp`).
        num_tokens: ``T = cu_seqlens_padded[-1]`` if known; given, no value is read on the host.
        cu_seqlens: ``[B + 1]`` int32 real offsets; needed (and read) by balanced under a capacity alone,
            which lays the capacity's padding out as costing no work.
    Returns:
        ``[T / cp_size]`` int64.
    """
    check_cp(cp_size, rank)
    spec = _checked_layout(cu_seqlens_padded, strategy, cp_size, num_tokens, cu_seqlens)
    return positions(cu_seqlens_padded, spec, cp_size, num_tokens=num_tokens, cu_seqlens=cu_seqlens, rank=rank)


def all_partition_indices(
    cu_seqlens_padded: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike = None,
    num_tokens: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every rank's :func:`partition_indices` at once: ``[cp_size, T / cp_size]`` int64.

    Row-major it is the physical position of each row of an all-gather of the
    ranks' local buffers.
    """
    check_cp(cp_size)
    spec = _checked_layout(cu_seqlens_padded, strategy, cp_size, num_tokens, cu_seqlens)
    return positions(cu_seqlens_padded, spec, cp_size, num_tokens=num_tokens, cu_seqlens=cu_seqlens)


def _checked_layout(cu_seqlens_padded, strategy: StrategyLike, cp_size: int, num_tokens, cu_seqlens) -> StrategySpec:
    """The public layout functions' checks of their arguments: the layout's spec."""
    spec = layout_spec(strategy)
    check_cu_seqlens("cu_seqlens_padded", cu_seqlens_padded)
    if _real_offsets(spec, cu_seqlens, cu_seqlens_padded) is not None:
        check_cu_seqlens("cu_seqlens", cu_seqlens)
        check_padding(cu_seqlens, cu_seqlens_padded)
    check_layout_values(cu_seqlens_padded, spec, cp_size, num_tokens)
    return spec


def positions(
    cu_seqlens_padded: torch.Tensor,
    spec: StrategySpec,
    cp_size: int,
    *,
    num_tokens=None,
    cu_seqlens: torch.Tensor | None = None,
    rank: int | None = None,
) -> torch.Tensor:
    """:func:`all_partition_indices` (``rank=None``: ``[cp_size, T_local]`` int64) or
    :func:`partition_indices` (``[T_local]``) of offsets a public entry checked, for ``spec`` (a layout)."""
    cu_real = _real_offsets(spec, cu_seqlens, cu_seqlens_padded)
    t = _num_tokens(cu_seqlens_padded, num_tokens)
    device = cu_seqlens_padded.device
    ranks = torch.arange(cp_size, device=device)[:, None] if rank is None else torch.tensor([[rank]], device=device)
    held = _indices(cu_seqlens_padded, spec, cp_size, ranks, t // cp_size, cu_real)
    return held if rank is None else held[0]


def piece_marks(
    layout: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a layout's pieces start: maximal runs of consecutive physical positions
    inside one document, all real or all padding (docs/design.md, "Pieces and the plan").

    Args:
        layout: ``[..., n]`` int64 physical positions in storage order; each row is one rank.
        cu_seqlens, cu_seqlens_padded: ``[B + 1]`` int32, real and physical offsets.
    Returns:
        ``(doc, pos, real, start)``, each ``[..., n]``: each token's document (int64),
        its position in the document (int64), whether it is real, and whether a piece
        starts at it (bool).
    """
    cu_p = cu_seqlens_padded.long()
    real_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    doc = torch.searchsorted(cu_p, layout, right=True) - 1  # right: empty documents are skipped
    pos = layout - cu_p[doc]
    real = pos < real_len[doc]
    start = torch.ones_like(layout, dtype=torch.bool)
    start[..., 1:] = (
        (layout[..., 1:] != layout[..., :-1] + 1) | (doc[..., 1:] != doc[..., :-1]) | (real[..., 1:] != real[..., :-1])
    )
    return doc, pos, real, start


def layout_runs(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row, start, length)``, each ``[R]`` int64: the maximal runs of consecutive physical positions
    of each row of ``layout`` (``[rows, n]`` int64, in storage order, on the host), row after row: one
    pass over the layout (numpy's, fewer passes than torch's), after which its pieces
    (:func:`run_pieces`) and reads take work per run, not per token."""
    rows, n = layout.shape
    flat = layout.reshape(-1).numpy(force=True)
    new = np.empty(flat.shape[0], dtype=bool)
    new[0] = True
    np.not_equal(flat[1:] - flat[:-1], 1, out=new[1:])
    new[::n] = True  # every row starts a run
    first = np.flatnonzero(new)
    length = np.diff(first, append=flat.shape[0])
    return tuple(torch.from_numpy(x) for x in (first // n, flat[first], length))


def join_runs(row: torch.Tensor, start: torch.Tensor, length: torch.Tensor, u: int = 1) -> tuple[torch.Tensor, ...]:
    """Runs of rows (``row``, ``start``, ``length`` ``[R]`` int64, row after row, each row's in storage
    order) as runs of groups of ``u`` consecutive rows, each group's rows one after the other: a run joins
    the one before where it continues it in the same group (``u`` 1: runs that touch, joined)."""
    group = row // u
    new = torch.ones_like(row, dtype=torch.bool)
    new[1:] = (group[1:] != group[:-1]) | (start[1:] != (start + length)[:-1])
    first = new.nonzero().squeeze(1)
    total = torch.cat([length.new_zeros(1), length.cumsum(0)])
    last = torch.cat([first[1:], first.new_full((1,), row.shape[0])])
    return group[first], start[first], total[last] - total[first]


def spec_runs(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, spec: StrategySpec, cp_size: int
) -> tuple[torch.Tensor, ...]:
    """:func:`layout_runs` of the layout of ``spec`` (a layout) over ``cp_size`` ranks, of offsets a
    public entry checked (``cu_seqlens_padded``: the layout's padding, :func:`padded_offsets`): balanced's
    from its cuts, without laying the pack out token by token; the others' from their layouts."""
    cu_real = _real_offsets(spec, cu_seqlens, cu_seqlens_padded)
    if spec.strategy is Strategy.BALANCED:
        return join_runs(*balanced_runs(cu_seqlens_padded, cp_size, tuple(spec.windows), cu_real))
    return layout_runs(positions(cu_seqlens_padded, spec, cp_size, cu_seqlens=cu_seqlens))


def run_pieces(
    row: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Runs of consecutive physical positions (``row``, ``start``, ``length`` ``[R]`` int64, each run
    non-empty) cut into pieces where a document starts or its padding does: the pieces of
    :func:`piece_marks`, without a value per token.

    Returns:
        ``(row, start, length, doc, pos, real)``, each ``[P]``: each piece's row, first physical
        position and rows (int64), its document and first position in it (int64), and whether it is
        real (bool); in the runs' order, each run's pieces ascending.
    """
    cu_p = cu_seqlens_padded.long()
    real_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    # every position where a piece must start: a document's start (empty ones included, which coincide
    # with the next one's) and its padding's
    cuts = torch.unique(torch.cat([cu_p, cu_p[:-1] + real_len]))  # [C] ascending
    inside = torch.searchsorted(cuts, start, right=True)  # [R] the first cut past each run's start
    count = torch.searchsorted(cuts, start + length) - inside  # [R] cuts strictly inside each run
    run = torch.repeat_interleave(torch.arange(row.shape[0]), count + 1)  # [P] each piece's run
    j = torch.arange(run.shape[0]) - (torch.cumsum(count + 1, 0) - (count + 1))[run]  # its place in its run
    cut = cuts[(inside[run] + j - 1).clamp(0, cuts.shape[0] - 1)]  # the cut before it (j > 0)
    first = torch.where(j > 0, cut, start[run])
    end = torch.where(j < count[run], cuts[(inside[run] + j).clamp(max=cuts.shape[0] - 1)], (start + length)[run])
    doc = torch.searchsorted(cu_p, first, right=True) - 1  # right: empty documents are skipped
    pos = first - cu_p[doc]
    return row[run], first, end - first, doc, pos, pos < real_len[doc]

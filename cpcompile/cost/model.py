"""Cost model of a rank's CP step, per-rank predictions, and the ``auto`` rule.

Design constraint: integer arithmetic on the host only, so every rank computes the
same numbers from the same ``cu_seqlens`` and ``auto`` picks the same strategy on
every rank (no floating-point reduction order that could differ between machines).
On CUDA tensors the inputs are copied to the CPU first (a host sync).

Model, in units of one query-key pair of attention (its forward and backward):

    cost_r = tiles_r * block_q * block_k + token_cost * tokens_r + key_cost * key_rows_r

- ``tiles_r``: kernel tiles rank ``r``'s attention visits. A flash kernel runs each
  piece in blocks of ``block_q`` query rows; block ``b`` of a causal piece whose
  first row sits ``o`` tokens into its document visits
  ``ceil((o + last row of the block + 1) / block_k)`` key blocks, a non-causal one
  ``ceil(document length / block_k)``. So a piece shorter than a tile costs a whole
  tile, and a short piece deep in a long document costs a whole row of tiles.
- ``tokens_r``: rows the rank holds, padding included (projections and MLP scale
  with them). ``token_cost`` defaults to one 128x128 tile: in a Llama-3-8B-like
  layer a token's projections and MLP take about as long as that many pairs of
  attention (the derivation: docs/cost-model.md).
- ``key_rows_r``: the sum of the rank's pieces' key counts: rows of K/V that
  torch's flash backward copies, one copy per piece, and whose dK/dV it adds back
  (``kernels/flash.py``: its backward kernel has no ``seqused_k``). About
  ``T`` for dual_chunk_swap, far more for short stripes. ``key_cost`` defaults to
  32: the memory traffic of one copied row (bf16 copies, fp32 sums) against the
  arithmetic of one pair's forward and backward (docs/cost-model.md).
- ``pairs_r`` (reported beside the cost): exact causal work, the sum over the
  rank's query tokens of the keys they see (docs/design.md, "Cost").
- ``keys_read_r`` (reported beside the cost): the distinct keys the rank's pieces
  read, the rows of dK/dV its backward writes (``ops/gathered.py``: the others stay
  zero) and the rows of K/V it needs from the all-gather.
- ``keys_remote_r`` (reported beside the cost): those of them other ranks hold, the
  K/V rows the sparse exchange brings the rank (``comm/exchange.py``).

Head parallelism (``head_parallel = u``, ``cpcompile.attention.heads``/``hybrid``): a rank runs
``1 / u`` of the heads over the pieces of its head group of ``u`` consecutive ranks, their
layouts one after the other (the hybrid), or over the whole pack in physical order
(``u == cp``: whole documents, whose key ranges are disjoint, so the backward copies
none). So its ``pieces``, ``short_cuts`` are its group's, and ``pairs``, ``tiles``,
``key_rows`` its group's divided by ``u`` (rounded up: still integers); ``tokens`` stay
the rank's own (projections and MLP see them alone), and ``keys_read``/``keys_remote``
are the group's keys and those of them other groups hold.

``auto`` rule: evaluate every candidate's predicted step (the slowest rank's cost; with
the model's layer windows, ``StrategySpec.windows``, the sum over the layers of each layer's
slowest rank under its window) and take the smallest; on a tie the earlier candidate wins. Candidates, in order:
no_load_balance, dual_chunk_swap, striped with ``block_q``-token stripes, balanced,
compared as sequence CP; the pick keeps the requested ``kv`` and ``head_parallel``
(:func:`resolve_auto`). This rule never changes ``kv`` or ``head_parallel``: the cost above
has no communication and no head count, which head parallelism trades against (its
all-to-alls move every token's q, k, v and output; ``Hq`` must divide), and both change
the collectives a compiled graph runs. ``auto`` given a topology (``shard_batch(...,
topology=..., heads=...)``) decides them too, with the step-time model:
:func:`cpcompile.cost.timing.resolve` (docs/cost-model.md, "What ``auto`` decides at run time").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from cpcompile.checks import check_cp, check_int, check_offsets
from cpcompile.layouts.balanced import band_tiles, causal_tiles, window_pairs
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import join_runs, layout_runs, padded_offsets, run_pieces
from cpcompile.layouts.reads import piece_reads
from cpcompile.spec import Strategy, StrategyLike, StrategySpec, check_head_parallel, resolve_strategy


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Constants of the step cost model (see the module docstring); all in attention pairs."""

    block_q: int = 128
    block_k: int = 128
    token_cost: int = 128 * 128
    key_cost: int = 32
    causal: bool = True
    window: int = -1  # a causal sliding window's left side (varlen_attn's (window, 0)); -1: none

    def __post_init__(self) -> None:
        check_int("window", self.window, minimum=-1)
        if self.window >= 0 and not self.causal:
            raise ValueError(f"window={self.window} counts causal sliding windows: it needs causal=True")
        check_int("block_q", self.block_q, minimum=1)
        check_int("block_k", self.block_k, minimum=1)
        check_int("token_cost", self.token_cost, minimum=0)
        check_int("key_cost", self.key_cost, minimum=0)
        if self.block_q % self.block_k:
            raise ValueError(f"block_q ({self.block_q}) must be a multiple of block_k ({self.block_k})")


class RankCosts(NamedTuple):
    """Per-rank predictions, each ``[cp]`` int64."""

    tokens: torch.Tensor  # rows held, padding included
    pieces: torch.Tensor  # kernel sequences (docs/design.md, "Pieces and the plan"), padding pieces included
    short_cuts: torch.Tensor  # pieces shorter than block_q that are only part of their document
    pairs: torch.Tensor  # exact attention work
    tiles: torch.Tensor  # kernel tiles visited
    key_rows: torch.Tensor  # keys of all pieces, summed (rows the backward copies)
    keys_read: torch.Tensor  # distinct keys the pieces read (dK/dV rows the backward writes)
    keys_remote: torch.Tensor  # of those, keys other ranks hold (K/V rows the sparse exchange brings)
    cost: torch.Tensor  # tiles * block_q * block_k + token_cost * tokens + key_cost * key_rows

    @property
    def step(self) -> int:
        """Predicted step cost: the slowest rank's."""
        return int(self.cost.max())


def host_values(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (the pack's offsets, argument ``name``) copied to the host to read its values (a host sync on
    CUDA). ``ValueError`` while tracing, where there are no values to read."""
    if is_fake(t) or torch.compiler.is_compiling():
        raise ValueError(
            f"{name} values are needed to predict costs or resolve strategy 'auto', and they are not "
            "available while tracing: resolve 'auto' in the data loader (shard_batch records the choice in "
            "ShardedBatch.spec) and run the model under `with cpcompile.strategy(batch)`"
        )
    return t.detach().cpu()  # a host sync on CUDA


def _tiles(q_len: torch.Tensor, offset: torch.Tensor, doc_len: torch.Tensor, model: CostModel) -> torch.Tensor:
    """Key tiles a piece of ``q_len`` rows visits, its first row ``offset`` tokens into its document."""
    m, n = model.block_q, model.block_k
    if not model.causal:
        return (q_len + m - 1) // m * ((doc_len + n - 1) // n)
    if model.window >= 0:
        return band_tiles(q_len, offset, model.window, m, n)
    return causal_tiles(q_len, offset, m, n)


def predict_rank_costs(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    strategy: StrategyLike = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    model: CostModel | None = None,
) -> RankCosts:
    """Predict every rank's step cost for a packed batch under ``strategy``.

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        strategy: any strategy (``auto`` is resolved first); default the active one. With
            ``head_parallel = u > 1``, per rank of head groups (module docstring).
        cu_seqlens_padded: ``[B + 1]`` int32 physical offsets; default :func:`pad_for_cp`.
        model: the cost constants (default :class:`CostModel`).
    """
    check_cp(cp_size)
    check_offsets(cu_seqlens, cu_seqlens_padded)
    spec = resolve_strategy(strategy)
    check_head_parallel(spec.head_parallel, cp_size)
    return rank_costs(cu_seqlens, cp_size, spec, cu_seqlens_padded, CostModel() if model is None else model)


def rank_costs(
    cu_seqlens: torch.Tensor,
    cp_size: int,
    spec: StrategySpec,
    cu_seqlens_padded: torch.Tensor | None,
    model: CostModel,
    pack: Pack | None = None,
    runs: tuple[torch.Tensor, ...] | None = None,
) -> RankCosts:
    """:func:`predict_rank_costs` of offsets a public entry checked; ``pack``: the pack already laid out by
    ``spec`` (``auto`` resolved), if a caller has it; ``runs``: its layout's runs
    (:func:`cpcompile.layouts.partition.layout_runs`), if a caller has them (then no pack is needed).

    Counted per piece, from the layout's runs: nothing per token but the one pass that finds the runs."""
    cu = host_values("cu_seqlens", cu_seqlens)
    spec = resolve_auto(spec, cu, cp_size=cp_size, model=model)
    padded = None if cu_seqlens_padded is None else host_values("cu_seqlens_padded", cu_seqlens_padded)
    u = spec.head_parallel
    if pack is None and runs is None:  # laid out here, which checks given offsets against the layout
        pack = Pack.build(cu, padded, spec=spec, cp_size=cp_size)
    if pack is not None:
        padded = pack.cu_seqlens_padded  # [B + 1]
    elif padded is None:
        padded = padded_offsets(cu, spec, cp_size)
    total = int(padded[-1])
    tokens = torch.full((cp_size,), total // cp_size, dtype=torch.long)
    # the rows one kernel call runs over, one row per head group: the pack in physical order (u == cp),
    # else the group's layouts one after the other (u == 1: the rank's own), as runs of consecutive
    # positions: a group's runs are its ranks', joined where one ends where the next starts
    whole = u == cp_size > 1
    if whole:
        runs = tuple(torch.tensor([x]) for x in (0, 0, total))
    else:
        runs = layout_runs(pack.layout) if runs is None else runs
        if u > 1:
            runs = join_runs(*runs, u)
    cp_size = 1 if whole else cp_size // u  # from here on, head groups
    pieces = run_pieces(*runs, cu, padded)
    rank, _, q_len, doc, offset, live = pieces  # [P] each: the pieces
    doc_len = (cu[1:] - cu[:-1]).long()[doc]
    w = model.window
    pairs = window_pairs(offset + q_len, w) - window_pairs(offset, w) if model.causal else q_len * doc_len
    keys = (offset if w < 0 else offset.clamp(max=w)) + q_len if model.causal else doc_len
    tiles = _tiles(q_len, offset, doc_len, model)
    short = live & (q_len < model.block_q) & (q_len < doc_len)

    def per_rank(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(cp_size, dtype=torch.long).index_add_(0, rank, x.long())

    tiles_r = per_rank(torch.where(live, tiles, 0))
    live_keys = torch.where(live, keys, 0).long()
    key_rows = per_rank(live_keys)
    # the runs of keys each rank (head group) reads (document prefixes, or windows), and of each the
    # keys it holds itself
    window = (w, 0) if model.causal else (-1, -1)
    reader, lo, hi, held = piece_reads(pieces, cp_size, cu, padded, window)  # [M] each
    by_reader = torch.zeros(cp_size, dtype=torch.long)
    keys_read = by_reader.index_add(0, reader, hi - lo)
    own = by_reader.index_add(0, reader, held)
    if whole:  # whole documents: disjoint key ranges, which the backward reads in place
        key_rows = torch.zeros_like(key_rows)

    def per_head_rank(x: torch.Tensor, share: int = 1) -> torch.Tensor:
        return ((x + share - 1) // share).repeat_interleave(u)  # each of a group's u ranks: its 1 / share

    tiles_r, key_rows = per_head_rank(tiles_r, u), per_head_rank(key_rows, u)
    return RankCosts(
        tokens=tokens,
        pieces=per_head_rank(per_rank(torch.ones_like(rank))),
        short_cuts=per_head_rank(per_rank(short)),
        pairs=per_head_rank(per_rank(torch.where(live, pairs, 0)), u),
        tiles=tiles_r,
        key_rows=key_rows,
        keys_read=per_head_rank(keys_read),
        keys_remote=per_head_rank(keys_read - own),
        cost=tiles_r * (model.block_q * model.block_k) + model.token_cost * tokens + model.key_cost * key_rows,
    )


def auto_candidates(model: CostModel | None = None) -> tuple[StrategySpec, ...]:
    """The strategies ``auto`` chooses from, in tie-breaking order."""
    model = CostModel() if model is None else model
    return (
        StrategySpec(Strategy.NO_LOAD_BALANCE),
        StrategySpec(Strategy.DUAL_CHUNK_SWAP),
        StrategySpec(Strategy.STRIPED, stripe_size=model.block_q),
        StrategySpec(Strategy.BALANCED),
    )


def check_candidates(candidates) -> tuple[StrategySpec, ...]:
    """``candidates`` as a tuple, or a ``ValueError`` unless they are concrete specs, at least one."""
    candidates = tuple(candidates)
    if not candidates or any(not isinstance(c, StrategySpec) or c.strategy is Strategy.AUTO for c in candidates):
        raise ValueError(f"candidates must be a non-empty sequence of concrete StrategySpecs, got {candidates!r}")
    return candidates


def choose_strategy(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    model: CostModel | None = None,
    candidates: tuple[StrategySpec, ...] | None = None,
    windows: tuple[int, ...] = (),
) -> StrategySpec:
    """The ``auto`` rule: the candidate with the lowest predicted step; ties go to the earlier one.

    A pure function of ``(cu_seqlens, cp_size, model, windows)``: every rank gets the same answer.

    Args:
        cu_seqlens: ``[B + 1]`` int32 cumulative real lengths (global).
        candidates: concrete specs to choose from (default :func:`auto_candidates`).
        windows: the model's layers' sliding windows (``StrategySpec.windows``; ``()``: one layer
            as ``model`` counts it). A candidate's step is then the sum over those layers of each
            layer's slowest rank, counted under its window (``model.window`` replaced), and
            ``balanced`` candidates (with ``head_parallel`` 1) are told them.
    Returns:
        The chosen :class:`cpcompile.StrategySpec`. ``python -m cpcompile.advisor`` prints the
        predictions behind it for a whole length distribution.
    """
    check_cp(cp_size)
    check_offsets(cu_seqlens)
    return choose(cu_seqlens, cp_size, CostModel() if model is None else model, candidates, tuple(windows))


def choose(
    cu_seqlens: torch.Tensor,
    cp_size: int,
    model: CostModel,
    candidates: tuple[StrategySpec, ...] | None = None,
    windows: tuple[int, ...] = (),
) -> StrategySpec:
    """:func:`choose_strategy` of offsets a public entry checked."""
    candidates = check_candidates(auto_candidates(model) if candidates is None else candidates)
    if windows:  # balanced told the windows (which StrategySpec checks), where it splits tokens
        told = (c.strategy is Strategy.BALANCED and c.head_parallel == 1 for c in candidates)
        candidates = tuple(dataclasses.replace(c, windows=tuple(windows)) if t else c for c, t in zip(candidates, told))
    steps = [_step(cu_seqlens, cp_size, c, model, tuple(windows)) for c in candidates]
    return candidates[steps.index(min(steps))]


def _step(
    cu_seqlens: torch.Tensor, cp_size: int, spec: StrategySpec, model: CostModel, windows: tuple[int, ...]
) -> int:
    """``spec``'s predicted step: its slowest rank's cost under ``model``, or with ``windows`` the sum
    over the layers of each layer's slowest rank under its window (every layer's collectives wait for
    its slowest rank; a window occurring ``m`` times is costed once, ``m``-fold)."""
    if not windows:
        return rank_costs(cu_seqlens, cp_size, spec, None, model).step
    steps = {
        w: rank_costs(cu_seqlens, cp_size, spec, None, dataclasses.replace(model, window=w)).step for w in set(windows)
    }
    return sum(steps[w] for w in windows)


def resolve_auto(
    spec: StrategySpec, cu_seqlens: torch.Tensor, *, cp_size: int, model: CostModel | None = None
) -> StrategySpec:
    """``spec`` itself, or for ``auto`` the concrete spec :func:`choose_strategy` picks under the
    spec's ``windows``, keeping the requested ``kv``, ``head_parallel``, ``kernel`` and ``kv_chunks`` (the
    layout choice does not change how attention runs). The layouts are compared as sequence CP (``head_parallel``
    1), whatever was requested: the plan ops, which get only the layout's name and the windows,
    resolve ``auto`` alike."""
    if spec.strategy is not Strategy.AUTO:
        return spec
    candidates = None if spec.capacity is None else _fitting(cu_seqlens, cp_size, spec.capacity, model)
    picked = choose(cu_seqlens, cp_size, CostModel() if model is None else model, candidates, spec.windows)
    keep = {f: getattr(spec, f) for f in ("kv", "head_parallel", "kernel", "kv_chunks", "capacity")}
    return dataclasses.replace(picked, **keep)


def _fitting(cu_seqlens: torch.Tensor, cp_size: int, capacity, model: CostModel | None) -> tuple[StrategySpec, ...]:
    """``auto``'s candidates under which the pack fits ``capacity`` (its token count a multiple of what the
    layout pads to, the pack's padding within it): a pack that fits one of them is not refused for
    another that ``auto`` would have picked without the capacity."""
    cu, fitting, reasons = host_values("cu_seqlens", cu_seqlens), [], []  # on the host the fit is checked by value
    for candidate in auto_candidates(model):
        try:
            padded_offsets(cu, dataclasses.replace(candidate, capacity=capacity), cp_size)
        except ValueError as e:
            reasons.append(f"{candidate.strategy.value}: {e}")
        else:
            fitting.append(candidate)
    if not fitting:
        raise ValueError(
            f"strategy 'auto' under capacity={tuple(capacity)} at cp_size={cp_size}: the pack fits none of the "
            f"layouts auto picks from ({'; '.join(reasons)})"
        )
    return tuple(fitting)

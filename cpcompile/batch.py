"""Data-loader side: pad a packed batch for CP and keep one rank's tokens.

The loader and the model must agree on the layout; ``shard_batch`` reads the same
active strategy as the compiled attention unless one is passed (under CP there is no
default). Attention reads only the batch's rows and ``cu_seqlens``, and rows laid out for
another rank or layout of the same token count would attend wrongly without an error, so
attention checks what the rows were laid out for (:class:`~cpcompile.spec.ShardedFor`,
:func:`check_rows`): given as a value, ``with cpcompile.strategy(batch)`` (or
``strategy=batch``), or remembered with the batch's own ``cu_seqlens`` tensor.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cpcompile.cache import on_host, twin, upload
from cpcompile.checks import agreement_enabled, check_cp, check_cu_seqlens, data_checks_enabled
from cpcompile.comm.collectives import all_gather_rows
from cpcompile.comm.groups import agree_on, digest, resolve_group
from cpcompile.cost.comm import Heads
from cpcompile.cost.model import resolve_auto
from cpcompile.cost.timing import H200, Topology, resolve
from cpcompile.layouts.pack import Pack
from cpcompile.layouts.partition import all_partition_indices
from cpcompile.plan.pieces import spec_step_plan
from cpcompile.spec import (
    ShardedFor,
    Strategy,
    StrategyLike,
    StrategySpec,
    block_spec,
    check_head_parallel,
    layout_name,
    note_batch,
    resolve_strategy,
)

#: Padding rows' fill of the label tensors: the index losses ignore (-100, PyTorch's and transformers'),
#: so that no padding row is counted; ``shift_labels`` is the name transformers' loss reads first.
DEFAULT_PAD_VALUES = {"labels": -100, "shift_labels": -100}


@dataclasses.dataclass(frozen=True)
class ShardedBatch:
    """One rank's part of a packed batch.

    - ``tensors``: each input padded and reordered, ``[T_padded / cp_size, ...]``.
    - ``cu_seqlens``, ``cu_seqlens_padded``: ``[B + 1]`` int32, global (whole pack).
    - ``indices``: ``[T_padded / cp_size]`` int64 physical positions of the local rows.
    - ``sharded_for``: what the rows were laid out for (:class:`ShardedFor`), which attention checks
      against its group, layout and offsets: ``with cpcompile.strategy(batch)`` hands it over.
    """

    tensors: dict[str, torch.Tensor]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    indices: torch.Tensor
    spec: StrategySpec
    cp_size: int
    rank: int
    sharded_for: ShardedFor

    @property
    def strategy(self) -> Strategy:
        return self.spec.strategy


def _layout_key(spec: StrategySpec) -> tuple:
    """What of ``spec`` decides the layout (not how attention runs: ``kv``, ``head_parallel``, ``kernel``, ...)."""
    return spec.strategy, spec.stripe_size, spec.windows, spec.capacity


def check_rows(
    cu_seqlens: torch.Tensor,
    cp_size: int,
    rank: int | None,
    spec: StrategySpec,
    rows: ShardedFor | None,
    *,
    required: bool = True,
) -> None:
    """Raise ``ValueError`` unless the rows attention gets were laid out for this CP size, rank (``None``:
    not checked), layout and pack: else they would be another rank's or another layout's, and attention
    over them silently wrong where the token counts happen to fit.

    ``rows``: what the call was told of them (``with cpcompile.strategy(batch)`` or ``strategy=batch``, or
    the last batch ``shard_batch`` made in the block); offsets carry no record of the rank their rows are
    for, so under CP (``cp_size > 1``) a call without ``rows`` is refused (``required=False``: not refused,
    as on the fake process group, whose rows are garbage). ``spec``: attention's strategy (``auto`` is resolved as the
    plan resolves it); another spelling of the same layout (windows in another order, say) passes where
    it gives the pack's rows to the same ranks. The pack is compared where ``cu_seqlens`` can be read
    without a host sync."""
    if not isinstance(rows, ShardedFor):
        if cp_size > 1 and required:
            raise ValueError(
                "attention under context parallelism cannot tell which rank's rows it got: no batch was given. "
                "Run the model inside `with cpcompile.strategy(batch):` (or pass strategy=batch to cp_attention), "
                "batch being this rank's cpcompile.shard_batch result"
            )
        return
    wrong = None
    if rows.cp_size != cp_size:
        wrong = f"cp_size={rows.cp_size}, but the CP group has {cp_size} ranks"
    elif rank is not None and rows.rank != rank:
        wrong = f"rank {rows.rank}, but this is rank {rank} of the CP group"
    elif _layout_key(spec) not in (_layout_key(rows.spec), _layout_key(rows.requested)):
        runs = resolve_auto(spec, cu_seqlens, cp_size=cp_size)  # spec itself unless auto
        if _layout_key(runs) != _layout_key(rows.spec) and not _same_rows(cu_seqlens, cp_size, rows.spec, runs):
            wrong = f"the layout {layout_name(rows.spec)}, but attention runs {layout_name(spec)}"
    if wrong is None and rows.pack is not None:
        given = twin(cu_seqlens) if not data_checks_enabled(cu_seqlens) else cu_seqlens  # no host sync
        if given is not None and not torch.equal(given.to(rows.pack.dtype), rows.pack):
            wrong = (
                "another pack (its cu_seqlens differ from the call's: pass batch.cu_seqlens, which under a capacity "
                "holds the bucket's zero-length documents too)"
            )
    if wrong is not None:
        raise ValueError(
            f"the rows are of a batch that shard_batch laid out for {wrong}: attention over its rows would be "
            "wrong. Shard each rank's batch with the CP group's size and the rank in it (cp_group.size(), "
            "cp_group.rank()), and run the model under `with cpcompile.strategy(batch)` with that batch"
        )


def _same_rows(cu_seqlens: torch.Tensor, cp_size: int, a: StrategySpec, b: StrategySpec) -> bool:
    """Whether layouts ``a`` and ``b`` pad the pack alike and give every rank the same rows. Reads
    ``cu_seqlens`` (a host sync on GPUs without a twin): only where their specs differ."""
    (cu,) = on_host(cu_seqlens)
    try:
        packs = [Pack.build(cu, None, spec=s, cp_size=cp_size) for s in (a, b)]
        if not torch.equal(packs[0].cu_seqlens_padded, packs[1].cu_seqlens_padded):
            return False
        layouts = [p.layout for p in packs]
    except ValueError:  # the pack does not fit one of them (a capacity, a divisibility)
        return False
    return torch.equal(*layouts)


def physical_positions(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """``[T_real]`` int64: where each real token sits in the padded buffer."""
    cu = cu_seqlens.long()
    tokens = torch.arange(int(cu[-1]), device=cu.device)
    doc = torch.searchsorted(cu, tokens, right=True) - 1
    return tokens - cu[doc] + cu_seqlens_padded.long()[doc]


def shard_batch(
    tensors: dict[str, torch.Tensor],
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    rank: int,
    strategy: StrategyLike = None,
    pad_values: dict[str, float | int] | None = None,
    device: torch.device | str | None = None,
    heads: Heads | None = None,
    topology: Topology | str | None = None,
) -> ShardedBatch:
    """Pad each tensor for the strategy and keep rank ``rank``'s rows.

    With ``device``, the batch comes back on it, made ready for a step that reads
    nothing from the GPU: the inputs (on the host) are copied without waiting for the
    stream, ``cu_seqlens`` keeps its host copy (:func:`cpcompile.cache.upload`), and
    the attention plan of compiled calls (``cpcompile::cp_plan``) is made here, ahead
    of the step, on the host (:func:`cpcompile.plan.pieces.step_plan`).

    Args:
        tensors: name -> ``[T, ...]`` with ``T = cu_seqlens[-1]`` (input_ids, labels, ...).
        cu_seqlens: ``[B + 1]`` int32 cumulative real document lengths.
        pad_values: fill value per name for padding rows (default 0; -100 for ``labels`` and ``shift_labels``).
        device: where the step runs (default: where the inputs are).
        strategy: the layout (a strategy or spec; default the active one, ``dual_chunk_swap`` outside every
            :func:`cpcompile.strategy` block). Attention takes no default: run it inside
            ``with cpcompile.strategy(batch)``, which gives it this batch's layout, so the two sides never
            differ. ``auto`` is resolved here and ``ShardedBatch.spec`` holds the strategy it picked: from
            the kernel's work alone (:func:`cpcompile.cost.model.resolve_auto`, under the spec's ``windows``),
            one graph for every pack; or, given ``heads`` or ``topology``, with communication below.
        heads, topology: ``auto`` decides the layout and how K/V move (``kv``: the all-gather, the sparse
            exchange or the ring; with ``heads``, the model's :class:`~cpcompile.cost.comm.Heads`, also head
            parallelism and its ``u``) by each option's predicted layer over ``topology`` (a
            :class:`~cpcompile.cost.timing.Topology` or its text, e.g. ``"h200,gpus_per_node=4"``; default
            ``"h200"``): :func:`cpcompile.cost.timing.resolve`, the same on every rank without communication.
            The batch then runs the decision (``with cpcompile.strategy(batch)`` makes it active, path
            included), and a compiled model compiles once per distinct decision. Unused by other strategies.
            Refused inside a ``with cpcompile.strategy("auto")`` block, whose attention would resolve ``auto``
            again by the kernel's work alone: shard outside it, and run the model under ``strategy(batch)``.
    """
    check_cp(cp_size, rank, rank_given=True)
    requested = resolve_strategy(strategy)
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    if cu_seqlens.device.type == "meta":  # the layout is made from its values
        raise ValueError("cu_seqlens must hold its values (on the host or a device), got a meta tensor")
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError(f"tensors must be a non-empty dict of name -> [T, ...] tensors, got {tensors!r}")
    check_head_parallel(requested.head_parallel, cp_size)
    if pad_values is not None and (
        not isinstance(pad_values, dict) or not all(isinstance(v, (bool, int, float)) for v in pad_values.values())
    ):
        raise ValueError(
            f"pad_values must be a dict of tensor name -> fill value (bool, int, float), got {pad_values!r}"
        )
    fills = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
    unknown = set(pad_values or {}) - set(tensors)
    if unknown:
        raise ValueError(f"pad_values names tensors that are not in tensors: {sorted(unknown)}")
    num_real = int(cu_seqlens[-1]) if data_checks_enabled(cu_seqlens) else None
    for name, t in tensors.items():  # before the decision, which costs host time
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ValueError(f"tensors[{name!r}] must be a tensor with tokens in dim 0, got {t!r}")
        if num_real is not None and t.shape[0] != num_real:
            raise ValueError(f"tensors[{name!r}] has {t.shape[0]} tokens in dim 0, cu_seqlens[-1] is {num_real}")
    if requested.capacity is not None:  # zero-length documents after the last: one shape for the bucket
        cu_seqlens = _to_documents(cu_seqlens, requested.capacity)
    # auto: the strategy picked for this batch, recorded in the result for attention to use; picked
    # from the documents the plan ops see (ShardedBatch.cu_seqlens), which resolve it alike from them
    if heads is None and topology is None:
        spec = resolve_auto(requested, cu_seqlens, cp_size=cp_size)
    else:  # with communication: the batch runs the decision, its path included (ShardedFor.requested)
        if requested.strategy is Strategy.AUTO:
            _check_block_runs_the_decision()
        topology = H200 if topology is None else topology
        spec = resolve(requested, cu_seqlens, cp_size=cp_size, heads=heads, topology=topology)
        if requested.strategy is Strategy.AUTO:
            requested = spec

    pack = Pack.build(cu_seqlens, None, spec=spec, cp_size=cp_size)
    # the rank's row of every rank's positions, as a tensor of its own (a view would keep, and pickle, all)
    cu_padded, indices = pack.cu_seqlens_padded, pack.layout[rank].clone()
    num_padded = int(cu_padded[-1])
    where = physical_positions(cu_seqlens, cu_padded)
    local = {}
    for name, t in tensors.items():
        full = t.new_full((num_padded, *t.shape[1:]), fills.get(name, 0))
        full[where] = t
        local[name] = full[indices]
    (host,) = on_host(cu_seqlens)
    made = ShardedFor(cp_size, rank, spec, requested, host.clone(), indices.shape[0])
    sharded = ShardedBatch(local, cu_seqlens, cu_padded, indices, spec, cp_size, rank, made)
    note_batch(made)  # inside a strategy block: its attention takes this batch's rows
    return sharded if device is None else _to_device(sharded, torch.device(device))


def _check_block_runs_the_decision() -> None:
    """Refuse deciding ``auto`` with communication inside a ``with cpcompile.strategy("auto")`` block: the
    batch runs its decision (layout, path, ``u``), but attention in the block would resolve ``auto`` again
    from the kernel's work alone (a graph is compiled per spec in force, not per batch), so it would run
    another path, or refuse the rows as another layout's."""
    spec = block_spec()
    if spec is not None and spec.strategy is Strategy.AUTO:
        raise ValueError(
            "shard_batch(strategy='auto', heads=/topology=...) inside `with cpcompile.strategy('auto')`: the batch "
            "runs its decision (layout, K/V path, head parallelism), but attention in this block would resolve "
            "'auto' again from the kernel's work alone. Shard outside the block (strategy='auto' by argument) and "
            "run the model under `with cpcompile.strategy(batch)`, which makes the batch's decision the spec"
        )


def _to_documents(cu_seqlens: torch.Tensor, capacity) -> torch.Tensor:
    """``cu_seqlens`` ``[B + 1]`` with zero-length documents after the last, ``[capacity.documents + 1]``."""
    count = cu_seqlens.shape[0] - 1
    if count > capacity.documents:
        raise ValueError(
            f"the pack has {count} documents, more than capacity.documents={capacity.documents}: "
            "use a larger capacity (or bucket)"
        )
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(capacity.documents - count)])


def _to_device(sharded: ShardedBatch, device: torch.device) -> ShardedBatch:
    """``sharded`` on ``device`` with host twins, and its step plan made (see :func:`shard_batch`)."""
    if any(t.device.type != "cpu" for t in (sharded.cu_seqlens, *sharded.tensors.values())):
        raise ValueError(f"shard_batch(device={device}) takes the batch on the host (the data loader's side)")
    cu, cu_padded = (upload(t.contiguous(), device) for t in (sharded.cu_seqlens, sharded.cu_seqlens_padded))
    move = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
    pin = torch.Tensor.pin_memory if device.type == "cuda" else lambda t: t
    tensors = {name: move(pin(t)) for name, t in sharded.tensors.items()}
    spec, cp = sharded.spec, sharded.cp_size
    # the plan compiled calls make (cp_plan, cp_head_plan or cp_hybrid_plan: cu_seqlens alone), here, not in the step
    spec_step_plan(cu, None, cp * sharded.indices.shape[0], cp, sharded.rank, spec)
    return dataclasses.replace(
        sharded, tensors=tensors, cu_seqlens=cu, cu_seqlens_padded=cu_padded, indices=move(pin(sharded.indices))
    )


def unshard(local: torch.Tensor, sharded: ShardedBatch, *, group=None) -> torch.Tensor:
    """All-gather rank-local rows ``[T_padded / cp, ...]`` into physical order ``[T_padded, ...]``.

    Not differentiable; for evaluation, logging and tests.
    """
    pg = resolve_group(group)

    def check() -> torch.Tensor:
        if pg.size() != sharded.cp_size:
            raise ValueError(f"group has {pg.size()} ranks, the batch was sharded for cp_size={sharded.cp_size}")
        if local.shape[0] != sharded.indices.shape[0]:
            raise ValueError(f"local has {local.shape[0]} rows, this rank holds {sharded.indices.shape[0]}")
        return all_partition_indices(
            sharded.cu_seqlens_padded,
            cp_size=sharded.cp_size,
            strategy=sharded.spec,
            num_tokens=sharded.cp_size * local.shape[0],
            cu_seqlens=sharded.cu_seqlens,
        ).to(local.device)

    def record(_layout) -> dict[str, object]:  # what the gather's sizes and the layout depend on
        rows = {"local rows (shape, dtype)": (tuple(local.shape), str(local.dtype))}
        return rows | {
            "the batch's strategy": str(sharded.spec),
            "cu_seqlens_padded": digest(sharded.cu_seqlens_padded),
        }

    # ranks with other batches or rows would gather mismatched sizes (gloo aborts the process)
    layout = agree_on(pg, agreement_enabled(pg, local), check, record)
    gathered = all_gather_rows(local, pg)
    return torch.empty_like(gathered).index_copy_(0, layout.reshape(-1), gathered)

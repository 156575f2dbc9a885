"""What a CP step is told to do, and the block that tells it.

:class:`StrategySpec` carries every choice of a step: the layout (:class:`Strategy`: which
physical tokens each CP rank holds), how K/V move (``kv``, with head parallelism), the kernel,
windows and a capacity. Data loaders (``shard_batch``) and attention (``cp_attention``, the
compiler pass) must agree on it, so both read the same active value from :func:`strategy` unless
one is passed.

Under CP there is no default layout for attention: on a group of more than one rank it raises
unless the layout is given (an argument, or a ``with strategy(...)`` block); ``shard_batch``'s
default (``dual_chunk_swap`` outside every block) reaches attention through the batch itself.
Attention also needs to know which rank of which CP size the rows were laid out for
(:class:`ShardedFor`): ``with strategy(batch)`` gives it as a value, which the call sees however
the batch's tensors were copied since (a block in which ``shard_batch`` ran knows its last batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from typing import NamedTuple

from cpcompile.config import DEFAULTS, KERNELS, KV, check_choice, check_kv_chunks


class Strategy(str, enum.Enum):
    """How a packed buffer is split over CP ranks (values are the accepted strings)."""

    DUAL_CHUNK_SWAP = "dual_chunk_swap"
    NO_LOAD_BALANCE = "no_load_balance"
    STRIPED = "striped"
    #: equal tokens and equal causal work per rank, cut at few places (``cpcompile.layouts.balanced``)
    BALANCED = "balanced"
    #: per batch, the strategy with the lowest predicted step cost (``cpcompile.cost.model.choose_strategy``)
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


#: What the all-gather path's op is told of the sparse exchange (``cost.comm.SETTINGS``) for
#: each way of moving K/V that brings every rank its rows at once (``StrategySpec.kv``).
_EXCHANGE = {"auto": "auto", "all_gather": "never", "exchange": "always"}


_ACCEPTED = ", ".join(repr(s.value) for s in Strategy)


def _to_enum(value: Strategy | str, accepted: str = "a Strategy or a str", more: str = "") -> Strategy:
    """``value`` as a :class:`Strategy`; ``accepted`` and ``more``: what the caller's parameter takes,
    for the error (``StrategySpec`` takes no ``None``; functions taking a ``StrategyLike`` do)."""
    if isinstance(value, Strategy):
        return value
    if isinstance(value, str):
        try:
            return Strategy(value.lower())
        except ValueError:
            raise ValueError(f"strategy must be one of {_ACCEPTED}, got {value!r}") from None
    raise TypeError(f"strategy must be {accepted}, got {type(value).__name__} ({more}the strings: {_ACCEPTED})")


class Capacity(NamedTuple):
    """A bucket of packs with one shape (``StrategySpec.capacity``): at most ``tokens`` tokens and
    ``documents`` documents. :func:`cpcompile.shard_batch` pads a pack to exactly ``tokens`` rows
    (the strategy's padding, then the rest after the last document, rows of no document) and
    ``documents`` documents (zero-length ones after the last), so that every pack of the bucket
    gives the compiled step the same shapes (one graph, one CUDA graph capture); a pack that does
    not fit raises ``ValueError`` naming the capacity."""

    tokens: int
    documents: int


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """Every choice of how CP runs: the layout, how K/V move, the kernel. ``with
    cpcompile.strategy(...)`` makes one active (the way to set it for a compiled model, which is
    guarded on all of it); ``kernel``, ``kv`` and ``kv_chunks`` default to what the environment
    seeded (``cpcompile.config.DEFAULTS``).

    The layout (the loader and attention must share it): ``strategy``; ``stripe_size``, which
    only matters for :attr:`Strategy.STRIPED` (tokens per stripe); ``windows`` and ``capacity``
    below.

    ``kv``, how attention moves K/V (one of :data:`cpcompile.config.KV`); it does not change the
    layout:

    - ``"auto"``: bring each rank the rows it reads once, all-gathered, or exchanged alone where
      ranks read few of the others' (``cpcompile.attention.exchange``);
    - ``"all_gather"`` or ``"exchange"``: always the one of those two;
    - ``"ring"``: pass them around the ring, one rank's block per step (``cpcompile.attention.ring``);
    - ``"heads"``: split attention heads instead of tokens over groups of ``head_parallel``
      (``u > 1``) ranks (DeepSpeed-Ulysses): all-to-alls give each rank every token of ``Hq / u``
      query heads, attention runs on whole documents, and an all-to-all returns the output
      (``cpcompile.attention.heads``). ``u`` must divide the CP size and ``Hq`` (checked where
      they are known: :func:`check_head_parallel`); ``u == cp`` is pure head parallelism,
      ``1 < u < cp`` the hybrid (``cpcompile.attention.hybrid``: heads inside groups of ``u``
      consecutive ranks, the all-gather between the groups).

    ``head_parallel`` is ``u``: 1 unless ``kv="heads"``, which needs ``u > 1``.

    ``kernel``: one of :data:`cpcompile.config.KERNELS`, or ``None``: on CUDA fp16/bf16 ``auto``
    where cudnn-frontend is installed, else ``fa4`` where FlashAttention-4 is, else ``flash``; the
    exact ``reference`` elsewhere. ``kv_chunks``: K/V head groups whose all-gathers are pipelined
    with attention (lowered to a divisor of the K/V head count; 1: one collective each of K and V).

    ``windows`` (``balanced`` and ``auto``): the model's attention layers' sliding windows, the left
    side of each layer's ``window_size=(w, 0)``, -1 for a global (causal) layer, e.g. ``(4096,)``
    for a model windowed throughout, ``(1024, 1024, 1024, 1024, 1024, -1)`` for Gemma 3's pattern:
    ``balanced`` then evens the work of those layers together (a window caps each query's keys),
    and ``auto`` weighs every candidate's work under them (``cost.choose_strategy``), telling
    ``balanced`` them where it picks it. ``()``: every layer causal. It changes the layout, so
    loader and attention must share it.

    ``capacity`` (:class:`Capacity`, or a ``(tokens, documents)`` pair; not with ``kv="heads"``):
    every pack padded to one shape. The layout's padding then ends at ``capacity.tokens`` (the
    rows past the strategy's own padding belong to the last document's padding), and attention
    checks that the batch holds exactly that many tokens; ``None``: the least padding.
    """

    strategy: Strategy = Strategy.DUAL_CHUNK_SWAP
    stripe_size: int = 1
    kv: str = DEFAULTS.kv
    head_parallel: int = 1
    windows: tuple[int, ...] = ()
    capacity: Capacity | None = None
    kernel: str | None = DEFAULTS.kernel
    kv_chunks: int = DEFAULTS.kv_chunks

    def __post_init__(self) -> None:
        # A plain string is accepted as its enum member; anything else is rejected here, so no
        # layout function ever sees a value that matches none of its branches.
        object.__setattr__(self, "strategy", _to_enum(self.strategy))
        if not isinstance(self.stripe_size, int) or isinstance(self.stripe_size, bool) or self.stripe_size < 1:
            raise ValueError(f"stripe_size must be a positive int, got {self.stripe_size!r}")
        if self.strategy is not Strategy.STRIPED and self.stripe_size != 1:
            raise ValueError(
                f"stripe_size={self.stripe_size} only applies to strategy 'striped', not {self.strategy.value!r}"
            )
        check_choice("kv", self.kv, KV)
        check_choice("kernel", self.kernel, (None, *KERNELS))
        check_kv_chunks(self.kv_chunks)
        u = self.head_parallel
        if not isinstance(u, int) or isinstance(u, bool) or u < 1:
            raise ValueError(f"head_parallel must be a positive int (1: no head parallelism), got {u!r}")
        if (self.kv == "heads") != (u > 1):
            raise ValueError(
                f"kv='heads' and head_parallel > 1 go together (head_parallel: the ranks that split heads, the CP "
                f"size for pure head parallelism, a divisor of it for the hybrid; 1 for every other kv), got "
                f"kv={self.kv!r} with head_parallel={u}"
            )
        windows = self.windows
        if not isinstance(windows, (tuple, list)) or any(
            not isinstance(w, int) or isinstance(w, bool) or w < -1 for w in windows
        ):
            raise ValueError(f"windows must be a tuple of ints >= -1 (-1: a global layer), got {windows!r}")
        object.__setattr__(self, "windows", tuple(windows))
        if windows and (self.strategy not in (Strategy.BALANCED, Strategy.AUTO) or u != 1):
            raise ValueError(
                f"windows={tuple(windows)} only applies to strategies 'balanced' and 'auto' with head_parallel=1, "
                f"not {self.strategy.value!r} with head_parallel={u}"
            )
        if self.capacity is not None:
            object.__setattr__(self, "capacity", _capacity(self.capacity))
            if u != 1:
                raise ValueError(f"capacity={tuple(self.capacity)} is not supported with head_parallel={u} yet")

    @property
    def exchange(self) -> str:
        """The all-gather path's sparse exchange setting (``cost.comm.SETTINGS``): ``"never"``
        where ``kv`` does not take that path."""
        return _EXCHANGE.get(self.kv, "never")


def _capacity(value) -> Capacity:
    """``value`` as a :class:`Capacity`, or ``ValueError`` naming what is accepted."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    ok = ok and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value)
    if not ok:
        raise ValueError(
            f"capacity must be a Capacity(tokens, documents) or a (tokens, documents) pair of positive ints, "
            f"got {value!r}"
        )
    return Capacity(*value)


def check_head_parallel(head_parallel: int, cp_size: int, q_heads: int | None = None) -> None:
    """Raise ``ValueError`` unless ``head_parallel`` ranks can split ``q_heads`` query heads over
    a CP group of ``cp_size``: ``head_parallel`` must divide ``cp_size`` and ``q_heads``
    (``None``: not known yet)."""
    if head_parallel != 1 and cp_size % head_parallel:
        raise ValueError(f"head_parallel={head_parallel} must divide the CP size {cp_size} (accepted: a divisor of it)")
    if q_heads is not None and q_heads % head_parallel:  # a symbolic count: guarded on its divisibility
        heads = getattr(getattr(q_heads, "node", None), "hint", None) or q_heads  # a symbolic one's example
        raise ValueError(
            f"head_parallel={head_parallel} must divide the number of query heads {heads} "
            f"(accepted: a divisor of {heads} that divides the CP size {cp_size})"
        )


StrategyLike = Strategy | str | StrategySpec | None

#: The layout of pure layout functions (``partition_indices``, ``pad_for_cp``) given none, as in
#: TransformerEngine; attention and ``shard_batch`` under CP take no default (:func:`layout_in_force`).
DEFAULT_SPEC = StrategySpec()


class ShardedFor(NamedTuple):
    """What :func:`cpcompile.shard_batch` laid a batch's rows out for: the CP size, the rank, the
    layout (``auto`` resolved), the strategy as it was asked for (``auto`` kept; where ``shard_batch`` decided
    ``auto`` with communication, the decision, path included, which attention then runs), and the pack
    (``[B + 1]`` int32 ``cu_seqlens`` on the host, the batch's documents). Attention checks it
    against its group, its layout and its ``cu_seqlens`` (``batch.check_rows``)."""

    cp_size: int
    rank: int
    spec: StrategySpec
    requested: StrategySpec
    pack: object  # torch.Tensor, [B + 1] int32 on the host
    local_rows: int | None = None  # the rank's rows (T_padded / cp_size)


class _Active(NamedTuple):
    spec: StrategySpec | None  # None: no strategy given (outside every block)
    rows: ShardedFor | None  # the block's batch: the one it was entered with, or the last sharded in it
    given: bool = False  # rows is the batch the block was entered with


_active: list[_Active] = [_Active(None, None)]
guard_key = repr(None)  # see _sync_guard_key


def _sharded_for(value: object) -> ShardedFor | None:
    """``value``'s :class:`ShardedFor` where it is a sharded batch (``ShardedBatch.sharded_for``) or one."""
    if isinstance(value, ShardedFor):
        return value
    made = getattr(value, "sharded_for", None)
    return made if isinstance(made, ShardedFor) else None


def layout_name(spec: StrategySpec) -> str:
    """What of ``spec`` decides the layout, as it would be written: ``'striped' (stripe_size=4)``,
    ``'balanced' (windows=(3, -1), capacity=(64, 8))``, ``'dual_chunk_swap'``."""
    parts = [f"stripe_size={spec.stripe_size}"] if spec.strategy is Strategy.STRIPED else []
    parts += [f"windows={spec.windows}"] if spec.windows else []
    parts += [f"capacity={tuple(spec.capacity)}"] if spec.capacity is not None else []
    return repr(spec.strategy.value) + (f" ({', '.join(parts)})" if parts else "")


def resolve_strategy(strategy: StrategyLike = None, *, stripe_size: int | None = None) -> StrategySpec:
    """Turn any accepted strategy argument into a :class:`StrategySpec`.

    ``None`` means the active spec. A plain strategy that names the active one
    keeps the active stripe size, so ``shard_batch(..., strategy="striped")`` inside
    ``with strategy("striped", stripe_size=128)`` cannot disagree with attention.
    """
    if isinstance(strategy, StrategySpec):
        if stripe_size is not None and stripe_size != strategy.stripe_size:
            raise ValueError(f"stripe_size={stripe_size} conflicts with the spec's stripe_size={strategy.stripe_size}")
        return strategy
    rows = _sharded_for(strategy)
    if rows is not None:
        return resolve_strategy(rows.requested, stripe_size=stripe_size)
    active = current_spec()
    if strategy is None:
        spec = active
    else:
        kind = _to_enum(
            strategy, "a Strategy, a str or None", "or a StrategySpec or a ShardedBatch; None: the active strategy; "
        )
        spec = active if active.strategy is kind else StrategySpec(kind)
    if stripe_size is not None and stripe_size != spec.stripe_size:
        spec = dataclasses.replace(spec, stripe_size=stripe_size)
    return spec


def current_strategy() -> Strategy:
    """The strategy in force (``dual_chunk_swap``, :data:`DEFAULT_SPEC`, outside any :func:`strategy` block)."""
    return current_spec().strategy


def current_spec() -> StrategySpec:
    """The strategy in force with its parameters (:data:`DEFAULT_SPEC` outside any :func:`strategy` block)."""
    return _active[-1].spec or DEFAULT_SPEC


def block_spec() -> StrategySpec | None:
    """The spec of the innermost :func:`strategy` block, ``None`` outside every block."""
    return _active[-1].spec


def current_rows() -> tuple[ShardedFor | None, bool]:
    """What the rows of the innermost :func:`strategy` block's batch were laid out for, and whether the
    block was given it (entered with the batch, or inside a block that was) rather than having learned it
    (the last batch :func:`cpcompile.shard_batch` made inside the block, :func:`note_batch`);
    ``(None, False)``: neither, or no block."""
    return _active[-1].rows, _active[-1].given


def note_batch(rows: ShardedFor) -> None:
    """``shard_batch`` made a batch inside the innermost block: the block's attention takes its rows
    (:func:`current_rows`), so ``with strategy("balanced"): batch = shard_batch(...); model(...)``
    is checked like ``strategy(batch)``. A block entered with a batch keeps that one; outside every
    block nothing is kept (no state outlives a block)."""
    if len(_active) > 1 and not _active[-1].given:
        _active[-1] = _active[-1]._replace(rows=rows)


def no_layout_error(what: str) -> ValueError:
    """The error of a CP call given no layout: ``what`` names the call."""
    return ValueError(
        f"{what} has no layout: under context parallelism there is no default, since the loader's rows and "
        "attention must use the same one. Give it by argument (strategy=batch, or strategy='balanced', ...) or "
        "run inside `with cpcompile.strategy(batch):` (batch: the rank's cpcompile.shard_batch result; "
        "cpcompile.strategy('balanced') names a layout alone)"
    )


def layout_in_force(strategy: object, *, cp_size: int, what: str) -> tuple[StrategySpec, ShardedFor | None]:
    """``(spec, rows)`` of a call over a CP group of ``cp_size``: the layout given by argument (a
    strategy, a spec or a sharded batch) or else by the innermost :func:`strategy` block, and what
    the rows were laid out for where known (:class:`ShardedFor`: the argument's batch, or the block's,
    given or learned: :func:`current_rows`).
    Raises :func:`no_layout_error` where ``cp_size > 1`` and neither gives a layout."""
    rows = _sharded_for(strategy)
    if rows is not None:
        return resolve_strategy(rows.requested), rows
    if strategy is None and _active[-1].spec is None and cp_size > 1:
        raise no_layout_error(what)
    return resolve_strategy(strategy), current_rows()[0]


#: What of a spec decides a batch's layout (``strategy(batch)`` keeps the batch's).
_LAYOUT = ("stripe_size", "head_parallel", "windows", "capacity")


@contextlib.contextmanager
def strategy(
    value: object,
    *,
    stripe_size: int | None = None,
    kv: str | None = None,
    head_parallel: int | None = None,
    windows: tuple[int, ...] | None = None,
    capacity: Capacity | tuple[int, int] | None = None,
    kernel: str | None = None,
    kv_chunks: int | None = None,
) -> Iterator[StrategySpec]:
    """Make ``value``, with the keywords given, the active :class:`StrategySpec` inside the ``with`` block.

    ``value``: a :class:`Strategy`, its string value, a :class:`StrategySpec`, or a sharded batch
    (:class:`cpcompile.ShardedBatch`): its strategy as it was asked for, and what its rows were laid
    out for (CP size, rank, layout, pack), which attention inside the block checks against its group
    and ``cu_seqlens`` (a batch of another rank or pack raises on every rank).

    The keywords are :class:`StrategySpec`'s fields (``None``: the spec's, or its default): the
    layout's (``stripe_size``, ``head_parallel``, ``windows``, ``capacity``; not with a batch,
    whose layout they are) and how attention runs (``kv``, ``kernel``, ``kv_chunks``).

    Example::

        with cpcompile.strategy("striped", stripe_size=128, kv="ring"):
            batch = cpcompile.shard_batch(...)   # striped layout
        with cpcompile.strategy(batch):
            loss = compiled_model(batch)         # striped ring attention, rows checked
    """
    given = {"stripe_size": stripe_size, "kv": kv, "head_parallel": head_parallel, "windows": windows}
    given |= {"capacity": capacity, "kernel": kernel, "kv_chunks": kv_chunks}
    given = {name: v for name, v in given.items() if v is not None}
    rows = _sharded_for(value)
    if rows is not None:
        layout = [name for name in _LAYOUT if name in given]
        if layout:
            raise ValueError(
                f"{', '.join(layout)} decide(s) a batch's layout: with strategy(batch) they are the batch's "
                f"({layout_name(rows.requested)}, head_parallel={rows.requested.head_parallel}); pass only kv, "
                "kernel or kv_chunks"
            )
        value = rows.requested
    if isinstance(value, StrategySpec):
        spec = resolve_strategy(value, stripe_size=given.pop("stripe_size", None))
    else:
        spec = StrategySpec(_to_enum(value, "a Strategy, a str, a StrategySpec or a ShardedBatch"))
    spec = dataclasses.replace(spec, **given) if given else spec
    if rows is None:  # a block nested in one that knows its batch (to change kv, say) keeps knowing it
        _active.append(_Active(spec, _active[-1].rows, _active[-1].given))
    else:
        _active.append(_Active(spec, rows, True))
    _sync_guard_key()
    try:
        yield spec
    finally:
        _active.pop()
        _sync_guard_key()


def _sync_guard_key() -> None:
    # The compiler guards compiled graphs on this string (cpcompile.backend), so a
    # graph compiled under one spec is never reused under another; a block's batch is not part
    # of it (every batch of one strategy runs one graph; the plan op checks the batch's rows).
    global guard_key
    guard_key = repr(_active[-1].spec)

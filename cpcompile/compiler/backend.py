"""The ``torch.compile`` backend: shard packed attention, overlap TP matmuls, then ``inner``.

``backend(group=..., inner=...)`` rewrites the Dynamo graph before AOT autograd, so
the inner compiler sees ``cp_plan``/``cp_attention`` (and ``ag_gemm``/``gemm_rs``) ops
with symbolic token counts and traces their backward ops. The strategy is the one active while compiling
(``cpcompile.strategy``). The model code need not mention it (torch's
``varlen_attn`` does not), so the backend adds a Dynamo guard on it: another
strategy compiles, or picks, its own graph, never the old one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from cpcompile.checks import check_int, group_agrees
from cpcompile.comm.groups import agree, held_group, resolve_group
from cpcompile.compiler.shard_attention import check_unsupported, find_packed_attention, shard_attention_pass
from cpcompile.config import DEFAULTS, TP_COMMS, check_choice
from cpcompile.spec import StrategySpec, current_spec, layout_in_force
from cpcompile.tp.rewrite import overlap_matmul_pass

Backend = Callable[[torch.fx.GraphModule, list], Callable]


def _inner_backend(inner: str | Backend) -> Backend:
    if callable(inner):
        return inner
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if isinstance(inner, str):
        from torch._dynamo.backends.registry import list_backends, lookup_backend

        if inner in list_backends(exclude_tags=()):
            return lookup_backend(inner)
    raise ValueError(
        f"inner must be 'inductor', 'aot_eager', another registered backend name or a callable, got {inner!r}"
    )


def _with_inductor_options(compile_inner: Backend, inner, mode: str | None = None, options: dict | None = None):
    """``(compile, cuda_graphs)``. ``torch.compile(..., mode=..., options=...)`` hands a custom backend
    its ``mode`` and ``options``: for inductor they become its config patches, as for
    ``backend="inductor"``; other inner compilers take neither. With CUDA graphs on
    (``mode="reduce-overhead"``, ``triton.cudagraphs`` in ``options`` or inductor's config), inductor's
    graph partitions are turned on: the attention calls that can be captured become
    ``cp_attention_captured`` (``attention.captured``), and cpcompile's other ops (``cache.NOT_CAPTURED``:
    the plan, attention that sizes its work on the host) run between the captured parts, which
    cudagraph trees replay (docs/cuda-graphs.md)."""
    if inner != "inductor":
        if mode is not None or options is not None:
            raise ValueError(
                f"torch.compile's mode={mode!r} and options={options!r} need inner='inductor', got inner={inner!r}: "
                "use inner='inductor', or leave mode and options out"
            )
        return compile_inner, False
    from torch._inductor import config, list_mode_options
    from torch._inductor.compile_fx import compile_fx

    given = {key.replace("-", "_"): value for key, value in (options or {}).items()}  # as torch.compile reads them
    patches = {**(list_mode_options(mode) if mode else {}), **given}
    with config.patch(patches):
        cudagraphs, trees = bool(config.triton.cudagraphs), config.triton.cudagraph_trees
        partitions = getattr(config, "graph_partition", None)
    if cudagraphs:
        on = f"CUDA graphs (mode={mode!r}, options={options!r})"
        if partitions is None:
            raise ValueError(
                f"{on} need inductor's graph partitions, which this torch {torch.__version__} lacks: use torch 2.9 or "
                "later, or leave CUDA graphs off"
            )
        if not partitions:
            raise ValueError(
                f"{on} need inductor's graph_partition=True (cpcompile's ops run between the captured parts), got "
                "False: leave graph_partition out of options and inductor's config, or leave CUDA graphs off"
            )
        if not trees:
            # the plain cudagraphify hands back the same output tensors unmarked: a plan op reading one
            # could be served the previous pack's plan from the per-plan caches (cache.replayed)
            raise ValueError(
                f"{on} need inductor's cudagraph trees (triton.cudagraph_trees=True), got False: leave "
                "triton.cudagraph_trees on, or CUDA graphs off"
            )
        patches["graph_partition"] = True
    return (functools.partial(compile_fx, config_patches=patches) if patches else compile_inner), cudagraphs


#: The ops that lay out a pack over the ranks (``compiler.shard_attention``), as ``str(node.target)`` begins.
_PLAN_OPS = ("cpcompile.cp_plan.", "cpcompile.cp_hybrid_plan.", "cpcompile.cp_head_plan.")


def _check_capturable(gm: torch.fx.GraphModule, spec) -> None:
    """Raise unless every pack of a bucket replays one capture: every size in the graph fixed
    (``dynamic=False``; a symbolic one is recorded anew for each value, pytorch#188150) and, where
    the pass made attention context-parallel, packs padded to a capacity bucket
    (``StrategySpec.capacity``: else the plan's pieces follow each pack's documents)."""
    from torch._dynamo import config as dynamo

    if dynamo.automatic_dynamic_shapes:  # False only under torch.compile(..., dynamic=False)
        raise ValueError(
            "CUDA graphs need torch.compile(..., dynamic=False): with dynamic=None (the default) or True, Dynamo "
            "makes sizes symbolic (at once, or when a pack of another size comes), and each value is captured anew "
            "(pytorch#188150); pad packs to a capacity (cpcompile.StrategySpec(..., capacity=...)) instead"
        )
    symbolic = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        shape = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in shape):
            symbolic.append(node.name)
    if symbolic:
        raise ValueError(
            f"CUDA graphs need fixed sizes (one capture per bucket of packs), got symbolic sizes in the graph's inputs "
            f"{symbolic[:4]}: compile with torch.compile(..., dynamic=False) and pad packs to a capacity "
            "(cpcompile.StrategySpec(..., capacity=cpcompile.layouts.capacity_for(packs, ...)))"
        )
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]  # checkpointed bodies too
    sharded = any(str(n.target).startswith(_PLAN_OPS) for g in graphs for n in g.nodes if n.op == "call_function")
    if sharded and spec.head_parallel > 1:
        raise ValueError(
            f"CUDA graphs need head_parallel=1 under CP (capacity buckets do not take head parallelism yet), got "
            f"head_parallel={spec.head_parallel}: use a sequence layout, or leave CUDA graphs off"
        )
    if sharded and spec.capacity is None:
        raise ValueError(
            f"CUDA graphs need packs padded to a capacity bucket, so that packs of any composition share one capture; "
            f"the active strategy {spec} has none: set StrategySpec(..., "
            "capacity=cpcompile.layouts.capacity_for(packs, ...)) "
            "and shard the batch under it"
        )


def _guard_equals(module: str, attribute: str) -> None:
    """Make the graph being compiled valid only while ``module.attribute`` equals its value now. The
    module is read from ``sys.modules``: a package may re-export another object under the module's
    name (``cpcompile`` re-exports a function named ``strategy``)."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource, DictGetItemSource, ImportSource

    source = DictGetItemSource(AttrSource(ImportSource("sys"), "modules"), module)
    install_guard(AttrSource(source, attribute).make_guard(GuardBuilder.EQUALS_MATCH))


def _guard_on_strategy() -> None:
    """Make the graph being compiled valid only while the current strategy is active."""
    _guard_equals("cpcompile.spec", "guard_key")


def _refuse_suppressed_errors(gm: torch.fx.GraphModule, group) -> Callable | None:
    """Under ``torch._dynamo.config.suppress_errors``, a graph Dynamo fails to compile (the recompile limit
    :func:`_check_recompile_room` enforces, an attention call the pass refuses, the inner compiler's error)
    runs its function eagerly instead, where attention attends within each rank's own tokens: silently
    wrong under CP. So a graph holding attention under a CP group is refused while it is on, by what the
    backend returns: a graph that raises when it runs. An error raised here, while compiling, is what
    suppress_errors swallows. The refusal is shared with the other ranks (:func:`_failure_shared`: a rank
    that has suppress_errors off runs its graph, whose plan op meets this rank's failure), and the graph
    is guarded on the flag: once it is off, the function compiles anew."""
    from torch._dynamo import config as dynamo

    if not dynamo.suppress_errors:
        return None
    pg = resolve_group(group)
    if pg.size() == 1 or not _attends(gm):
        return None
    _guard_on_suppress_errors()
    message = (
        "cpcompile: torch._dynamo.config.suppress_errors is True, under which a graph that fails to compile "
        "runs eagerly, where packed attention attends within each rank's own tokens (wrong under context "
        f"parallelism, group of {pg.size()} ranks): set torch._dynamo.config.suppress_errors = False (and leave "
        "TORCHDYNAMO_SUPPRESS_ERRORS unset) to compile this model for CP"
    )
    with contextlib.suppress(RuntimeError), _failure_shared(pg, True):
        raise RuntimeError(message)

    def refused(*args):
        raise RuntimeError(message)  # a new error each call: one kept here would hold its traceback's frames

    return refused


def _guard_on_suppress_errors() -> None:
    """Make the graph being compiled valid only while ``torch._dynamo.config.suppress_errors`` is as now."""
    _guard_equals("torch._dynamo.config", "suppress_errors")


def _check_recompile_room() -> None:
    """Refuse the last graph Dynamo would compile of a function (``torch._dynamo.config.recompile_limit``):
    past it Dynamo runs the function eagerly, where packed attention attends within each rank's own tokens,
    silently wrong under CP (or an error that does not say why). Each strategy (with its K/V path, windows and
    capacity) compiles a graph of its own, and some shape changes do too, so a training loop can reach the
    limit; refusing the last graph keeps every call of the function compiled."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    count = None if compile_id is None else compile_id.frame_compile_id  # graphs made of this frame before
    limit = torch._dynamo.config.recompile_limit
    if count is not None and count + 1 >= limit:
        raise RuntimeError(
            f"cpcompile: this would be graph {count + 1} that torch.compile makes of one function, and "
            f"torch._dynamo.config.recompile_limit is {limit}: past the limit Dynamo runs the function eagerly, "
            "where packed attention attends within each rank's own tokens (wrong under context parallelism). "
            "Each strategy (its K/V path, windows and capacity) compiles a graph of its own, as do some shape "
            "changes (TORCH_LOGS=recompiles lists them); strategy='auto' decided with a topology "
            "(shard_batch(topology=...)) can pick any of len(cpcompile.cost.timing.options(cp_size, heads)) specs, "
            "a graph each. Raise the limit before the first compile "
            f"(torch._dynamo.config.recompile_limit = {2 * limit}, say) or use fewer strategies per compiled model"
        )


@contextlib.contextmanager
def _failure_shared(pg, share: bool) -> Iterator[None]:
    """Inside: with ``share``, a failure is shared with the other ranks of ``pg`` before it raises, where
    ranks agree (``checks.group_agrees``). A rank whose graph fails to compile alone (grad mode or a
    strategy that differs between ranks) runs none of it, while the others run theirs, whose first CP op,
    the plan op, waits in its agreement for every rank: there it meets this rank's failure, and every
    rank raises (the others ``rank r rejected its arguments (...)``) instead of waiting for the timeout.
    Where every rank fails, each raises its own error after one small gather. ``share`` only for a graph
    that holds packed attention (the others' holds plan ops to meet): a rank that shared a failure of
    another graph would wait in its gather for an agreement that may never come."""
    try:
        yield
    except Exception as error:
        if share and group_agrees(pg):
            agree(pg, error, {})  # raises ``error`` here, once the others have it
        raise


def _attends(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` or a body it calls holds a packed attention call, rewritable or not."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            matches, refused = find_packed_attention(module)
            if matches or refused:
                return True
    return False


def backend(
    *,
    group=None,
    inner: str | Backend = "inductor",
    overlap_tp: bool = True,
    tp_comm: str | None = None,
    tp_capacity_tokens: int | None = None,
    unsupported: str = "raise",
    captured_step: bool = False,
    overlap_kv: bool = False,
) -> Backend:
    """A ``torch.compile`` backend that runs packed attention context-parallel over ``group``.

    Args:
        group: the CP process group, its name, or ``None`` for the default group
            (resolved when a graph is compiled).
        inner: the compiler that gets the rewritten graph: ``"inductor"``,
            ``"aot_eager"``, another registered backend name, or a callable
            ``(gm, example_inputs) -> callable``.
        overlap_tp: rewrite functional-collective all-gather -> matmul and
            matmul -> reduce-scatter (tensor/sequence parallel layers) into the
            overlapped ``ag_gemm`` / ``gemm_rs``; their groups come from the graph.
        tp_comm: how their rings move chunks on CUDA with NCCL, one of
            :data:`cpcompile.config.TP_COMMS`, passed to the ops as an argument; ``None``: the default
            the environment seeded (``cpcompile.config.DEFAULTS``).
        tp_capacity_tokens: the most tokens per TP rank, so overlap buffers are
            allocated once (``None``: they grow to the largest call seen).
        unsupported: a packed attention call CP cannot compute exactly (different query
            and key documents, ``seqused_k``, paged keys, an invalid window):
            ``"raise"`` (default) fails the compile naming it; ``"single_device"``
            leaves it as it is, with a warning, so it attends within each rank's tokens.
        captured_step: the compiled model runs inside :class:`cpcompile.CapturedStep` (a whole step
            captured as one CUDA graph by hand): attention becomes the captured op where it can
            (``attention.captured``), and the checks of CUDA graphs below apply (``dynamic=False``, a
            capacity); attention that cannot be captured raises when the step is captured.
        overlap_kv: move K/V as nodes of the graph (``attention.split``): the K/V transfers start as soon
            as K and V exist and are waited for just before attention, and the backward's dK/dV
            reduce-scatters are waited for where dK and dV are first read (``compiler.overlap``), so the
            graph computes what does not depend on them (the Q projection and RoPE; the dQ path and the
            weight gradients) while they travel. ``kv="exchange"``, and ``kv="auto"`` where the plan picks
            it, move K/V by the sparse exchange, its transfers nodes too (``attention.split_exchange``:
            buffers of the all-gather's rows); ``kv_chunks > 1`` is refused when the graph is compiled, and
            so are CUDA graphs; the ring, head parallelism and the hybrid are unchanged. The waits are
            moved for ``inner="inductor"`` and ``"aot_eager"``; another ``inner`` gets the split graph with
            the backward's waits where autograd puts them (docs/communication.md, "Transfers as graph nodes").

    ``torch.compile``'s ``mode`` and ``options`` reach ``inner="inductor"``. With CUDA graphs
    (``mode="reduce-overhead"``, ``triton.cudagraphs``) the forward and the backward are each
    captured once per bucket of packs and replayed, attention included where it can be
    (``attention.captured``: FA4, all-gather, balanced, dual_chunk_swap or no_load_balance, no window);
    the plan op, and attention that cannot, run between the replays. They need
    ``dynamic=False`` and, under CP, packs padded to a capacity (``StrategySpec.capacity``); else the
    first call fails with Dynamo's ``BackendCompilerFailed`` around a ``ValueError`` saying so
    (docs/cuda-graphs.md).

    Example::

        model = torch.compile(model, backend=cpcompile.backend(group=cp_group), dynamic=True)
    """
    group = held_group(group)  # by name: Dynamo keeps the backend, which must not keep the group alive
    compile_inner = _inner_backend(inner)
    for name, flag in (("captured_step", captured_step), ("overlap_tp", overlap_tp), ("overlap_kv", overlap_kv)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if tp_capacity_tokens is not None:
        check_int("tp_capacity_tokens", tp_capacity_tokens, minimum=1)
    tp_comm = DEFAULTS.tp_comm if tp_comm is None else check_choice("tp_comm", tp_comm, TP_COMMS)
    check_unsupported(unsupported)

    def cpcompile_backend(gm: torch.fx.GraphModule, example_inputs: list, **inductor) -> Callable:
        refused = _refuse_suppressed_errors(gm, group)
        if refused is not None:
            return refused
        compile_rest, cuda_graphs = _with_inductor_options(compile_inner, inner, **inductor)
        if overlap_kv:
            compile_rest = _sinking_waits(inner, compile_rest)
        cuda_graphs = cuda_graphs or captured_step
        if overlap_kv and cuda_graphs:
            raise ValueError(
                "overlap_kv=True is not supported with CUDA graphs (mode='reduce-overhead', triton.cudagraphs or "
                "captured_step): its collectives and waits would straddle the captured parts; use one or the other"
            )
        pg = resolve_group(group)
        rewritten = 0
        spec = current_spec()
        if pg.size() > 1:
            _guard_on_strategy()
            attends = _attends(gm)
            with _failure_shared(pg, attends):
                if attends:  # no default layout under CP: a strategy block must give it
                    layout_in_force(None, cp_size=pg.size(), what="packed attention compiled for a CP group")
                    if overlap_kv:
                        _check_overlap(spec)
                rewritten = shard_attention_pass(
                    gm,
                    group_name=pg.group_name,
                    cp_size=pg.size(),
                    rank=pg.rank(),
                    spec=spec,
                    unsupported=unsupported,
                    captured=cuda_graphs and spec.capacity is not None,
                    overlap_kv=overlap_kv,
                )
        with _failure_shared(pg, rewritten > 0):  # the others' plan ops wait for this rank here too
            if rewritten:
                _check_recompile_room()
            if cuda_graphs:
                _check_capturable(gm, spec)
            if overlap_tp:
                overlap_matmul_pass(gm, capacity_tokens=tp_capacity_tokens, transport=tp_comm)
            return compile_rest(gm, example_inputs)

    return cpcompile_backend


def _check_overlap(spec: StrategySpec) -> None:
    """``overlap_kv`` moves K and V in one transfer each (an all-gather, or the exchange's all-to-all)."""
    if spec.kv_chunks != 1:
        raise ValueError(
            f"overlap_kv=True moves K and V in one transfer each, but the strategy has kv_chunks={spec.kv_chunks}: "
            "use kv_chunks=1, or overlap_kv=False"
        )


def _sinking_waits(inner, compile_inner: Backend) -> Backend:
    """``compile_inner`` with :func:`cpcompile.compiler.overlap.sink_waits` on the graphs AOT autograd makes,
    where ``inner`` is one whose AOT graphs cpcompile reaches (``"inductor"``, ``"aot_eager"``)."""
    from cpcompile.compiler import overlap

    if inner == "aot_eager":
        return overlap.aot_backend()
    if inner != "inductor":
        return compile_inner

    def compile_with_patches(gm, example_inputs, **kwargs):
        from torch._inductor import config

        with config.patch(overlap.inductor_patches()):  # after a pass of the user's, set by now
            return compile_inner(gm, example_inputs, **kwargs)

    return compile_with_patches


def default_backend(gm: torch.fx.GraphModule, example_inputs: list, **inductor) -> Callable:
    """``torch.compile(backend="cpcompile")``: the default process group, inductor (with
    ``torch.compile``'s ``mode`` and ``options``, if given)."""
    return backend()(gm, example_inputs, **inductor)

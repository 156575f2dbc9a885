"""Rewrite packed attention calls in a Dynamo graph into context-parallel attention.

Recognized calls (``find_packed_attention``): ``cpcompile::packed_attention`` and
``torch_attn::_varlen_attn`` (what ``torch.nn.attention.varlen.varlen_attn`` emits;
its schema differs between torch 2.11 and 2.13, so arguments are read by name).
Each becomes ``cpcompile::cp_attention`` (``rewrite_packed_attention``) fed by one
``cpcompile::cp_plan`` per distinct ``(cu_seqlens, cu_seqlens_padded)``: the plan is
built once per step and shared by every layer. With ``spec.comm == "ring"`` it becomes
``cpcompile::cp_ring_attention``, fed by one ``cpcompile::ring_key_ranges`` per plan
and causal flag (the plan's key ranges as rows of every rank's block). A variant the
CP op cannot compute exactly (sliding windows, different query and key offsets,
per-sequence key lengths, paged keys, a used RNG state) raises
:class:`UnsupportedAttentionError` naming the call and the reason: left as it is, it
would attend within each rank's own tokens only, and the model would train wrong.
``unsupported="single_device"`` leaves such calls alone instead, with one warning each,
for users who mean it.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import warnings

import torch
import torch.fx as fx

from ..config import Config, resolve_config
from ..ops import cp_plan as _cp_plan  # noqa: F401  (registers cpcompile::cp_plan)
from ..ops import ring as _ring  # noqa: F401  (registers cpcompile::ring_key_ranges, cp_ring_attention)
from ..plan import AttentionPlan, max_piece_len
from ..strategy import StrategySpec

log = logging.getLogger(__name__)

_PACKED = "cpcompile::packed_attention"
_VARLEN = "torch_attn::_varlen_attn"


@dataclasses.dataclass
class AttentionMatch:
    """One packed attention call that can run as CP attention."""

    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    cu_seqlens: fx.Node
    cu_seqlens_padded: fx.Node | None
    max_seqlen: object  # int, SymInt node or None: a launch bound, never specialized
    causal: bool
    scale: float | None


@dataclasses.dataclass
class Unsupported:
    """A recognized call left as it is, and why."""

    node: fx.Node
    reason: str


#: What the pass does with a recognized call that CP cannot compute exactly.
UNSUPPORTED = ("raise", "single_device")


class UnsupportedAttentionError(ValueError):
    """A packed attention call that CP attention cannot compute exactly."""


def check_unsupported(value: object) -> str:
    if value not in UNSUPPORTED:
        raise ValueError(f"unsupported must be one of {UNSUPPORTED}, got {value!r}")
    return value


def _overload(target) -> torch._ops.OpOverload | None:
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.default
    return target if isinstance(target, torch._ops.OpOverload) else None


def _bound_args(node: fx.Node, op: torch._ops.OpOverload) -> dict[str, object]:
    """The call's arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _used_outputs(node: fx.Node) -> set[int] | None:
    """Indices of the tuple outputs that are read; None if the tuple escapes whole."""
    used = set()
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        used.add(user.args[1])
    return used


def _match_varlen(node: fx.Node, a: dict) -> AttentionMatch | Unsupported:
    window = tuple(a.get("window_size") or (-1, -1))
    causal = bool(a.get("is_causal", False)) or window == (-1, 0)
    used = _used_outputs(node)
    if window not in ((-1, -1), (-1, 0)):
        return Unsupported(node, f"sliding window {window} is not supported under CP")
    if a["cu_seq_q"] is not a["cu_seq_k"]:
        return Unsupported(node, "cu_seq_q and cu_seq_k differ (cross attention); CP needs one set of documents")
    for name in ("seqused_k", "block_table"):
        if a.get(name) is not None:
            return Unsupported(node, f"{name} is not supported under CP")
    if used is None or 2 in used:
        return Unsupported(node, "its RNG state output is used")
    return AttentionMatch(node, a["query"], a["key"], a["value"], a["cu_seq_q"], None, a["max_q"], causal, a["scale"])


def find_packed_attention(gm: fx.GraphModule) -> tuple[list[AttentionMatch], list[Unsupported]]:
    """Packed attention calls of ``gm`` in graph order: the rewritable ones and the rest."""
    matches: list[AttentionMatch] = []
    skipped: list[Unsupported] = []
    for node in gm.graph.nodes:
        op = _overload(node.target) if node.op == "call_function" else None
        name = op.name() if op is not None else None
        if name == _PACKED:
            a = _bound_args(node, op)
            matches.append(
                AttentionMatch(
                    node,
                    a["q"],
                    a["k"],
                    a["v"],
                    a["cu_seqlens"],
                    a["cu_seqlens_padded"],
                    a["max_seqlen"],
                    a["causal"],
                    a["scale"],
                )
            )
        elif name == _VARLEN:
            found = _match_varlen(node, _bound_args(node, op))
            (matches if isinstance(found, AttentionMatch) else skipped).append(found)
    return matches, skipped


def _fake_value(node: fx.Node) -> None:
    """Fill ``meta['example_value']`` of an inserted node, as Dynamo does for its own nodes."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("example_value"))
    node.meta["example_value"] = node.target(*args, **kwargs)


def _max_piece_len(graph: fx.Graph, spec: StrategySpec, cp_size: int, max_seqlen):
    """``max_piece_len`` of a (symbolic) ``max_seqlen``, as graph nodes where it is one."""
    if not isinstance(max_seqlen, fx.Node):
        return None if max_seqlen is None else max_piece_len(spec, cp_size, max_seqlen)
    before = set(graph.nodes)
    bound = max_piece_len(spec, cp_size, fx.Proxy(max_seqlen, fx.proxy.GraphAppendingTracer(graph)))
    for node in graph.nodes:  # the arithmetic just recorded, in order
        if node not in before:
            _fake_value(node)
    return bound.node if isinstance(bound, fx.Proxy) else bound


def rewrite_packed_attention(
    gm: fx.GraphModule,
    matches: list[AttentionMatch],
    *,
    group_name: str,
    cp_size: int,
    rank: int,
    spec: StrategySpec,
    config: Config | None = None,
) -> None:
    """Replace each match with ``cp_attention`` (``cp_ring_attention`` for ``spec.comm == "ring"``),
    one shared ``cp_plan`` per ``cu_seqlens``."""
    graph = gm.graph
    config = resolve_config(config)

    def insert(target, args, name=None, origin=None):
        node = graph.create_node("call_function", target, args, name=name)
        node.meta["stack_trace"] = origin.meta.get("stack_trace") if origin is not None else None
        _fake_value(node)
        return node

    plans: dict[tuple[fx.Node, fx.Node | None], list[fx.Node]] = {}
    ring_ranges: dict[tuple[fx.Node, fx.Node | None, bool], list[fx.Node]] = {}
    for m in matches:
        with graph.inserting_before(m.node):
            key = (m.cu_seqlens, m.cu_seqlens_padded)
            if key not in plans:
                # T = local tokens x cp: symbolic, so one graph serves every batch size
                local = insert(torch.ops.aten.sym_size.int, (m.q, 0), "local_tokens")
                tokens = insert(operator.mul, (local, cp_size), "cp_tokens")
                plan = insert(
                    torch.ops.cpcompile.cp_plan.default,
                    (
                        m.cu_seqlens,
                        m.cu_seqlens_padded,
                        tokens,
                        cp_size,
                        rank,
                        spec.strategy.value,
                        spec.stripe_size,
                    ),
                    "cp_plan",
                    m.node,
                )
                plans[key] = [
                    insert(operator.getitem, (plan, i), field) for i, field in enumerate(AttentionPlan._fields)
                ]
            gather_index, cu_q, k_start, k_len_causal, k_len_full = plans[key]
            k_len = k_len_causal if m.causal else k_len_full
            if spec.comm == "ring":
                ring_key = (*key, m.causal)
                if ring_key not in ring_ranges:
                    ranges = insert(
                        torch.ops.cpcompile.ring_key_ranges.default,
                        (gather_index, k_start, k_len, cp_size),
                        "ring_key_ranges",
                        m.node,
                    )
                    ring_ranges[ring_key] = [
                        insert(operator.getitem, (ranges, i), f"ring_{f}") for i, f in ((0, "start"), (1, "len"))
                    ]
                name, target = "cp_ring_attention", torch.ops.cpcompile.cp_ring_attention.default
                plan_args = (cu_q, *ring_ranges[ring_key])
                config_args = (config.kernel,)
            else:
                name, target = "cp_attention", torch.ops.cpcompile.cp_attention.default
                plan_args = (gather_index, cu_q, k_start, k_len)
                config_args = (config.kernel, config.kv_exchange, config.kv_chunks)
            cp = insert(
                target,
                (
                    m.q,
                    m.k,
                    m.v,
                    *plan_args,
                    group_name,
                    m.causal,
                    m.scale,
                    m.max_seqlen,
                    _max_piece_len(graph, spec, cp_size, m.max_seqlen),
                    *config_args,
                ),
                name,
                m.node,
            )
        m.node.replace_all_uses_with(cp)
        graph.erase_node(m.node)


def shard_attention_pass(
    gm: fx.GraphModule,
    *,
    group_name: str,
    cp_size: int,
    rank: int,
    spec: StrategySpec,
    unsupported: str = "raise",
    config: Config | None = None,
) -> int:
    """Shard every recognized packed attention call of ``gm`` and of the subgraphs its
    higher-order ops call (checkpointed layers' bodies, each with its own ``cp_plan``) over
    the CP group; returns how many.

    ``unsupported``: ``"raise"`` (:class:`UnsupportedAttentionError` for a call CP cannot
    compute exactly) or ``"single_device"`` (leave it, warn: each rank then attends
    within its own tokens only). ``config``: the kernel and K/V transport the inserted
    ops get as arguments (default :func:`cpcompile.config.default_config`).
    """
    # The root graph and the bodies its higher-order ops call (activation checkpointing puts
    # each checkpointed layer in one): a call left in a body would run single-device on a
    # rank's tokens, silently wrong, so every graph is searched and rewritten alike.
    found = [(m, *find_packed_attention(m)) for m in gm.modules() if isinstance(m, fx.GraphModule)]
    skipped = [s for _, _, skips in found for s in skips]
    if skipped and check_unsupported(unsupported) == "raise":
        calls = "; ".join(f"{s.node.format_node()}: {s.reason}" for s in skipped)
        raise UnsupportedAttentionError(
            f"cpcompile cannot run {len(skipped)} packed attention call(s) context-parallel exactly: {calls}. "
            "Use a causal or full window and one cu_seqlens for queries and keys, or pass "
            "cpcompile.backend(..., unsupported='single_device') to run such calls over each rank's own "
            "tokens alone (not the single-device result)."
        )
    for s in skipped:
        warnings.warn(f"cpcompile left {s.node.format_node()} as single-device attention: {s.reason}", stacklevel=2)
    count = 0
    for module, matches, _ in found:
        if not matches:
            continue
        rewrite_packed_attention(
            module, matches, group_name=group_name, cp_size=cp_size, rank=rank, spec=spec, config=config
        )
        module.graph.eliminate_dead_code()
        module.graph.lint()
        module.recompile()
        count += len(matches)
    if not count:
        log.info("shard_attention_pass: no packed attention call to shard")
    return count

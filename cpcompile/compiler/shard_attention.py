"""Rewrite packed attention calls in a Dynamo graph into context-parallel attention.

Recognized calls (``find_packed_attention``): ``cpcompile::packed_attention``,
``torch_attn::_varlen_attn`` (what ``torch.nn.attention.varlen.varlen_attn`` emits),
and flash-attn's own varlen ops ``flash_attn::_flash_attn_varlen_forward`` (flash-attn 2
>= 2.7) and ``flash_attn_3::_flash_attn_forward`` with ``cu_seqlens_q`` (flash-attn 3).
Their schemas differ between versions, so arguments are read by name; flash-attn need
not be installed (the pass only compares op names).
Each becomes ``cpcompile::cp_attention`` (``rewrite_packed_attention``) fed by one
``cpcompile::cp_plan`` per distinct ``(cu_seqlens, cu_seqlens_padded)``: the plan is
built once per step and shared by every layer. With ``spec.kv == "ring"`` it becomes
``cpcompile::cp_ring_attention``, fed by one ``cpcompile::ring_key_ranges`` per plan
and mask (the plan's key ranges as rows of every rank's block). A sliding window
(``window_size``, ``cpcompile.plan.window``) is one ``cpcompile::window_keys`` per plan and window
(each piece's keys within it), and travels in the CP op's arguments (a symbolic window, and
``packed_attention``'s causal flag computed from one, is specialized: its graph is guarded on it). With
``spec.kv == "heads"`` and ``spec.head_parallel == cp`` it becomes ``cpcompile::cp_head_attention`` (head-parallel,
``cpcompile.attention.heads``), fed by one ``cpcompile::cp_head_plan`` per plan; with
``1 < head_parallel < cp``, the hybrid's ``head_all_to_all``s around ``cp_attention`` over
the sequence group, fed by one ``cpcompile::cp_hybrid_plan``. Logit soft-capping (``packed_attention``'s and
flash-attn's ``softcap``) travels in the CP op's ``softcap`` argument, and values of their own head dim
(multi-head latent attention) as they are. A variant the
CP op cannot compute exactly (different query and key offsets, per-sequence key lengths,
paged keys, dropout, ALiBi, a used RNG state, an invalid window) raises
:class:`UnsupportedAttentionError` naming the call and the reason: left as it is, it
would attend within each rank's own tokens only, and the model would train wrong.
Attention ops that have no documents, so the pass cannot split them (``F.scaled_dot_product_attention``,
flex attention, aten's attention ops), are refused the same way under CP: they too would attend
within each rank's tokens. ``unsupported="single_device"`` leaves such calls alone instead, with
one warning each, for users who mean it. The rewrite removes only nodes it added or left unread
(never graph-wide dead-code elimination, which drops Dynamo's in-place calls whose results are unused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import warnings

import torch
import torch.fx as fx

from cpcompile.attention import heads as _heads  # noqa: F401  (registers cpcompile::cp_head_plan, cp_head_attention)
from cpcompile.attention import hybrid as _hybrid  # noqa: F401  (registers cpcompile::cp_hybrid_plan, head_all_to_all)
from cpcompile.attention import plan_op as _plan_op  # noqa: F401  (registers cpcompile::cp_plan)
from cpcompile.attention import ring as _ring  # noqa: F401  (registers cpcompile::ring_key_ranges, cp_ring_attention)
from cpcompile.attention import split as _split  # noqa: F401  (registers cpcompile::cp_attention_split)
from cpcompile.attention import split_exchange as _split_exchange  # noqa: F401  (cp_exchange_fetch, ...)
from cpcompile.attention.api import op_extras, op_window
from cpcompile.attention.captured import LAYERS, capturable
from cpcompile.comm.groups import resolve_group
from cpcompile.comm.heads import head_groups, kv_replication
from cpcompile.config import check_choice
from cpcompile.plan.pieces import AttentionPlan, max_piece_len, plan_extras
from cpcompile.plan.window import UNBANDED, check_window
from cpcompile.spec import StrategySpec, check_head_parallel

log = logging.getLogger(__name__)

_PACKED = "cpcompile::packed_attention"
_VARLEN = "torch_attn::_varlen_attn"
#: Packed attention ops that are recognized but have no CP form yet: refused, with the reason.
_REFUSED = {
    "torch_attn::_varlen_attn_out": "varlen_attn_out writes into a given output buffer; under CP call varlen_attn",
}
_FLASH_ATTN_2 = "flash_attn::_flash_attn_varlen_forward"
#: The outputs of ``cpcompile::window_keys``.
_WINDOW_KEYS = ("window_k_start", "window_k_len", "window_q_pos")
_FLASH_ATTN_3 = "flash_attn_3::_flash_attn_forward"


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
    window: tuple[int, int] = (-1, -1)  # (left, right) of varlen_attn, causal included: (-1, 0) when causal
    sinks: fx.Node | None = None  # packed_attention's [Hq] sink logits: an input of the CP op, so its gradient flows
    softcap: float = 0.0  # logit soft-capping (0: none)

    @property
    def op_extras(self) -> dict:
        """The CP op's ``sinks`` and ``softcap`` keywords, each where it is on."""
        return op_extras(self.sinks, self.softcap)


@dataclasses.dataclass
class Unsupported:
    """A recognized call left as it is, and why."""

    node: fx.Node
    reason: str
    packed: bool = True  # a packed attention call; else another attention op (:func:`_token_mixer`)


_IN_AUTOGRAD_FUNCTION = (
    "it runs inside a torch.autograd.Function's forward (as in flash_attn_varlen_func), whose own backward "
    "CP cannot replace; call the op itself, cpcompile.packed_attention or varlen_attn"
)
#: A call with grad mode off on inputs that require grad: what a Function's forward that Dynamo compiles
#: alone looks like, and also a call under ``torch.no_grad()`` on such inputs; the pass cannot tell them apart.
_GRAD_OFF_ON_GRAD_INPUTS = (
    "it runs with grad mode off on q/k/v that require grad: either inside a torch.autograd.Function's forward "
    "(as in flash_attn_varlen_func), whose own backward CP cannot replace (call the op itself, "
    "cpcompile.packed_attention or varlen_attn), or under torch.no_grad() (pass q, k, v detached there)"
)

#: What the pass does with a recognized call that CP cannot compute exactly.
UNSUPPORTED = ("raise", "single_device")


class UnsupportedAttentionError(ValueError):
    """A packed attention call that CP attention cannot compute exactly."""


def check_unsupported(value: object) -> str:
    return check_choice("unsupported", value, UNSUPPORTED)


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
    """Indices of the tuple outputs that are read (an unpacked, unread output is not); None if the
    tuple escapes whole."""
    used = set()
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        if user.users:
            used.add(user.args[1])
    return used


def _autograd_function_forwards(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The forward bodies of the ``torch.autograd.Function`` calls in ``gm`` and its subgraphs."""
    forwards = []
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply):
            if node.args[0].op == "get_attr":
                forwards.append(getattr(module, node.args[0].target))
    return forwards


def _without_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` that run with grad mode off (it starts in the mode it is compiled in)."""
    enabled, off = torch.is_grad_enabled(), set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif not enabled:
            off.add(node)
    return off


@dataclasses.dataclass(frozen=True)
class _VarlenSchema:
    """How a varlen attention op names what the pass reads; outputs 0 and 1 are ``(out, lse)``,
    lse as ``[heads, tokens]`` float32 like ``cp_attention``'s."""

    q: str
    k: str
    v: str
    cu_q: str
    cu_k: str
    max_q: str
    scale: str
    causal: str
    absent: tuple[str, ...]  # arguments CP cannot honour unless None
    zero: tuple[str, ...]  # arguments CP cannot honour unless 0
    extra_outputs: dict[int, str]  # outputs past (out, lse): CP cannot produce them
    # arguments the rewrite drops that change no result (tuning, GQA, the keys' bound of one set of
    # documents); any other argument a build adds (a vLLM-style FA3's s_aux) is refused unless at its default
    ignored: tuple[str, ...] = ()

    def read(self) -> frozenset[str]:
        """The arguments the rewrite reads, refuses or ignores by name (:func:`_match_varlen`)."""
        mask = ("window_size", "window_size_left", "window_size_right", "softcap")
        fields = (self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_q, self.scale, self.causal)
        return frozenset((*fields, *mask, *self.absent, *self.zero, *self.ignored))


_VARLEN_SCHEMAS = {
    # torch.nn.attention.varlen.varlen_attn
    _VARLEN: _VarlenSchema(
        "query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "scale", "is_causal",
        absent=("seqused_k", "block_table"), zero=(), extra_outputs={2: "RNG state"},
        ignored=("max_k", "enable_gqa", "num_splits"),
    ),
    # flash-attn 2 (>= 2.7): flash_attn/flash_attn_interface.py
    _FLASH_ATTN_2: _VarlenSchema(
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "softmax_scale", "causal",
        absent=("alibi_slopes", "block_table", "leftpad_k", "seqused_k"),
        zero=("dropout_p",),
        extra_outputs={2: "S_dmask", 3: "RNG state"},
        ignored=("max_seqlen_k", "return_softmax", "zero_tensors", "num_splits"),
    ),
    # flash-attn 3: hopper/flash_attn_interface.py (one op for batched and varlen calls)
    _FLASH_ATTN_3: _VarlenSchema(
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "softmax_scale", "causal",
        absent=(
            "k_new", "v_new", "qv", "out_", "cu_seqlens_k_new", "seqused_q", "seqused_k", "page_table",
            "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary",
            "q_descale", "k_descale", "v_descale",
        ),
        zero=("attention_chunk",),
        extra_outputs={2: "out_accum", 3: "softmax_lse_accum"},
        ignored=("max_seqlen_k", "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin"),
    ),
}  # fmt: skip


def _known(value):
    """A scalar argument's value: a graph input's (Dynamo lifts floats such as ``dropout_p`` under
    ``dynamic=True``) is its symbolic example value, which guards the graph on what is compared."""
    if isinstance(value, fx.Node):
        return value.meta.get("example_value", value)
    return [_known(v) for v in value] if isinstance(value, (list, tuple)) else value


def _shown(value) -> str:
    hint = getattr(getattr(value, "node", None), "hint", None)  # a symbolic value's example
    return str(value if hint is None else hint)


def _window(a: dict) -> tuple:
    if "window_size" in a:
        return tuple(_known(a["window_size"]) or (-1, -1))
    return (_known(a.get("window_size_left", -1)), _known(a.get("window_size_right", -1)))


def _unread(op: torch._ops.OpOverload, a: dict, s: _VarlenSchema) -> str | None:
    """Why an argument of ``op`` that ``s`` does not name (one a build of the op adds) keeps the call from
    running under CP: not at its default, which the rewrite would silently drop; else None."""
    for arg in op._schema.arguments:
        if arg.name in s.read() or arg.name not in a:
            continue
        value = _known(a[arg.name])
        default = arg.default_value if arg.has_default_value() else None
        if (value is not None) if default is None else (value != default):
            return f"{arg.name}={_shown(value)} is not supported under CP (the rewrite would drop it)"
    return None


def _match_varlen(node: fx.Node, a: dict, s: _VarlenSchema, op: torch._ops.OpOverload) -> AttentionMatch | Unsupported:
    """A varlen call of schema ``s`` (arguments ``a`` by name) as CP attention, or why it cannot be one."""
    window = _window(a)
    used = _used_outputs(node)
    try:
        # the kernels and the plan need the window's value: a symbolic one (an int Dynamo lifted to an
        # input) is specialized here, its graph guarded on it (another window compiles another graph)
        window = tuple(int(w) if isinstance(w, torch.SymInt) else w for w in window)
        check_window(window)
    except (TypeError, ValueError) as e:
        return Unsupported(node, str(e))
    causal = bool(_known(a.get(s.causal, False))) or window[1] == 0  # a causal kernel ends every window at its query
    window = (window[0], 0) if causal else window
    if a[s.cu_q] is not a[s.cu_k]:
        return Unsupported(node, f"{s.cu_q} and {s.cu_k} differ (cross attention); CP needs one set of documents")
    for name in s.absent:
        if a.get(name) is not None:
            return Unsupported(node, f"{name} is not supported under CP")
    for name in s.zero:
        if (value := _known(a.get(name, 0))) != 0:
            return Unsupported(node, f"{name}={_shown(value)} is not supported under CP")
    if (why := _unread(op, a, s)) is not None:
        return Unsupported(node, why)
    if used is None:
        return Unsupported(node, "its output tuple is used whole; CP attention gives only out and lse")
    for index, output in s.extra_outputs.items():
        if index in used:
            return Unsupported(node, f"its {output} output is used")
    softcap = _softcap(a)
    if isinstance(softcap, str):
        return Unsupported(node, softcap)
    args = (a[s.q], a[s.k], a[s.v], a[s.cu_q], None, a[s.max_q], causal, a[s.scale], window)
    return AttentionMatch(node, *args, softcap=softcap)


def _softcap(a: dict) -> float | str:
    """A call's ``softcap`` (0.0 where it has none), specialized as a window is (a symbolic one guards the
    graph on its value), or why it is no soft-capping CP runs."""
    value = _known(a.get("softcap", 0.0))
    value = 0.0 if value is None else value
    try:
        value = float(value)
    except (TypeError, ValueError):
        return f"softcap={_shown(value)} is not a number"
    if not value >= 0 or value == float("inf"):
        return f"softcap={value} is not supported: 0 (none) or a finite positive cap"
    return value


def _match_packed(node: fx.Node, a: dict) -> AttentionMatch | Unsupported:
    """A ``cpcompile::packed_attention`` call (arguments ``a`` by name) as CP attention.

    Its mask is read as values, never as graph nodes: a window passed to a compiled function makes
    Dynamo lift its ints to inputs, and ``causal`` then reaches the op as a symbolic bool (``window[1]
    == 0``, a node). Both are specialized here, as :func:`_match_varlen` does the window (``bool`` and
    ``int`` of a symbolic value guard the graph on it: another window compiles another graph)."""
    causal, left, right = _known([a["causal"], a["window_left"], a["window_right"]])
    try:
        if not isinstance(causal, (bool, torch.SymBool)):
            raise TypeError(f"causal must be a bool, got {_shown(causal)}")
        causal = bool(causal)
        window = check_window(tuple(int(w) if isinstance(w, torch.SymInt) else w for w in (left, right)))
    except (TypeError, ValueError) as e:
        return Unsupported(node, str(e))
    args = (a[n] for n in ("q", "k", "v", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"))
    softcap = _softcap(a)
    if isinstance(softcap, str):
        return Unsupported(node, softcap)
    window = op_window(causal, *window)
    return AttentionMatch(node, *args, causal, a["scale"], window=window, sinks=a.get("sinks"), softcap=softcap)


def find_packed_attention(gm: fx.GraphModule) -> tuple[list[AttentionMatch], list[Unsupported]]:
    """Packed attention calls of ``gm`` in graph order: the rewritable ones and the rest."""
    matches: list[AttentionMatch] = []
    skipped: list[Unsupported] = []
    without_grad = _without_grad(gm)
    for node in gm.graph.nodes:
        op = _overload(node.target) if node.op == "call_function" else None
        name = op.name() if op is not None else None
        if name == _PACKED:
            a = _bound_args(node, op)
            found, qkv = _match_packed(node, a), ("q", "k", "v")
        elif name in _VARLEN_SCHEMAS:
            a = _bound_args(node, op)
            if a.get("cu_seqlens_q", node) is None:
                continue  # flash-attn 3 on batched (padded) inputs: not a packed call
            schema = _VARLEN_SCHEMAS[name]
            found, qkv = _match_varlen(node, a, schema, op), (schema.q, schema.k, schema.v)
        elif name in _REFUSED:
            skipped.append(Unsupported(node, _REFUSED[name]))
            continue
        elif (reason := _token_mixer(node)) is not None:
            skipped.append(Unsupported(node, reason, packed=False))
            continue
        else:
            continue
        # Grad off on inputs that require it: the forward of an autograd.Function that Dynamo
        # compiles alone (flash_attn_varlen_func given one cu_seqlens tensor twice does so), or a
        # call under torch.no_grad() on such inputs: refused either way, the message names both
        if node in without_grad and any(getattr(_known(a[n]), "requires_grad", False) for n in qkv):
            found = Unsupported(node, _GRAD_OFF_ON_GRAD_INPUTS)
        (matches if isinstance(found, AttentionMatch) else skipped).append(found)
    return matches, skipped


def _token_mixer(node: fx.Node) -> str | None:
    """Why ``node`` cannot run under CP, where it is an attention op that the pass cannot make
    context-parallel (it has no documents: SDPA, flex attention and aten's attention ops); else None.
    Left as it is, it would attend within each rank's own tokens: the model would train wrong."""
    if node.op != "call_function":
        return None
    target, op = node.target, _overload(node.target)
    if target is torch.nn.functional.scaled_dot_product_attention:
        what = "F.scaled_dot_product_attention"
    elif isinstance(target, torch._ops.HigherOrderOperator) and target.name() == "flex_attention":
        what = "flex_attention"
    elif op is not None and op.name().startswith("aten::") and "attention" in op.name():
        what = op.name()
    else:
        return None
    return (
        f"{what} is not packed attention, and CP cannot split it (it would attend within each rank's own tokens "
        "alone): call cpcompile.packed_attention or torch.nn.attention.varlen.varlen_attn with the pack's "
        'cu_seqlens instead (a transformers model: attn_implementation="cpcompile")'
    )


def _describe_call(m: AttentionMatch, op: str, spec: StrategySpec) -> str:
    """What call ``m`` makes of its plan, for the ranks to compare in the plan op, the step's one
    agreement (the attention ops compare nothing again): the op it became, its mask, whether autograd
    runs its backward (its output requires grad: Dynamo's fake values follow the grad mode and the
    inputs'), q's and k's heads and head_dim where they are constants of the graph (a symbolic one, of
    q given as the graph's input, is not: later calls' q is computed after the plan), the dtype, the
    scale and the kernel and K/V transport."""
    out = m.node.meta.get("example_value")
    out = out[0] if isinstance(out, (tuple, list)) else out
    q, k, v = (x.meta.get("example_value") for x in (m.q, m.k, m.v))
    mask = {(-1, 0): "causal", (-1, -1): "full"}.get(m.window, f"window {m.window}")
    mask += f", softcap {m.softcap}" if m.softcap else ""
    dims = () if q is None or k is None or v is None else (q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    heads = ", heads {}/{} x {}/{}".format(*dims) if dims and all(isinstance(d, int) for d in dims) else ""
    dtype = heads + ("" if q is None else f", {q.dtype}")
    transport = f"kernel {spec.kernel}, kv {spec.kv}, kv_chunks {spec.kv_chunks}"
    backward = "backward" if getattr(out, "requires_grad", False) else "no backward"
    sinks = ", sinks" if m.sinks is not None else ""
    return f"{op}: {mask}{sinks}, {backward}{dtype}, scale {m.scale}, {transport}"


def _symbolic_dims(m: AttentionMatch, symbols: dict) -> list[fx.Node]:
    """The graph's inputs that hold call ``m``'s heads and head dims (q's and k's heads, q's and v's head
    dims, as :func:`_describe_call` writes them) where they are symbols: q, k, v given as the graph's inputs
    with dynamic shapes. The plan op compares their values (``dims``), which the call's text cannot hold.
    ``symbols``: the graph's placeholder of each symbol. A dim that is an expression of symbols, not one,
    is left out (it is computed after the inputs, not given: such heads come of constants of the model)."""
    q, k, v = (x.meta.get("example_value") for x in (m.q, m.k, m.v))
    if q is None or k is None or v is None:
        return []
    dims = (q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    return [symbols[d.node.expr] for d in dims if isinstance(d, torch.SymInt) and d.node.expr in symbols]


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


def _insert_hybrid(insert, m: AttentionMatch, plan, spec: StrategySpec, cp_size: int, group_name: str):
    """The hybrid's ops for match ``m`` (``cpcompile.attention.hybrid``): K/V heads replicated, the head
    all-to-alls inside the rank's head group around ``cp_attention`` between the groups; returns
    the nodes of the outputs the graph reads, by index: the output, and ``lse`` where it is read
    (``[Hq / u, u T_local]`` from ``cp_attention``, back over the heads to ``[Hq, T_local]``)."""
    u = spec.head_parallel
    q_heads, kv_heads = m.q.meta["example_value"].shape[1], m.k.meta["example_value"].shape[1]
    check_head_parallel(u, cp_size, q_heads)
    heads, sequence = (g.group_name for g in head_groups(resolve_group(group_name), u))
    f = kv_replication(q_heads, kv_heads, u)
    a2a = torch.ops.cpcompile.head_all_to_all.default
    qkv = [m.q, m.k, m.v]
    if f > 1:
        qkv[1:] = [insert(torch.ops.aten.repeat_interleave.self_int, (x, f, 1), "kv_copies", m.node) for x in qkv[1:]]
    qkv = [insert(a2a, (x, heads, True, group_name), "heads_to_tokens", m.node) for x in qkv]
    kv = (spec.kernel, "never", 1)  # the all-gather: the exchange is for one rank's pieces, not a group's
    args = (*qkv, *plan, sequence, m.causal, m.scale, m.max_seqlen, m.max_seqlen, *kv)
    sinks = None
    if m.sinks is not None:  # those of the heads this rank holds between the all-to-alls (sinks.head_slice)
        parts = insert(torch.ops.aten.unflatten.int, (m.sinks, 0, [u, -1]), "sinks_per_rank", m.node)
        j = resolve_group(heads).rank()
        sinks = insert(torch.ops.aten.select.int, (parts, 0, j), "hybrid_sinks", m.node)
    named = op_extras(sinks, m.softcap) or None
    cp = insert(torch.ops.cpcompile.cp_attention.default, args, "cp_attention", m.node, named)
    out = insert(operator.getitem, (cp, 0), "hybrid_out", m.node)
    outputs = {0: insert(a2a, (out, heads, False, group_name), "tokens_to_heads", m.node)}
    if 1 in _used_outputs(m.node):  # a tuple used whole is no match: its read outputs are known
        lse = insert(operator.getitem, (cp, 1), "hybrid_lse", m.node)
        rows = insert(torch.ops.aten.unsqueeze.default, (insert(torch.ops.aten.t.default, (lse,)), -1), "lse_rows")
        back = insert(a2a, (rows, heads, False, group_name), "lse_to_heads", m.node)  # [T_local, Hq, 1]
        outputs[1] = insert(torch.ops.aten.t.default, (insert(torch.ops.aten.squeeze.dim, (back, -1)),), "lse")
    return outputs


def rewrite_packed_attention(
    gm: fx.GraphModule,
    matches: list[AttentionMatch],
    *,
    group_name: str,
    cp_size: int,
    rank: int,
    spec: StrategySpec,
    captured: bool = False,
    overlap_kv: bool = False,
) -> None:
    """Replace each match with ``cp_attention`` (``cp_ring_attention`` for ``spec.kv == "ring"``,
    ``cp_head_attention`` for ``spec.kv == "heads"``), one shared plan per ``cu_seqlens``; the ops
    get ``spec``'s kernel and K/V transport as arguments.

    ``overlap_kv``: a ``cp_attention`` call becomes its transfers as graph nodes, started as soon as
    K and V exist (after the plan, whose agreement comes first), their waits, and attention over what
    they brought: under ``kv="all_gather"`` the all-gathers and ``cp_attention_split``
    (``attention.split``), else ``cp_exchange_fetch`` and ``cp_attention_exchange``
    (``attention.split_exchange``: the exchange, or the all-gather where the plan picks it). Ring,
    head-parallel, hybrid and captured calls stay as they are.

    ``captured`` (CUDA graphs on, packs padded to a capacity): calls that can be captured become
    ``cp_attention_captured`` (``attention.captured.capturable``; the others stay as above, between the
    captured parts), and their plans are made at the start of the graph, right after their inputs,
    so that the plan op (kept out of CUDA graphs) does not cut the captured forward in two."""
    graph = gm.graph
    own, freed = set(graph.nodes), []  # the graph's nodes before the rewrite; the replaced calls' inputs
    heads = spec.head_parallel > 1
    hybrid = 1 < spec.head_parallel < cp_size
    order = {n: i for i, n in enumerate(graph.nodes)}

    def first_after(*inputs) -> fx.Node:
        """The first node after ``inputs`` that is not a placeholder (the graph's first, where none of
        them is a node)."""
        nodes = [n for n in inputs if isinstance(n, fx.Node)]
        point = max(nodes, key=order.__getitem__).next if nodes else next(iter(graph.nodes))
        while point.op == "placeholder":
            point = point.next
        return point

    def in_capture(m: AttentionMatch) -> bool:
        if not captured or heads:
            return False
        q = m.q.meta["example_value"]
        # a symbolic token count (dynamic shapes) cannot be captured: _check_capturable then says so
        why = "its token count is symbolic" if isinstance(q.shape[0], torch.SymInt) else None
        why = why or ("it has sinks, which the captured op does not take" if m.sinks is not None else None)
        why = why or ("soft-capping (captured: plain attention)" if m.softcap else None)
        why = why or capturable(spec, q, spec.kernel, m.window, v=m.v.meta["example_value"])
        if why is not None:
            log.info("%s stays out of the CUDA graph: %s", m.node.format_node(), why)
        return why is None

    def insert(target, args, name=None, origin=None, kwargs=None):
        node = graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta["stack_trace"] = origin.meta.get("stack_trace") if origin is not None else None
        _fake_value(node)
        return node

    plans: dict[tuple[fx.Node, fx.Node | None], list[fx.Node]] = {}
    calls: dict[tuple[fx.Node, fx.Node | None], list[str]] = {}  # per plan, what each call makes of it
    dims: dict[tuple[fx.Node, fx.Node | None], list[fx.Node]] = {}  # per plan, its calls' symbolic heads
    symbols = {
        n.meta["example_value"].node.expr: n
        for n in graph.find_nodes(op="placeholder")
        if isinstance(n.meta.get("example_value"), torch.SymInt)
    }
    ring_ranges: dict[tuple, list[fx.Node]] = {}
    window_keys: dict[tuple, list[fx.Node]] = {}

    for m in matches:
        captured_call = in_capture(m)
        split = overlap_kv and not (heads or captured_call or spec.kv == "ring")
        # a split call's all-gathers start right after K, V and the offsets, and its plan (if it is the
        # first) is made before them, so that its agreement runs before any collective
        plan_at = first_after(m.k, m.v, m.cu_seqlens, m.cu_seqlens_padded) if split else m.node
        with graph.inserting_before(m.node):
            key = (m.cu_seqlens, m.cu_seqlens_padded)
            if key not in plans and captured_call:  # the token count is a constant: no node reads q
                tokens = m.q.meta["example_value"].shape[0] * cp_size
                with graph.inserting_before(first_after(m.cu_seqlens, m.cu_seqlens_padded)):
                    plan = insert(
                        torch.ops.cpcompile.cp_plan.default,
                        (m.cu_seqlens, m.cu_seqlens_padded, tokens, cp_size, rank, spec.strategy.value,
                         spec.stripe_size, *[list(x) for x in plan_extras(spec)], LAYERS[spec.strategy]),
                        "cp_plan",
                        m.node,
                        {"group_name": group_name},
                    )  # fmt: skip
                    plans[key] = [
                        insert(operator.getitem, (plan, i), field) for i, field in enumerate(AttentionPlan._fields)
                    ]
            if key not in plans:
                with graph.inserting_before(plan_at):
                    # T = local tokens x cp: symbolic, so one graph serves every batch size (k's: made before q may be)
                    local = insert(torch.ops.aten.sym_size.int, (m.k if split else m.q, 0), "local_tokens")
                    tokens = insert(operator.mul, (local, cp_size), "cp_tokens")
                    layout = (spec.strategy.value, spec.stripe_size)
                    if hybrid:  # the rank's head group's pieces
                        target = torch.ops.cpcompile.cp_hybrid_plan.default
                        plan_args = (cp_size, spec.head_parallel, rank, *layout)
                    elif heads:  # the same plan on every rank: the layout's order, whole documents
                        target, plan_args = torch.ops.cpcompile.cp_head_plan.default, (cp_size, *layout)
                    else:  # windows and capacity only where set: a spec without them calls the op with its defaults
                        extras = [list(x) for x in plan_extras(spec)]
                        target, plan_args = torch.ops.cpcompile.cp_plan.default, (cp_size, rank, *layout, *extras)
                    # the ranks agree on the pack in the plan op: see attention.plan_op.agree_on_plan
                    plan_args = (m.cu_seqlens, m.cu_seqlens_padded, tokens, *plan_args)
                    plan = insert(target, plan_args, target._opname, m.node, {"group_name": group_name})
                    plans[key] = [
                        insert(operator.getitem, (plan, i), field) for i, field in enumerate(AttentionPlan._fields)
                    ]
            gather_index, cu_q, k_start, k_len_causal, k_len_full, pack_cu, pack_padded = plans[key]
            k_len = k_len_causal if m.causal else k_len_full
            q_pos = None
            if m.window not in UNBANDED:
                if heads:
                    raise ValueError(
                        f"{m.node.format_node()}: window_size={m.window} is not supported with head_parallel > 1"
                    )
                window_key = (*key, m.window)
                if window_key not in window_keys:
                    # before a split call's transfers, which the exchange's read the windowed pieces for
                    point = graph.inserting_before(plan_at) if split else contextlib.nullcontext()
                    with point:
                        keys = insert(
                            torch.ops.cpcompile.window_keys.default,
                            (cu_q, k_start, k_len_causal, k_len_full, *m.window),
                            "window_keys",
                            m.node,
                        )
                        window_keys[window_key] = [
                            insert(operator.getitem, (keys, i), f) for i, f in enumerate(_WINDOW_KEYS)
                        ]
                k_start, k_len, q_pos = window_keys[window_key]
            op_kwargs = None
            if hybrid:
                name = "head_all_to_all + cp_attention (hybrid)"
                cp = _insert_hybrid(insert, m, (gather_index, cu_q, k_start, k_len), spec, cp_size, group_name)
            elif heads:
                name = "cp_head_attention"
                check_head_parallel(spec.head_parallel, cp_size, m.q.meta["example_value"].shape[1])
                args = (m.q, m.k, m.v, gather_index, cu_q, k_start, k_len, group_name, m.causal, m.scale)
                cp = insert(
                    torch.ops.cpcompile.cp_head_attention.default,
                    (*args, m.max_seqlen, spec.kernel),
                    "cp_head_attention",
                    m.node,
                    m.op_extras or None,
                )
            elif captured_call:
                name, target = "cp_attention_captured", torch.ops.cpcompile.cp_attention_captured.default
                plan_args = (gather_index, cu_q, k_start, k_len)
                config_args = (spec.kernel, spec.kv_chunks, LAYERS[spec.strategy])
            elif spec.kv == "ring":
                banded = m.window not in UNBANDED
                ring_key = (*key, m.window)
                if ring_key not in ring_ranges:
                    # with a window, the blocks' positions too: a window is placed by them
                    target, fields = (
                        (torch.ops.cpcompile.ring_window_plan.default, ("start", "len", "positions"))
                        if banded
                        else (torch.ops.cpcompile.ring_key_ranges.default, ("start", "len"))
                    )
                    ranges = insert(target, (gather_index, k_start, k_len, cp_size), target._opname, m.node)
                    ring_ranges[ring_key] = [
                        insert(operator.getitem, (ranges, i), f"ring_{f}") for i, f in enumerate(fields)
                    ]
                name, target = "cp_ring_attention", torch.ops.cpcompile.cp_ring_attention.default
                plan_args = (cu_q, *ring_ranges[ring_key][:2])
                config_args = (spec.kernel,)
                if banded:
                    config_args += (q_pos, ring_ranges[ring_key][2], *m.window)
            elif split and spec.exchange != "never":  # the exchange where the plan picks it (attention.split_exchange)
                name, target = "cp_attention_exchange", torch.ops.cpcompile.cp_attention_exchange.default
                transfer = (gather_index, k_start, k_len, group_name, spec.exchange, *m.window, pack_cu, pack_padded)
                with graph.inserting_before(plan_at):  # started as soon as K and V exist
                    kv = [insert(torch.ops.aten.detach.default, (x,), f"{x.name}_to_fetch") for x in (m.k, m.v)]
                    fetch = insert(torch.ops.cpcompile.cp_exchange_fetch.default, (*kv, *transfer), "kv_fetch", m.node)
                    pending = [
                        insert(operator.getitem, (fetch, i), f"{x.name}_fetch") for i, x in enumerate((m.k, m.v))
                    ]
                fetched = [insert(torch.ops._c10d_functional.wait_tensor.default, (p,), f"{p.name}ed") for p in pending]
                plan_args = (gather_index, cu_q, k_start, k_len)
                config_args = (spec.kernel, spec.exchange, None if m.causal else q_pos, *m.window, pack_cu, pack_padded)
                qkv = (m.q, m.k, m.v, *fetched)
            elif split:
                name, target = "cp_attention_split", torch.ops.cpcompile.cp_attention_split.default
                with graph.inserting_before(plan_at):  # started as soon as K and V exist
                    pending = [
                        insert(
                            torch.ops._c10d_functional.all_gather_into_tensor.default,
                            (insert(torch.ops.aten.detach.default, (x,), f"{x.name}_to_gather"), cp_size, group_name),
                            f"{x.name}_gather",
                            m.node,
                        )
                        for x in (m.k, m.v)
                    ]
                gathered = [
                    insert(torch.ops._c10d_functional.wait_tensor.default, (p,), f"{p.name}ed") for p in pending
                ]
                plan_args = (gather_index, cu_q, k_start, k_len)
                config_args = (spec.kernel,)
                if m.window not in UNBANDED:
                    config_args += (None if m.causal else q_pos, *m.window)
                qkv = (m.q, m.k, m.v, *gathered)
            else:
                name, target = "cp_attention", torch.ops.cpcompile.cp_attention.default
                plan_args = (gather_index, cu_q, k_start, k_len)
                config_args = (spec.kernel, spec.exchange, spec.kv_chunks)
                if m.window not in UNBANDED:  # bottom-right aligned when causal: no positions
                    config_args += (None if m.causal else q_pos, *m.window)
                # the pack the plan was made from: the sparse exchange derives every rank's reads from it
                op_kwargs = {"cu_seqlens": pack_cu, "cu_seqlens_padded": pack_padded}
            if not heads:
                cp = insert(
                    target,
                    (
                        *(qkv if split else (m.q, m.k, m.v)),
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
                    (op_kwargs or {}) | m.op_extras or None,
                )
            calls.setdefault(key, []).append(_describe_call(m, name, spec))
            dims.setdefault(key, []).extend(_symbolic_dims(m, symbols))
            if split:
                _defer_query_path(graph, m.q, pending)
        for user in [u for u in m.node.users if not u.users]:  # unpacked, unread: maybe past cp's outputs
            graph.erase_node(user)
        if hybrid:  # nodes of their own, not a tuple: their readers read them directly
            for user in list(m.node.users):
                user.replace_all_uses_with(cp[user.args[1]])
                graph.erase_node(user)
        m.node.replace_all_uses_with(cp)
        freed += m.node.all_input_nodes
        graph.erase_node(m.node)
    # What the calls make of each plan, in its op: the ranks compare it there (a rank whose calls run
    # no backward would leave the others waiting in theirs). It also keeps AOT autograd's CSE from
    # merging the plan ops of two layers (each checkpointed layer's body has its own) whose calls
    # read other outputs of the plan (a causal layer k_len_causal, a full one k_len_full): the merged
    # op would be an earlier checkpointed region's, an output read only by a later region would make
    # the partitioner save the op itself, and it cannot save a tuple (the compile fails).
    for key, (index, *_) in plans.items():
        plan = index.args[0]
        plan.kwargs = {**plan.kwargs, "calls": calls[key]} | ({"dims": dims[key]} if dims[key] else {})
    _erase_unread(graph, set(graph.nodes) - own, freed)


#: In-place operators, and names of calls that draw random numbers: never moved, nor moved across.
_IN_PLACE = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
}  # fmt: skip
_RANDOM = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "exponential", "poisson")


def _pure(node: fx.Node) -> bool:
    """Whether ``node`` computes a value and nothing else (no mutation, randomness or other side effect):
    such a node may run at another point between its inputs and its readers. Conservative: a call
    of a name ending in ``_`` counts as in place."""
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target in _IN_PLACE or name.endswith("_") and not name.endswith("__") or any(r in name for r in _RANDOM):
        return False
    schema = getattr(target, "_schema", None)
    return schema is None or not schema.is_mutable


def _ancestors(nodes) -> set[fx.Node]:
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _defer_query_path(graph: fx.Graph, q: fx.Node, starts: list[fx.Node]) -> int:
    """Move the nodes that only the query needs (its projection, RoPE) from before the all-gathers'
    ``starts`` to right after them, so that they run while K/V travel; returns how many.

    A model may compute Q before K and V (Hugging Face's attention projects Q first and rotates Q and
    K together), which would leave nothing between the start and the wait. A node moves when it is
    pure (:func:`_pure`), an ancestor of ``q`` that the starts do not need, after the last node with
    a side effect before the starts (autocast or grad mode switches, in-place calls, randomness), and
    read only by nodes that move too or come after the starts: the graph computes the same values in
    another order, and crosses no side effect."""
    needed = _ancestors(starts)
    wanted = _ancestors([q]) - needed
    position = {n: i for i, n in enumerate(graph.nodes)}
    end = max(position[s] for s in starts)
    moving: set[fx.Node] = set()
    node = starts[0].prev
    while node.op not in ("root", "placeholder"):
        if node.op == "get_attr":
            pass  # a module's attribute: stays, before whatever reads it
        elif not _pure(node):
            break  # a side effect: nothing moves across it
        elif node in wanted and all(u in moving or position[u] > end for u in node.users):
            moving.add(node)
        node = node.prev
    after = max(starts, key=position.__getitem__)
    for node in sorted(moving, key=position.__getitem__):
        after.append(node)
        after = node
    return len(moving)


def _erase_unread(graph: fx.Graph, added: set[fx.Node], freed: list[fx.Node]) -> None:
    """Erase what the rewrite left unread, and nothing else: the nodes it ``added`` (plan outputs a call
    does not read, a window's query positions under a causal mask) and the symbolic scalars that only
    the replaced calls read (a ``causal`` computed as ``window[1] == 0``), consumers first.

    Never graph-wide dead-code elimination: Dynamo's graph holds in-place calls whose results are
    unused (``out.add_(b)``, a ``call_method``; ``operator.iadd``), which it takes for pure and drops."""
    candidates = added | set(freed)
    for node in reversed(list(graph.nodes)):
        if node not in candidates or node.users or node.op != "call_function":
            continue
        scalar = isinstance(node.meta.get("example_value"), (torch.SymInt, torch.SymBool, torch.SymFloat))
        if node in added or (scalar and not node.is_impure()):
            candidates.update(node.all_input_nodes)
            graph.erase_node(node)


def shard_attention_pass(
    gm: fx.GraphModule,
    *,
    group_name: str,
    cp_size: int,
    rank: int,
    spec: StrategySpec,
    unsupported: str = "raise",
    captured: bool = False,
    overlap_kv: bool = False,
) -> int:
    """Shard every recognized packed attention call of ``gm`` and of the subgraphs its
    higher-order ops call (checkpointed layers' bodies, each with its own ``cp_plan``) over
    the CP group; returns how many.

    ``unsupported``: ``"raise"`` (:class:`UnsupportedAttentionError` for a call CP cannot
    compute exactly) or ``"single_device"`` (leave it, warn: each rank then attends
    within its own tokens only). ``spec``: the layout, and the kernel and K/V transport the
    inserted ops get as arguments. ``captured``:
    CUDA graphs are on, and calls that can be captured become ``cp_attention_captured``
    (:func:`rewrite_packed_attention`). ``overlap_kv``: the K/V transfers as graph nodes
    (:func:`rewrite_packed_attention`, ``attention.split``, ``attention.split_exchange``).
    """
    # The root graph and the bodies its higher-order ops call (activation checkpointing puts
    # each checkpointed layer in one): a call left in a body would run single-device on a
    # rank's tokens, silently wrong, so every graph is searched and rewritten alike.
    check_head_parallel(spec.head_parallel, cp_size)  # before anything is rewritten; the heads per call
    found = [(m, *find_packed_attention(m)) for m in gm.modules() if isinstance(m, fx.GraphModule)]
    # A call in an autograd.Function's forward body (flash-attn's flash_attn_varlen_func) keeps that
    # Function's backward, a single-device kernel on the CP output: wrong gradients, so refuse it
    # (find_packed_attention refuses a forward that Dynamo compiles as a graph of its own).
    forwards = _autograd_function_forwards(gm)
    found = [
        (m, [], [x if isinstance(x, Unsupported) and not x.packed else Unsupported(x.node, _IN_AUTOGRAD_FUNCTION)
                 for x in matches + skips])
        if any(m is f for f in forwards)
        else (m, matches, skips)
        for m, matches, skips in found
    ]  # fmt: skip
    skipped = [s for _, _, skips in found for s in skips]
    if skipped and check_unsupported(unsupported) == "raise":
        packed, others = ([s for s in skipped if s.packed is p] for p in (True, False))
        problems = []
        if packed:
            calls = "; ".join(f"{s.node.format_node()}: {s.reason}" for s in packed)
            problems.append(
                f"cpcompile cannot run {len(packed)} packed attention call(s) context-parallel exactly: {calls}. "
                "Use one cu_seqlens for queries and keys and a valid window"
            )
        if others:
            calls = "; ".join(f"{s.node.format_node()}: {s.reason}" for s in others)
            problems.append(f"cpcompile cannot run {len(others)} attention call(s) context-parallel: {calls}")
        raise UnsupportedAttentionError(
            ". ".join(problems) + ". Or pass cpcompile.backend(..., unsupported='single_device') to run such "
            "calls over each rank's own tokens alone (not the single-device result)."
        )
    for s in skipped:
        warnings.warn(f"cpcompile left {s.node.format_node()} as single-device attention: {s.reason}", stacklevel=2)
    count = 0
    for module, matches, _ in found:
        if not matches:
            continue
        rewrite_packed_attention(
            module, matches, group_name=group_name, cp_size=cp_size, rank=rank, spec=spec,
            captured=captured, overlap_kv=overlap_kv,
        )  # fmt: skip
        module.graph.lint()
        module.recompile()
        count += len(matches)
    if not count:
        log.info("shard_attention_pass: no packed attention call to shard")
    return count

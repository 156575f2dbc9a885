"""TP overlap pass: all-gather -> matmul into ``ag_gemm``, matmul -> reduce-scatter into ``gemm_rs``.

Graph level: the **Dynamo graph**, before AOT autograd. There functional collectives
are ``torch.ops._c10d_functional.all_gather_into_tensor(x, group_size, group_name)``
(or ``reduce_scatter_tensor(x, "sum", group_size, group_name)``) followed by
``wait_tensor``, and matmuls are torch-level calls (``F.linear``, ``torch.mm``,
``torch.matmul``, ``@``, ``torch.addmm``). Rewriting before AOT lets AOT autograd take
the backward from the ops' registered autograd, so the backward graph gets the
overlapped ops too, and every size stays the symbolic ``t`` Dynamo traced.

Patterns (what Megatron-style sequence-parallel layers and torch's functional
collectives produce; ``[t, ..., K]`` inputs such as Megatron's ``[s, b, h]`` included):

- ``all_gather -> wait -> (view/reshape/flatten to [rows, K])* -> mm | addmm | linear | matmul``
  with the gathered tensor as the matmul's *input* (never its weight) and no other user;
- ``mm | linear (no bias) | matmul -> reduce_scatter("sum") -> wait``, the matmul feeding
  only the collective;

each with a ``[t, ..., K]`` input, a 2-D weight and a bias of exactly ``[N]`` (what the ops take;
other matmuls stay as they are), in the root graph and in the bodies its higher-order ops call
(activation-checkpointed regions). Under autocast the matmul's inputs are cast to the dtype
Dynamo traced its result in, as autocast casts them, so the op computes what the matmul did.

torch 2.11-2.13 emit the same op names; 2.13 renamed only the Python wrappers
(``all_gather_tensor`` -> ``all_gather_single``). 2.11's ``*_autograd`` wrappers emit the
``_c10d_functional_autograd`` namespace, matched as well.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from cpcompile.comm.groups import group_name
from cpcompile.tp import ops  # noqa: F401  (registers torch.ops.cpcompile.ag_gemm / gemm_rs)

log = logging.getLogger(__name__)


def _targets(name: str) -> frozenset:
    found = set()
    for namespace in (torch.ops._c10d_functional, torch.ops._c10d_functional_autograd):
        packet = getattr(namespace, name, None)
        if packet is not None:
            found |= {packet, packet.default}
    return frozenset(found)


ALL_GATHER = _targets("all_gather_into_tensor")
REDUCE_SCATTER = _targets("reduce_scatter_tensor")
WAIT = _targets("wait_tensor")
VIEW_METHODS = {"view", "reshape", "flatten"}
VIEW_FUNCTIONS = {torch.reshape, torch.flatten}
MM_METHODS = {"mm", "matmul"}


@dataclasses.dataclass(frozen=True)
class Linear:
    """A matmul read as ``input @ weight.T + bias``.

    ``transposed``: the graph holds only ``weight.T`` (``[K, N]``), so a rewrite transposes
    it back; ``weight_t``: the graph's ``weight.T`` node the matmul read, bypassed by a rewrite.
    """

    node: fx.Node
    input: fx.Node
    weight: fx.Node
    transposed: bool
    weight_t: fx.Node | None
    bias: fx.Node | None


@dataclasses.dataclass(frozen=True)
class AgMatmulMatch:
    gather: fx.Node
    wait: fx.Node
    views: tuple[fx.Node, ...]
    linear: Linear
    group_name: str


@dataclasses.dataclass(frozen=True)
class MatmulRsMatch:
    linear: Linear
    scatter: fx.Node
    wait: fx.Node
    group_name: str


def _val(node: object):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _weight(b: fx.Node) -> tuple[fx.Node, bool, fx.Node | None]:
    """A ``[K, N]`` matmul operand as ``(w, False, b)`` when ``b`` is ``w.T``/``w.t()``, else ``(b, True, None)``."""
    is_t = (b.op == "call_function" and b.target is torch.t) or (b.op == "call_method" and b.target == "t")
    is_attr_t = b.op == "call_function" and b.target is getattr and b.args[1:] == ("T",)
    if (is_t or is_attr_t) and isinstance(b.args[0], fx.Node):
        return b.args[0], False, b
    return b, True, None


def _as_linear(node: fx.Node) -> Linear | None:
    """``node`` read as a linear layer the ops can run, or None."""
    linear = _read_linear(node)
    return linear if linear is not None and _fits(linear) else None


def _fits(linear: Linear) -> bool:
    """Whether the ops take ``linear``'s operands: ``x [t, ..., K]``, ``w`` 2-D, ``bias`` exactly
    ``[N]`` (a broadcast one, ``[1]`` or 0-D, is the matmul's but not the ops'), K at least 1."""
    x, w, out = _val(linear.input), _val(linear.weight), _val(linear.node)
    if not all(isinstance(t, torch.Tensor) for t in (x, w, out)) or x.dim() < 2 or w.dim() != 2 or out.dim() < 2:
        return False
    if statically_known_true(x.shape[-1] == 0):
        return False
    bias = _val(linear.bias) if linear.bias is not None else None
    if linear.bias is not None and (
        not isinstance(bias, torch.Tensor)
        or bias.dim() != 1
        or not statically_known_true(bias.shape[0] == out.shape[-1])
    ):
        return False
    return True


def _read_linear(node: fx.Node) -> Linear | None:
    """Read ``node`` as ``input @ weight.T + bias``, or None when it is not such a matmul."""
    fn, method = node.op == "call_function", node.op == "call_method"
    if fn and node.target is torch._C._nn.linear:
        return Linear(node, _arg(node, 0, "input"), _arg(node, 1, "weight"), False, None, _arg(node, 2, "bias"))
    if fn and node.target is torch.addmm:
        bias, x, b = _arg(node, 0, "input"), _arg(node, 1, "mat1"), _arg(node, 2, "mat2")
        bias_val, scaled = _val(bias), node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1
        if scaled or bias_val is None or bias_val.dim() != 1:
            return None  # a scaled or 2-D bias is not linear's bias
        return Linear(node, x, *_weight(b), bias)
    is_mm = (fn and node.target in (torch.mm, torch.matmul, operator.matmul)) or (method and node.target in MM_METHODS)
    if is_mm:
        x, b = _arg(node, 0, "input"), _arg(node, 1, "mat2" if node.target in (torch.mm, "mm") else "other")
        b_val = _val(b)
        if b_val is None or b_val.dim() != 2:
            return None
        return Linear(node, x, *_weight(b), None)
    return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _group(node: fx.Node) -> str:
    return group_name(_arg(node, 3 if node.target in REDUCE_SCATTER else 2, "group_name"))


def _is_view(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in VIEW_METHODS) or (
        node.op == "call_function" and node.target in VIEW_FUNCTIONS
    )


def _match_ag(gather: fx.Node) -> AgMatmulMatch | str:
    wait = _only_user(gather)
    if wait is None or wait.target not in WAIT:
        return "the all-gather is not waited on once"
    views, node = [], _only_user(wait)
    while node is not None and _is_view(node) and node.args[0] is (views[-1] if views else wait):
        views.append(node)
        node = _only_user(node)
    linear = _as_linear(node) if node is not None else None
    chain = (wait, *views)
    if (
        linear is None
        or linear.input is not (views[-1] if views else wait)
        or linear.weight in chain
        or linear.bias in chain
    ):
        return "the gathered tensor does not feed exactly one matmul as its input (a [t, ..., K] input, a 2-D weight)"
    if views:
        flat, gathered = _val(views[-1]), _val(wait)
        if (
            flat is None
            or gathered is None
            or flat.dim() != 2
            or not statically_known_true(flat.shape[1] == gathered.shape[-1])
        ):
            return "the views between all-gather and matmul do not flatten leading dims to [rows, K]"
    return AgMatmulMatch(gather, wait, tuple(views), linear, _group(gather))


def _match_rs(scatter: fx.Node) -> MatmulRsMatch | str:
    if str(_arg(scatter, 1, "reduce_op")).lower() != "sum":
        return "the reduce-scatter does not sum"
    wait = _only_user(scatter)
    source = scatter.args[0]
    linear = _as_linear(source) if isinstance(source, fx.Node) else None
    if wait is None or wait.target not in WAIT:
        return "the reduce-scatter is not waited on once"
    if linear is None or linear.bias is not None or len(source.users) != 1:
        return "the reduce-scatter's input is not a bias-free matmul ([t, ..., K] input, 2-D weight) used only by it"
    return MatmulRsMatch(linear, scatter, wait, _group(scatter))


def _find(graph: fx.Graph, targets: frozenset, match) -> list:
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            result = match(node)
            if isinstance(result, str):
                log.debug("overlap_matmul_pass: %s not rewritten: %s", node.name, result)
            else:
                found.append(result)
    return found


def find_ag_matmul(graph: fx.Graph) -> list[AgMatmulMatch]:
    """All-gather -> (views) -> matmul chains ``ag_gemm`` can replace."""
    return _find(graph, ALL_GATHER, _match_ag)


def find_matmul_rs(graph: fx.Graph) -> list[MatmulRsMatch]:
    """Matmul -> reduce-scatter chains ``gemm_rs`` can replace."""
    return _find(graph, REDUCE_SCATTER, _match_rs)


def _call(graph: fx.Graph, target, args: tuple, like: fx.Node) -> fx.Node:
    """Insert ``target(*args)``, with the fake value Dynamo/AOT nodes carry when ``like`` has one."""
    node = graph.call_function(target, args)
    node.meta["stack_trace"] = like.meta.get("stack_trace")  # errors point at the user's matmul
    key = "example_value" if "example_value" in like.meta else "val"
    if key in like.meta:
        fake = fx.node.map_arg(args, _val)
        node.meta[key] = target(*fake)
    return node


def _weight_node(graph: fx.Graph, linear: Linear) -> fx.Node:
    return _call(graph, torch.t, (linear.weight,), linear.weight) if linear.transposed else linear.weight


def _as_traced(graph: fx.Graph, linear: Linear, operand: fx.Node | None) -> fx.Node | None:
    """``operand`` in the dtype Dynamo traced ``linear``'s result in: under autocast a matmul casts its
    inputs (float32 -> bfloat16, say), which the ops, having no autocast rule, would not."""
    dtype = _val(linear.node).dtype
    if operand is None or _val(operand).dtype == dtype:
        return operand
    return _call(graph, torch.Tensor.to, (operand, dtype), linear.node)


def _replace(graph: fx.Graph, old: fx.Node, new: fx.Node, dead: list[fx.Node], linear: Linear) -> None:
    old.replace_all_uses_with(new)
    for node in dead:  # consumers first, so that each node is unused when erased
        graph.erase_node(node)
    if linear.weight_t is not None and not linear.weight_t.users:
        graph.erase_node(linear.weight_t)


def rewrite_ag_matmul(
    graph: fx.Graph, match: AgMatmulMatch, *, capacity_tokens: int | None, transport: str = "symm_mem"
) -> fx.Node:
    linear = match.linear
    with graph.inserting_before(linear.node):
        x = match.gather.args[0]
        if match.views:  # all_gather(x).view(-1, K) == all_gather(x.flatten(0, -2)): [t * ..., K]
            x = _call(graph, torch.flatten, (x, 0, -2), linear.node)
        x, w, bias = (_as_traced(graph, linear, n) for n in (x, _weight_node(graph, linear), linear.bias))
        new = _call(
            graph,
            torch.ops.cpcompile.ag_gemm.default,
            (x, w, bias, match.group_name, capacity_tokens, transport),
            linear.node,
        )
    _replace(graph, linear.node, new, [linear.node, *reversed(match.views), match.wait, match.gather], linear)
    return new


def rewrite_matmul_rs(
    graph: fx.Graph, match: MatmulRsMatch, *, capacity_tokens: int | None, transport: str = "symm_mem"
) -> fx.Node:
    linear = match.linear
    with graph.inserting_before(match.wait):
        x, w = (_as_traced(graph, linear, n) for n in (linear.input, _weight_node(graph, linear)))
        new = _call(
            graph,
            torch.ops.cpcompile.gemm_rs.default,
            (x, w, match.group_name, capacity_tokens, transport),
            match.wait,
        )
    _replace(graph, match.wait, new, [match.wait, match.scatter, linear.node], linear)
    return new


def overlap_matmul_pass(gm: fx.GraphModule, *, capacity_tokens: int | None = None, transport: str = "symm_mem") -> int:
    """Rewrite ``gm`` (a Dynamo graph) in place; returns the number of ops inserted.

    ``capacity_tokens`` goes to every inserted op (see :func:`cpcompile.tp.ag_gemm`):
    the most tokens per rank, or None for buffers that grow to the largest call;
    ``transport`` too (``backend(tp_comm=...)``).
    """
    rewrites = 0
    # the root graph and the bodies its higher-order ops call (each activation-checkpointed region)
    for module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        graph, before = module.graph, rewrites
        for match in find_ag_matmul(graph):
            rewrite_ag_matmul(graph, match, capacity_tokens=capacity_tokens, transport=transport)
            rewrites += 1
        for match in find_matmul_rs(graph):
            rewrite_matmul_rs(graph, match, capacity_tokens=capacity_tokens, transport=transport)
            rewrites += 1
        if rewrites > before:
            graph.lint()
            module.recompile()
    if not rewrites:
        log.info("overlap_matmul_pass: no all-gather -> matmul or matmul -> reduce-scatter to rewrite")
    return rewrites

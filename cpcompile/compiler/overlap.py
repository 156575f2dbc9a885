"""Where a compiled graph waits for its collectives: as late as it can (``overlap_kv``).

The pass (``compiler.shard_attention``) writes the forward's transfers of K and V as soon
as K and V exist and their waits just before attention (``attention.split``,
``attention.split_exchange``), so the
forward graph runs what lies between (the Q projection, RoPE) while they travel. The
backward graph is traced by AOT autograd from the backward formula, which waits for the
dK/dV reduce-scatters (the exchange's returns) right after starting them; :func:`sink_waits`
moves each wait (and the cast of its result to the input dtype, or the exchange's
``cp_exchange_add``) to just before the first node that reads it,
so that the dQ path and the weight gradients, traced after it, run while the sums travel.

It runs on the graphs AOT autograd hands to the compiler: for ``inner="inductor"`` as
inductor's ``post_grad_custom_post_pass`` (:func:`inductor_patches`, after a pass of the
user's own), for ``inner="aot_eager"`` in the forward and backward compilers
(:func:`aot_backend`). Another ``inner`` gets the graph before AOT autograd and keeps the
backward's waits where the formula puts them. Every rank's graph is the same, so the
collectives are issued in the same order on every rank.

The backward's re-gathers of K and V stay where the formula starts them (just before
the kernel): raised further they would hold more layers' gathered K/V at once, and run
before the backward's agreement (``attention.common.communicates``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx

try:  # torch 2.6+: what inductor accepts as a custom pass (its uuid keys the FX graph cache)
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover
    CustomGraphPass = object

from cpcompile.attention import split_exchange as _split_exchange  # noqa: F401  (registers cp_exchange_add)

_WAIT = torch.ops._c10d_functional.wait_tensor.default
#: Casts of a wait's result that move with it: the dK/dV sums rounded to the input dtype.
_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
#: The exchange's last backward op (``attention.split_exchange``): it adds the returned sums (argument 1,
#: a wait's result) to the own parts and rounds to the input dtype, the exchange's cast.
_ADD = torch.ops.cpcompile.cp_exchange_add.default


def _first_user(node: fx.Node) -> fx.Node | None:
    """The first node after ``node`` that reads it; None when none does (a wait nobody reads stays:
    ``wait_tensor`` is side-effectful, so dead-code elimination leaves it in the graph)."""
    users, after = set(node.users), node.next
    while after.op != "root":  # the graph's node list is circular through its root
        if after in users:
            return after
        after = after.next
    return None


def _moves(node: fx.Node, moving: set[fx.Node]) -> bool:
    if node.op != "call_function":
        return False
    if node.target is _WAIT:
        return True
    if node.target is _ADD:  # pure, its other inputs made before it: it may run anywhere before its readers
        return node.args[1] in moving
    # a cast whose one input is a wait (or a cast that moves): read no earlier than the wait
    return node.target in _CASTS and len(node.all_input_nodes) == 1 and node.all_input_nodes[0] in moving


def sink_waits(graph: fx.Graph) -> int:
    """Move every functional collective's ``wait_tensor`` (and the casts of its result, or the exchange's
    add) to just before its first reader; returns how many moved. Nothing else moves, so the collectives start where
    they stood and in the same order."""
    moving = set()
    for node in graph.nodes:
        if _moves(node, moving):
            moving.add(node)
    moved = 0
    for node in reversed(list(graph.nodes)):  # a cast first, then its wait to just before it
        if node in moving:
            first = _first_user(node)
            if first is not None and first is not node.next:
                first.prepend(node)
                moved += 1
    return moved


class _SinkWaits(CustomGraphPass):
    """:func:`sink_waits` as inductor's ``post_grad_custom_post_pass``, after ``before`` (a pass the
    user set there)."""

    def __init__(self, before=None) -> None:
        self.before = before

    def __call__(self, graph: fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        sink_waits(graph)

    def uuid(self):
        from torch._inductor.custom_graph_pass import get_hash_for_files

        before = None if self.before is None else getattr(self.before, "uuid", lambda: repr(self.before))()
        return (get_hash_for_files((__file__,)), before)  # this module's code keys inductor's FX graph cache


def inductor_patches() -> dict:
    """Inductor config patches that run :func:`sink_waits` on its post-grad graphs (forward and backward),
    and inductor's own ``sink_waits`` on its scheduled nodes: its ordering for peak memory (on by default)
    would otherwise put the waits back next to their collectives. A user's own comm/compute reordering
    (``reorder_for_compute_comm_overlap`` on) is left as it is."""
    from torch._inductor import config

    patches = {"post_grad_custom_post_pass": _SinkWaits(config.post_grad_custom_post_pass)}
    if not config.reorder_for_compute_comm_overlap:
        patches |= {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}
    return patches


def _sinking(compiler: Callable) -> Callable:
    @functools.wraps(compiler)
    def compile_graph(gm: fx.GraphModule, example_inputs):
        if sink_waits(gm.graph):
            gm.recompile()
        return compiler(gm, example_inputs)

    return compile_graph


def aot_backend(compiler: Callable | None = None) -> Callable:
    """``aot_eager`` (AOT autograd, the min-cut partitioner) with :func:`sink_waits` on the forward and
    backward graphs, which then go to ``compiler`` (a boxed compiler; default: run them as they are)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    compiler = _sinking(compiler or boxed_nop)
    return aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )

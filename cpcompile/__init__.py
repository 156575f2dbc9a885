"""cpcompile: context parallelism for packed-sequence (THD) attention, by the compiler.

What a training script needs is here: the data-loader side (:func:`shard_batch`,
:func:`unshard`, :class:`ShardedBatch`), the configuration (:func:`strategy`,
:class:`StrategySpec`: every choice of how CP runs, :class:`Strategy`, :class:`Capacity`), the
attention a model calls (:func:`packed_attention`) or that CP runs (:func:`cp_attention`),
and the compiler's backend (:func:`backend`, :class:`CapturedStep`).

The rest lives in its room, in the order data flows: :mod:`cpcompile.layouts` (which rank
holds which token), :mod:`cpcompile.cost` (what a layout costs), :mod:`cpcompile.plan`
(a rank's pieces and the keys they read), :mod:`cpcompile.attention` (the ops),
:mod:`cpcompile.compiler` (the backend and its passes), :mod:`cpcompile.tp` (TP overlap),
:mod:`cpcompile.advisor` (choosing a configuration), over :mod:`cpcompile.comm` and
:mod:`cpcompile.kernels`.
"""

from cpcompile.attention import cp_attention, packed_attention
from cpcompile.batch import ShardedBatch, shard_batch, unshard
from cpcompile.compiler import CapturedStep, backend
from cpcompile.spec import Capacity, Strategy, StrategySpec, strategy

__all__ = [
    "Capacity",
    "CapturedStep",
    "ShardedBatch",
    "Strategy",
    "StrategySpec",
    "backend",
    "cp_attention",
    "packed_attention",
    "shard_batch",
    "strategy",
    "unshard",
]

"""cpcompile: context parallelism for packed-sequence (THD) attention.

Layouts (:func:`pad_for_cp`, :func:`partition_indices`), the cost model that
balances them (:func:`predict_rank_costs`, :func:`choose_strategy`), the data-loader side
(:func:`shard_batch`, :func:`unshard`), and the ops a model calls
(:func:`packed_attention`) or that CP runs (:func:`cp_attention`).
"""

from .backend import backend
from .batch import ShardedBatch, shard_batch, unshard
from .capture import CapturedStep
from .config import Config
from .cost import CostModel, choose_strategy, predict_rank_costs
from .ops import ag_gemm, cp_attention, gemm_rs, packed_attention, release_grad_buffers
from .partition import all_partition_indices, capacity_for, pad_for_cp, partition_indices
from .plan import AttentionPlan, make_plan
from .strategy import Capacity, Strategy, StrategySpec, current_spec, current_strategy, strategy

__all__ = [
    "AttentionPlan",
    "Capacity",
    "CapturedStep",
    "Config",
    "CostModel",
    "ShardedBatch",
    "Strategy",
    "StrategySpec",
    "ag_gemm",
    "all_partition_indices",
    "backend",
    "capacity_for",
    "choose_strategy",
    "cp_attention",
    "current_spec",
    "current_strategy",
    "gemm_rs",
    "make_plan",
    "packed_attention",
    "pad_for_cp",
    "partition_indices",
    "predict_rank_costs",
    "release_grad_buffers",
    "shard_batch",
    "strategy",
    "unshard",
]

"""What a layout costs each rank: the kernel cost model that ``balanced`` and ``auto`` use
(:mod:`~cpcompile.cost.model`) and the FLOP count of attention (:mod:`~cpcompile.cost.flops`)."""

from cpcompile.cost.model import CostModel, choose_strategy, predict_rank_costs

__all__ = ["CostModel", "choose_strategy", "predict_rank_costs"]

"""The compiler's side: the Dynamo backend (:func:`backend`), its pass that rewrites packed
attention into CP ops (:mod:`~cpcompile.compiler.shard_attention`), and the captured step
(:class:`CapturedStep`: a compiled step replayed as CUDA graphs)."""

from cpcompile.compiler.backend import backend
from cpcompile.compiler.captured_step import CapturedStep

__all__ = ["CapturedStep", "backend"]

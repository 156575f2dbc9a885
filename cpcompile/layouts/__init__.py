"""Layouts: which rank holds which token of a pack.

:func:`pad_for_cp` pads each document for a layout, :func:`partition_indices` gives one rank's
physical positions (TransformerEngine's ``get_batch_on_this_cp_rank`` order for
``dual_chunk_swap``), :func:`all_partition_indices` every rank's, and :func:`capacity_for` the
fixed token count of a capacity layout. :mod:`~cpcompile.layouts.balanced` is the balanced
layout's algorithm, :mod:`~cpcompile.layouts.reads` which keys each rank's pieces read.
"""

from cpcompile.layouts.balanced_op import balanced_layout_op  # noqa: F401  (registers cpcompile::balanced_layout)
from cpcompile.layouts.partition import all_partition_indices, capacity_for, pad_for_cp, partition_indices

__all__ = ["all_partition_indices", "capacity_for", "pad_for_cp", "partition_indices"]

"""torchtitan: its decoders with varlen attention (``attn_backend="varlen"``) trained context-parallel.

torchtitan's ``VarlenAttention`` calls ``torch.nn.attention.varlen.varlen_attn`` with the document
boundaries of its ``VarlenMetadata``; torchtitan's own CP refuses it (``NotImplementedError``: "Varlen
attention is not supported with CP"). Compiled with :func:`cpcompile.backend`, that call becomes CP
attention, with torchtitan's model code unchanged: each rank runs its share of the pack
(:func:`cpcompile.shard_batch` of the tokens, positions and labels) with the metadata of the whole pack
(:func:`varlen_metadata`), under ``cpcompile.strategy(sharded)``; the loss is each rank's share of the
pack's mean, and the gradients are summed over the CP group::

    from cpcompile.integrations import titan

    titan.compile_blocks(model, cpcompile.backend(group=cp_group))
    sharded = cpcompile.shard_batch({"tokens": tokens, "positions": positions, "labels": labels}, cu_seqlens,
                                    cp_size=cp, rank=rank, strategy="balanced")
    t = sharded.tensors
    with cpcompile.strategy(sharded):
        masks = titan.varlen_metadata(sharded)  # the whole pack's documents
        logits = model(t["tokens"][None], attention_masks=masks, positions=t["positions"][None])

RoPE follows the sharded ``positions`` (torchtitan rotates by them when given). torchtitan's varlen
path casts q, k and v to bfloat16, as its kernels need: so does the CP attention it becomes.
"""

from __future__ import annotations

import torch

from cpcompile.batch import ShardedBatch

try:
    from torchtitan.models.common.attention import VarlenMetadata
except ImportError as e:  # optional: torchtitan pins its own dependencies, outside cpcompile's extras
    raise ImportError(
        "cpcompile.integrations.titan needs torchtitan (pip install torchtitan; its model package imports triton)"
    ) from e


def varlen_metadata(sharded: ShardedBatch, max_length: int | None = None) -> VarlenMetadata:
    """torchtitan's ``VarlenMetadata`` of the whole pack a rank's share came from.

    Args:
        sharded: the rank's :class:`cpcompile.ShardedBatch`; its ``cu_seqlens`` ``[B + 1]`` int32 are the pack's.
        max_length: the longest document (default: found from ``cu_seqlens``), the kernels' launch bound.
    Returns:
        ``VarlenMetadata`` with ``cu_seq_q = cu_seq_k = sharded.cu_seqlens``: torchtitan's own
        ``create_varlen_metadata_for_document`` would see the rank's positions only, and cut documents wrong.
    """
    cu = sharded.cu_seqlens
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    if max_length is None:
        max_length = longest
    elif not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < longest:
        raise ValueError(f"max_length must be an int of at least the longest document, {longest}; got {max_length!r}")
    return VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=max_length, max_k=max_length, cu_seq_q_host=None)


def compile_blocks(model: torch.nn.Module, backend, *, dynamic: bool = True) -> None:
    """Compile each transformer block of a torchtitan decoder in place (``model.layers``), as torchtitan
    compiles per block: one graph serves every block and every pack composition."""
    layers = getattr(model, "layers", None)
    blocks = list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers or ())
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no .layers of transformer blocks to compile")
    for block in blocks:
        block.compile(backend=backend, dynamic=dynamic)

"""Head-parallel (Ulysses) transport: all-to-alls that trade tokens for heads over a group of ``u`` ranks.

Note [head all-to-all]: rank ``r`` holds ``T_local`` tokens of every head, ``x [T_local, H, D]``.
Its heads are cut into ``u`` contiguous groups of ``H / u``; group ``s`` goes to rank ``s``.
Rank ``s`` then holds every rank's tokens of its head group, in rank-major order (the
order of an all-gather of the tokens), ``[u * T_local, H / u, D]``. The way back is the
mirror. Several tensors of one dtype travel in one collective (their head groups side by side
in each rank's block), whatever their head dims (keys' and values' may differ).

K/V heads: query head ``h`` reads K/V head ``h // (Hq / Hkv)``, so rank ``s``'s query
heads need K/V heads that another rank's split might hold, or hold fewer than one of
(``Hkv < u``). :func:`kv_replication` gives the least ``f`` for which every K/V head
repeated ``f`` times (``Hkv * f`` heads) splits evenly and keeps each rank's query heads
reading only its own K/V heads; gradients of the copies are summed back exactly
(:func:`sum_replicas`). The cost: each of K and V sends ``f`` times its bytes, i.e.
``(f - 1) * T_local * Hkv * D * (u - 1) / u`` extra elements per rank each way, and
the backward's dK/dV the same in the accumulation dtype; ``f = 1`` where ``u`` divides ``Hkv``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def kv_replication(q_heads: int, kv_heads: int, u: int) -> int:
    """The least ``f >= 1`` with ``u | kv_heads * f`` and ``kv_heads * f | q_heads`` (``f = q_heads /
    kv_heads``, full replication, always qualifies when ``u | q_heads``)."""
    for f in range(1, q_heads // kv_heads + 1):
        if (kv_heads * f) % u == 0 and q_heads % (kv_heads * f) == 0:
            return f
    raise ValueError(f"head_parallel={u} must divide the number of query heads {q_heads}")


def replicate(x: torch.Tensor, f: int) -> torch.Tensor:
    """``[T, Hkv, D]`` -> ``[T, Hkv * f, D]``, each head repeated ``f`` times in place."""
    return x if f == 1 else x.repeat_interleave(f, dim=1)


def sum_replicas(dx: torch.Tensor, f: int) -> torch.Tensor:
    """The gradient of :func:`replicate`: ``[T, Hkv * f, D]`` -> ``[T, Hkv, D]``, copies summed."""
    return dx if f == 1 else dx.unflatten(1, (-1, f)).sum(2)


def _exchange(blocks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # blocks [u, rows, S, D]: block s goes to rank s; the result's block s came from rank s
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, group=group)
    return out


def heads_to_tokens(xs: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each ``x [T_local, H_i, D_i]`` (one dtype; head dims may differ: values' and keys') ->
    ``[u * T_local, H_i / u, D_i]``: this rank's head group of every rank's tokens, rank-major
    (Note [head all-to-all])."""
    u = group.size()
    t_local = xs[0].shape[0]
    heads = [x.shape[1] // u for x in xs]
    widths = [h * x.shape[2] for x, h in zip(xs, heads, strict=True)]  # a head group's features per token
    blocks = torch.cat([x.reshape(t_local, u, w) for x, w in zip(xs, widths)], dim=2)  # [T_local, u, S]
    out = _exchange(blocks.transpose(0, 1).contiguous(), group)  # [u, T_local, S]
    parts = zip(out.split(widths, dim=2), heads, xs, strict=True)
    return [part.reshape(u * t_local, h, x.shape[2]) for part, h, x in parts]


def tokens_to_heads(xs: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The mirror of :func:`heads_to_tokens`: each ``x [u * T_local, h_i, D_i]`` -> ``[T_local, u * h_i, D_i]``."""
    u = group.size()
    t_local = xs[0].shape[0] // u
    widths = [x.shape[1] * x.shape[2] for x in xs]
    blocks = torch.cat([x.reshape(u, t_local, w) for x, w in zip(xs, widths)], dim=2).contiguous()  # [u, T_local, S]
    out = _exchange(blocks, group).transpose(0, 1)  # [T_local, u, S]: head group s from rank s
    # separate tensors
    return [part.reshape(t_local, u * x.shape[1], x.shape[2]) for part, x in zip(out.split(widths, dim=2), xs)]


_subgroups: dict[tuple[str, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def head_groups(group: dist.ProcessGroup, u: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(heads, sequence)``: this rank's group of ``u`` consecutive ranks of ``group`` (the head
    all-to-all's) and its group of the ranks at its place in every head group (``j, u + j, ...``:
    the sequence all-gather's). Made once per ``(group, u)``, by the members alone."""
    key = (group.group_name, u)
    if key not in _subgroups:
        ranks = dist.get_process_group_ranks(group)
        me = group.rank()
        heads = ranks[me // u * u : (me // u + 1) * u]
        sequence = ranks[me % u :: u]
        _subgroups[key] = tuple(dist.new_group(r, use_local_synchronization=True) for r in (heads, sequence))
    return _subgroups[key]

"""A pack laid out for CP, checked once: :class:`Pack`.

Every public entry that takes a pack's offsets (``shard_batch``, ``cp_attention``,
``packed_attention``, the plan op of a compiled step, and the public layout functions)
checks the tensors themselves once (:func:`cpcompile.checks.check_offsets`); what runs below an
entry takes them as checked. :meth:`Pack.build` then lays the pack out for one layout, checking what
relates the pack to the layout (the given padding against the real lengths and the layout's
multiples, the token count), once per pack: the plan (``plan.step_plan``) is made once per
step from it, and so is every rank's reads (``layouts.reads``), the exchange's plan and
the cost model's prediction.
"""

from __future__ import annotations

import dataclasses

import torch

from cpcompile.cache import on_host
from cpcompile.checks import check_pack_tokens
from cpcompile.layouts.partition import check_capacity_documents, check_layout_values, padded_offsets, positions
from cpcompile.spec import StrategySpec


@dataclasses.dataclass(frozen=True)
class Pack:
    """A whole pack laid out over ``cp`` ranks (``B`` documents, ``T`` padded tokens).

    - ``layout``: ``[cp, T_local]`` int64, every rank's physical positions, each row ascending.
    - ``cu_seqlens``: ``[B + 1]`` int32 real offsets.
    - ``cu_seqlens_padded``: ``[B + 1]`` int32 physical offsets (given, or the layout's padding).
    - ``spec``: the layout (``auto`` resolved); ``None`` where only the positions are known.
    """

    layout: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    spec: StrategySpec | None = None

    @property
    def cp_size(self) -> int:
        return self.layout.shape[0]

    def on_host(self) -> Pack:
        """The pack's tensors on the host: their host twins where uploaded with them, else copies
        (one host sync on GPUs: :func:`cpcompile.cache.on_host`)."""
        layout, cu, padded = on_host(self.layout, self.cu_seqlens, self.cu_seqlens_padded)
        return dataclasses.replace(self, layout=layout, cu_seqlens=cu, cu_seqlens_padded=padded)

    @classmethod
    def build(
        cls,
        cu_seqlens: torch.Tensor,
        cu_seqlens_padded: torch.Tensor | None,
        *,
        spec: StrategySpec,
        cp_size: int,
        num_tokens=None,
    ) -> Pack:
        """The pack of offsets a public entry checked (``checks.check_offsets``) laid out by ``spec`` (a
        layout, ``auto`` resolved) over ``cp_size`` ranks; ``num_tokens``: ``T`` where known (local
        tokens x cp), else read from the offsets. Raises ``ValueError`` where the pack does not fit the
        layout: documents of a capacity, the given padding's multiples, the token count."""
        if spec.capacity is not None:
            check_capacity_documents(cu_seqlens, spec.capacity)
        given = cu_seqlens_padded is not None
        padded = cu_seqlens_padded if given else padded_offsets(cu_seqlens, spec, cp_size)
        check_pack_tokens(cu_seqlens, padded, given=given, num_tokens=num_tokens, cp_size=cp_size, spec=spec)
        check_layout_values(padded, spec, cp_size, num_tokens)
        layout = positions(padded, spec, cp_size, num_tokens=num_tokens, cu_seqlens=cu_seqlens)
        return cls(layout, cu_seqlens, padded, spec)

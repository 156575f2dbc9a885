"""Builders shared by the test modules: strategy lists, packs, attention cases, the TP block and its backend.

Independent references (float64 attention, brute-force layouts) are in tests/reference.py;
the gloo process harness is in tests/dist.py; pytest fixtures are in tests/conftest.py.
"""

from __future__ import annotations

import random

import torch
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.testing import normalize_gm

from cpcompile import Strategy, StrategySpec
from cpcompile.tp.rewrite import overlap_matmul_pass

# --- strategies and packs ---------------------------------------------------------------------


def strategy_specs(*, stripe_size: int = 3, auto: bool = True) -> list[StrategySpec]:
    """Every concrete layout (striped with 1 and with ``stripe_size`` tokens a stripe), then ``auto`` if asked."""
    specs = [
        StrategySpec(Strategy.DUAL_CHUNK_SWAP),
        StrategySpec(Strategy.NO_LOAD_BALANCE),
        StrategySpec(Strategy.STRIPED),
        StrategySpec(Strategy.STRIPED, stripe_size=stripe_size),
        StrategySpec(Strategy.BALANCED),
    ]
    return [*specs, StrategySpec(Strategy.AUTO)] if auto else specs


#: every concrete layout, with a stripe size that does not divide typical lengths
LAYOUT_SPECS = strategy_specs(auto=False)

#: hypothesis: 1-6 document lengths of 0-30 tokens, not all 0
pack_lengths_st = st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=6).filter(lambda x: sum(x) > 0)

#: hypothesis keyword strategies for ``@given(**LAYOUT_CASE)``: a pack, a CP size of 2-4, a layout, causal or not
LAYOUT_CASE = {
    "lengths": pack_lengths_st,
    "cp": st.sampled_from([2, 3, 4]),
    "spec": st.sampled_from(LAYOUT_SPECS),
    "causal": st.booleans(),
}


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """Document lengths ``[B]`` -> their boundaries ``cu_seqlens [B + 1]`` int32, from 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def rows_of(cu: torch.Tensor, *, cp_size: int, rank: int, strategy=None):
    """What a rank's rows of pack ``cu`` under ``strategy`` are laid out for (``ShardedBatch.sharded_for``), for
    ``cp_attention(..., strategy=rows_of(...))`` on rows a test lays out itself: under CP attention must be told."""
    import cpcompile

    tokens = torch.zeros(int(cu[-1]))
    return cpcompile.shard_batch({"rows": tokens}, cu, cp_size=cp_size, rank=rank, strategy=strategy).sharded_for


def doc_lengths(cp: int, seed: int) -> list[int]:
    """6 document lengths: 1-token documents, documents shorter than cp, and one long enough to span every rank."""
    g = torch.Generator().manual_seed(seed)
    return [1, 5 * cp + 3] + torch.randint(1, 3 * cp, (3,), generator=g).tolist() + [1]


#: value head dims the float64 matrices cycle through, with ``attention_case``'s ``d = 8``: ``d`` itself,
#: and MLA's kind (values of their own head dim, DeepSeek's 192/128) below and above it
VALUE_DIMS = (None, 4, 12)
#: logit soft-capping the matrices alternate with none: a cap the random scores reach (Gemma 2's is 50)
SOFTCAPS = (None, 1.5)


def attention_case(lengths, hq=4, hkv=2, d=8, *, dv=None, padded_lengths=None, seed=0, dtype=torch.float32):
    """Random inputs of packed attention: ``(cu, cu_padded, q, k, v, dout)``.

    ``cu`` ``[B + 1]`` int32 from ``lengths``; ``cu_padded`` the same from ``padded_lengths``
    (None without them); q ``[T, hq, d]``, k ``[T, hkv, d]``, v ``[T, hkv, dv]`` and dout ``[T, hq, dv]``
    of ``dtype`` (``dv``: the value head dim, default ``d``), T the padded total when given, else the real one.
    """
    g = torch.Generator().manual_seed(seed)
    cu_padded = None if padded_lengths is None else cu_seqlens(padded_lengths)
    n = sum(padded_lengths or lengths)
    dv = d if dv is None else dv
    shapes = ((hq, d), (hkv, d), (hkv, dv), (hq, dv))
    q, k, v, dout = (torch.randn(n, h, e, generator=g, dtype=dtype) for h, e in shapes)
    return cu_seqlens(lengths), cu_padded, q, k, v, dout


# --- the tensor-parallel block and a backend that records what the overlap pass did ---------

# torch 2.13 renamed the wrappers (same ops underneath); 2.11 and 2.12 only have the old names.
all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
reduce_scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor


def sp_mlp(x, w1, b1, w2, b2, group):
    """Sequence-parallel MLP block, as Megatron writes it with functional collectives.

    x ``[t, H]`` (this rank's tokens); column-parallel w1 ``[F/tp, H]``, b1 ``[F/tp]``;
    row-parallel w2 ``[H, F/tp]``; replicated b2 ``[H]``. Returns ``[t, H]``.
    """
    h = all_gather(x, 0, group)  # [tp * t, H]
    h = F.gelu(F.linear(h, w1, b1))  # [tp * t, F/tp]
    y = reduce_scatter(h @ w2.T, "sum", 0, group)  # [t, H]
    return y + b2


def readable(gm: torch.fx.GraphModule) -> str:
    """``gm``'s code as ``print_readable`` writes it, normalized for snapshots."""
    return normalize_gm(gm.print_readable(print_output=False))


class OverlapBackend:
    """Test backend: the TP overlap pass on the Dynamo graph, then AOT autograd running the graphs as they are."""

    def __init__(self, *, capacity_tokens: int | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self.rewrites: list[int] = []  # one entry per compilation
        self.graphs: list[str] = []  # readable Dynamo graph (after the pass), AOT forward, AOT backward

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.rewrites.append(overlap_matmul_pass(gm, capacity_tokens=self.capacity_tokens))
        self.graphs.append(readable(gm))
        return aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)(gm, example_inputs)

    def _keep(self, gm, example_inputs):
        self.graphs.append(readable(gm))
        return boxed_nop(gm, example_inputs)


#: relative error allowed against float64 attention, by dtype
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
KINDS = ("one_token_docs", "single_document", "one_token_per_rank", "zero_length_docs", "many_docs", "mixed")


def random_pack(rng: random.Random, cp: int, kind: str) -> list[int]:
    """Document lengths (zeros allowed) of one of the :data:`KINDS`."""
    if kind == "one_token_docs":
        return [1] * rng.randint(1, 3 * cp)
    if kind == "single_document":
        return [rng.randint(1, 6 * cp)]
    if kind == "one_token_per_rank":  # at most cp real tokens: all but dual_chunk_swap pad to exactly cp
        total = rng.randint(1, cp)
        cut = rng.randint(0, total)
        return [n for n in (cut, total - cut) if n] or [total]
    if kind == "zero_length_docs":
        lengths = [rng.randint(1, 2 * cp) for _ in range(rng.randint(1, 4))]
        for _ in range(rng.randint(1, 3)):
            lengths.insert(rng.randint(0, len(lengths)), 0)
        return lengths
    if kind == "many_docs":
        return [rng.randint(1, 8) for _ in range(rng.randint(10, 30))]
    return [rng.randint(1, 5 * cp) for _ in range(rng.randint(2, 6))]

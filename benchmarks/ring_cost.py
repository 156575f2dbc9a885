"""Ring against all-gather CP attention: bytes moved, steps, and compute per ring step (analytic, CPU).

Bytes are per rank and per attention layer, for K/V of ``--kv-heads`` x ``--head-dim``
in bf16 and dK/dV sent in float32 (both paths sum gradients in float32):

- all-gather: forward one all-gather of K/V; backward a re-gather of K/V and a
  reduce-scatter of dK/dV (``cpcompile/attention/api.py``);
- ring: forward ``cp - 1`` K/V blocks; backward ``cp - 1`` K/V blocks and ``cp``
  dK/dV blocks (each block's gradient travels one step behind it and a last step
  hands it to its owner; ``cpcompile/attention/ring.py``).

Compute per ring step comes from the ring plans (``cpcompile.plan.ring``): the attention
pairs (query, visible key) rank ``r`` computes at step ``i``, causal. The all-gather
step costs the slowest rank's total, ``max_r sum_i``; a ring step waits for its
slowest rank, so the ring costs ``sum_i max_r``. Both are reported over the mean rank
total (1.0 = perfect balance), on real document-length mixes (``benchmarks/balance.py``'s packs).
It prints its section of ``BENCHMARKS.md``; ``--output FILE`` also writes it there.

    python benchmarks/ring_cost.py [--tokens 131072] [--doclens ../shared/data/doclens] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import cpcompile
from cpcompile import StrategySpec
from cpcompile.plan.ring import make_ring_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from balance import SHORT, STRATEGIES, cu_of, make_packs  # noqa: E402
from report import REPO, add_output_argument, header, publish  # noqa: E402

SECTION = "## Ring vs all-gather cost (benchmarks/ring_cost.py)"
CP_SIZES = (2, 4, 8, 16)


def step_pairs(lengths: list[int], spec: StrategySpec, cp: int) -> torch.Tensor:
    """``[cp, cp]`` int64: causal attention pairs rank ``r`` computes at ring step ``i``."""
    cu = cu_of(lengths)
    padded = cpcompile.layouts.pad_for_cp(cu, cp_size=cp, strategy=spec)
    pairs = torch.zeros(cp, cp, dtype=torch.long)
    for rank in range(cp):
        plan = make_ring_plan(cu, padded, cp_size=cp, rank=rank, strategy=spec)
        n = plan.cu_q.diff().long()  # [P] query rows per piece
        keys = plan.k_len_causal.long()  # [cp, P] keys per block
        work = n * keys  # other blocks: every row sees all of the piece's keys
        own = torch.where(keys[rank] > 0, n * keys[rank] - n * (n - 1) // 2, 0)  # bottom-right causal
        work[rank] = own
        for src in range(cp):
            pairs[rank, (rank - src) % cp] = work[src].sum()
    total = sum(n * (n + 1) // 2 for n in lengths)
    assert int(pairs.sum()) == total, f"plans cover {int(pairs.sum())} pairs, the pack has {total}"
    return pairs


def compute_rows(packs: dict[str, list[list[int]]]) -> tuple[list[str], dict[str, float]]:
    """The compute table's rows, and per strategy the largest ring cost over the mean rank total."""
    rows, worst_ring = [], dict.fromkeys(STRATEGIES, 0.0)
    for mix, lengths in ((m, p[0]) for m, p in packs.items()):
        for cp in CP_SIZES:
            cells = []
            for name, spec in STRATEGIES.items():
                pairs = step_pairs(lengths, spec, cp).double()
                mean = pairs.sum() / cp
                gathered = pairs.sum(1).max() / mean
                ring = pairs.max(0).values.sum() / mean
                worst_ring[name] = max(worst_ring[name], float(ring))
                cells.append(f"{gathered:.3f} / {ring:.3f}")
            step = sum(n * (n + 1) // 2 for n in lengths) / cp**2 / 1e6  # mean pairs per rank and step
            rows.append(f"| {mix} | {cp} | {len(lengths)} | {step:.0f} | " + " | ".join(cells) + " |")
    return rows, worst_ring


def byte_rows(tokens: int, kv_heads: int, head_dim: int) -> list[str]:
    rows = []
    for cp in CP_SIZES:
        block = tokens // cp * 2 * kv_heads * head_dim  # K and V values of one rank
        mb = 2.0**-20
        ag_fwd, ag_bwd = (cp - 1) * block * 2, (cp - 1) * block * (2 + 4)
        ring_fwd, ring_bwd = (cp - 1) * block * 2, (cp - 1) * block * 2 + cp * block * 4
        rows.append(
            f"| {cp} | {ag_fwd * mb:.0f} | {ag_bwd * mb:.0f} | 1 + 2 | {ring_fwd * mb:.0f} | {ring_bwd * mb:.0f} | "
            f"{cp - 1} + {2 * cp - 1} | {cp} |"
        )
    return rows


def report(args: argparse.Namespace, bytes_table: list[str], compute_table: list[str], worst_ring: dict) -> list[str]:
    return [
        *header(SECTION),
        f"Bytes sent per rank per layer (MiB; {args.tokens // 1024}K tokens, K/V {args.kv_heads} heads x"
        f" {args.head_dim} in bf16, dK/dV in float32);",
        "steps = forward + backward collectives (all-gather) or p2p steps (ring); ring calls = kernel calls per rank,",
        "forward (all-gather: 1):",
        "",
        "| cp | AG fwd | AG bwd | AG steps | ring fwd | ring bwd | ring steps | ring calls |",
        "|---|---|---|---|---|---|---|---|",
        *bytes_table,
        "",
        "Compute balance, causal, one pack per mix: all-gather `max_r total_r / mean` / ring",
        "`sum_steps max_r step_r / mean` (1.000 = every rank busy all the time). Strategies: DCS",
        "dual_chunk_swap, NLB no_load_balance, S1 / S128 striped with 1- / 128-token stripes, BAL balanced.",
        "M pairs / rank-step: the mean per-rank compute of one ring step, in millions of (query, key) pairs",
        "(x 4 x heads x head_dim FLOP forward); one step's K/V block must arrive within the slowest rank's.",
        "",
        "| mix | cp | docs | M pairs / rank-step | DCS | NLB | S1 | S128 | BAL |",
        "|---|---|---|---|---|---|---|---|---|",
        *compute_table,
        "",
        "The ring moves the same K/V bytes as the all-gather plus one float32 dK/dV block per rank, in cp - 1",
        "dependent steps. Its compute over the mean rank total, worst row by strategy: "
        + ", ".join(f"{SHORT[name]} {ratio:.3f}" for name, ratio in worst_ring.items())
        + ".",
        "Why: [docs/communication.md](docs/communication.md).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131072, help="tokens per pack")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--doclens", type=Path, default=REPO.parent / "shared" / "data" / "doclens")
    add_output_argument(parser)
    args = parser.parse_args()
    bytes_table = byte_rows(args.tokens, args.kv_heads, args.head_dim)
    compute_table, worst_ring = compute_rows(make_packs(args.doclens, args.tokens, 1))
    publish(SECTION, report(args, bytes_table, compute_table, worst_ring), args.output)


if __name__ == "__main__":
    main()

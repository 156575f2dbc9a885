"""Tier 1-2: the sparse exchange's rule and layout of returned sums (``cpcompile.comm.exchange``)."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.comm.exchange import EXCHANGE_AT, _sum_layers, use_exchange


def test_exchange_rule():
    """The sparse exchange is used when the busiest rank's rows sent or received are at most
    EXCHANGE_AT of an all-gather's; counts[r][s]: rows rank r reads from rank s."""
    assert EXCHANGE_AT == 0.75
    assert use_exchange([[10, 7], [0, 10]], 10)  # rank 0 receives 7 of 10
    assert not use_exchange([[10, 8], [0, 10]], 10)  # 8 > 7.5
    # cp=3, all-gather brings 2 x 10 rows: rank 2 sends 8 + 8 > 15, though no rank receives more than 8
    assert not use_exchange([[10, 0, 8], [0, 10, 8], [0, 0, 10]], 10)
    assert use_exchange([[10, 0, 7], [0, 10, 8], [0, 0, 10]], 10)
    assert use_exchange([[10, 10], [10, 10]], 10, "always") and not use_exchange([[10, 0], [0, 10]], 10, "never")


def test_exchange_sums_take_own_rows_then_senders_in_rank_order():
    """Each local row's gradient parts, by layer: its own compact sum, then each sender's
    returned one in rank order (a fixed order: deterministic sums)."""
    # 5 local rows; the rank reads rows 0 and 3 itself (compact rows 2 and 0); 4 compact keys;
    # rank 0 returns rows 3, 4 and rank 2 returns row 3 (rank 1, this one, and rank 3 send none)
    own_rows, own_compact = torch.tensor([0, 3]), torch.tensor([2, 0])
    send_rows, send_counts = torch.tensor([3, 4, 3]), [2, 0, 1, 0]
    spare = 4 + 3
    want = torch.tensor(
        [
            [2, spare, spare, 0, spare],  # own
            [spare, spare, spare, 4, 5],  # rank 0's, returned at rows 4 and 5
            [spare, spare, spare, 6, spare],  # rank 2's, at row 6
        ]
    )
    assert torch.equal(_sum_layers(own_rows, own_compact, send_rows, send_counts, 4, 5), want)


@pytest.mark.parametrize("kv_exchange", ["always", "never", "auto"])
def test_each_setting_runs(single_rank_group, kv_exchange):
    cu = torch.tensor([0, 3, 12, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8)
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    config = cpcompile.Config(kv_exchange=kv_exchange)
    out = cpcompile.cp_attention(q, k, v, cu, strategy="no_load_balance", config=config)
    want = cpcompile.packed_attention(q, k, v, cu)
    torch.testing.assert_close(out, want)

"""The kernels' Triton helpers, on CPU through their torch fallbacks and on CUDA.

``dead_rows`` against masks built by hand, ``sum_rows`` against loops over the layers, ``sink_grad``
against the sum written out in float64.
"""

from __future__ import annotations

import pytest
import torch

from cpcompile.kernels.triton import dead_rows, sink_grad, sum_rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")


def test_live_rows_marks_rows_that_see_a_key():
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    k_len = torch.tensor([0, 4, 1], dtype=torch.int32)
    assert dead_rows.live_rows(cu_q, k_len, 5).tolist() == [False, False, True, True, True]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("shape", [(100, 3), (70, 12, 128)])  # 1536 columns: a store of 1024, then 512
def test_dead_rows_zero_sets_those_rows_alone(device, shape):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(shape, generator=g).to(torch.bfloat16)
    live = torch.rand(shape[0], generator=g) < 0.7
    live[:40] = True  # a program of 32 rows with none dead: it must store nothing
    got = dead_rows.zero(t.to(device), live.to(device)).cpu()
    assert torch.equal(got[live], t[live]) and (got[~live] == 0).all()
    assert torch.equal(dead_rows.zero(t.to(device)[:, :2], live.to(device)).cpu(), got[:, :2])  # strided


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize(("rows", "heads"), [(100, 3), (130, 16)])  # programs of 64 rows, the last one partial
def test_dead_rows_finish_transposes_statistics_and_clears_dead_rows(device, rows, heads):
    g = torch.Generator().manual_seed(2)
    out = torch.randn(rows, heads, 8, generator=g).to(torch.bfloat16)
    stats = torch.randn(rows, heads, generator=g)
    live = torch.rand(rows, generator=g) < 0.7
    live[:64] = True  # a program with no dead row: it must store no output row
    stats[~live] = float("nan")  # rows no entry wrote hold whatever the buffer held
    got = out.to(device)
    lse = dead_rows.finish(got, stats.to(device), live.to(device)).cpu()
    expected = [[stats[r, h].item() if live[r] else float("-inf") for r in range(rows)] for h in range(heads)]
    assert lse.is_contiguous() and lse.tolist() == expected
    got = got.cpu()
    assert torch.equal(got[live], out[live]) and (got[~live] == 0).all()


@pytest.mark.gpu
@CUDA
def test_sum_rows_kernel_adds_each_keys_rows_over_layers_and_column_blocks():
    g = torch.Generator().manual_seed(0)
    rows, num_layers, keys = 300, 5, 97
    partial = torch.randn(rows + 1, 12, 128, generator=g).to(torch.bfloat16)  # 1536 columns: 1024 + 512
    partial[rows] = float("nan")  # the spare row: "no row in this layer", never read
    index = torch.randint(0, rows + 1, (num_layers, keys), generator=g)
    want = torch.zeros(keys, 12, 128)
    for layer in range(num_layers):
        for key in range(keys):
            if index[layer, key] != rows:
                want[key] += partial[index[layer, key]].float()
    assert torch.equal(sum_rows.sum_rows(partial.cuda(), index.cuda(), rows).cpu(), want)  # same order: exact
    some = torch.tensor([0, 5, 96, 40])  # only these keys, into a given tensor
    out = torch.full((keys, 12, 128), 7.0, device="cuda")
    assert sum_rows.sum_rows(partial.cuda(), index.cuda(), rows, out, some.cuda()) is out
    rest = torch.ones(keys, dtype=torch.bool)
    rest[some] = False
    assert torch.equal(out.cpu()[some], want[some]) and (out.cpu()[rest] == 7).all()
    rounded = torch.empty(keys, 12, 128, dtype=torch.bfloat16, device="cuda")  # float32 sums, rounded once
    assert torch.equal(sum_rows.sum_rows(partial.cuda(), index.cuda(), rows, rounded).cpu(), want.bfloat16())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize(("rows", "heads", "dim"), [(0, 2, 64), (1, 3, 64), (300, 8, 128), (70, 4, 192)])
def test_sink_grad_sums_each_heads_rows(device, rows, heads, dim):
    """Partial blocks of rows, a head dim that is no power of two, no rows at all, and ``dout`` strided
    (a slice of a wider tensor, sliced on the device: ``to`` would copy it contiguous) as a backward may
    hand it."""
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(rows, heads, dim + 16, generator=g).to(device, torch.bfloat16)[..., :dim]
    out = torch.randn(rows, heads, dim, generator=g).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=g)
    lse = torch.logaddexp(torch.randn(heads, rows, generator=g), sinks[:, None])
    lse[:, : rows // 3] = sinks[:, None]  # rows that see no keys: the sink's probability is 1
    share = torch.exp(sinks.double()[:, None] - lse.double())
    want = -(share * (dout.cpu().double() * out.double()).sum(-1).t()).sum(1)
    got = sink_grad.grad(dout, out.to(device), lse.to(device), sinks.to(device))
    assert got.dtype == sinks.dtype and got.device.type == device
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("layout", ["strided sinks", "expanded sinks", "token-major lse", "bf16 sinks", "no dims"])
def test_sink_grad_reads_every_layout_its_inputs_come_in(device, layout):
    """Inputs of any strides (a sink shared by every head, ``expand``-ed; ``sinks`` a strided view; ``lse`` a
    transposed ``[T, Hq]`` buffer), made on the device (``to`` would copy them contiguous), sinks in bf16 (the
    gradient in their dtype), and ``Dv = 0``: each as the sum written out in float64."""
    g = torch.Generator().manual_seed(5)
    rows, heads, dim = 70, 4, 0 if layout == "no dims" else 48
    dout, out = (torch.randn(rows, heads, dim, generator=g).to(device, torch.bfloat16) for _ in range(2))
    sinks = torch.randn(2 * heads, generator=g).to(device)
    sinks = sinks[::2] if layout == "strided sinks" else sinks[:heads]
    if layout == "expanded sinks":
        sinks = sinks[:1].expand(heads)
    elif layout == "bf16 sinks":
        sinks = sinks.to(torch.bfloat16)
    lse = torch.logaddexp(torch.randn(heads, rows, generator=g).to(device), sinks.float()[:, None])
    if layout == "token-major lse":
        lse = lse.t().contiguous().t()
    share = torch.exp(sinks.double()[:, None] - lse.double())
    want = -(share * (dout.double() * out.double()).sum(-1).t()).sum(1)
    got = sink_grad.grad(dout, out, lse, sinks)
    assert got.dtype == sinks.dtype and got.device.type == device
    tolerance = dict(rtol=1e-2, atol=1e-2) if sinks.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.double(), want, **tolerance)

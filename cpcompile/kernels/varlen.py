"""Flash-style varlen kernels behind the kernel contract (``contract``): the structure that
torch's flash kernel (``flash``) and FlashAttention-4 (``fa4``) share.

Forward is one call: ``cu_seqlens_k`` holds each piece's key start (not monotone)
and ``seqused_k`` its length, so no key is copied. The backward cannot read keys
that way: torch's flash backward has no ``seqused_k``, and FA4's writes dK/dV per
entry, so entries whose key ranges overlap overwrite each other's rows (and, with
GQA, entries whose ranges decrease share accumulator tiles). So it runs one call
over a key buffer in which each piece gets its own copy of its keys
(``metadata.scratch``), and the copies' gradients are summed back. That buffer
holds ``sum(k_len)`` rows: about ``T`` for dual_chunk_swap and no_load_balance,
more for small stripes; its size is read on the host once per plan. When the
caller knows the key ranges are consecutive (``disjoint_keys``: unpadded
single-device attention), the backward is one plain call with no copies.

A kernel that takes each entry's used rows (``seqused_q``, ``seqused_k``) and output buffers
(FA4's: ``in_place_backward``) runs its forward entries longest first (``metadata.order``:
it schedules entries in order, and a rank's long pieces would otherwise finish its call
alone), and its backward copies no key either: the pieces fall into layers whose key ranges
are disjoint and increasing (``metadata.scratch.layers``; one for no_load_balance and for
balanced under a window, two for balanced and dual_chunk_swap), and one call per layer reads
the keys in place, its entries that layer's live pieces alone
(``metadata.scratch.layer_calls``), writing dQ into one buffer and each layer's dK/dV into
its own, which are then added into the caller's buffers (``KeyGrads``, as the all-gather
passes them), handed over as they are with their index (``KeyGrads(partial=True)``: the
sparse exchange adds them to other ranks' sums), or kept as they are where there are none
and one layer reads every key. The layers' calls are independent (their own dK/dV buffers,
their pieces' own dQ rows) and run side by side on streams of their own: each call's last
thread blocks, a long piece's, then share the GPU with the other call's work instead of
running alone at its end. Up to ``IN_PLACE_LAYERS`` layers (``IN_PLACE_LAYERS_GQA`` with
grouped query heads, whose float32 dK/dV accumulators span every key of each call), and
where the keys no piece reads are fewer than the copies; else the copies, in one call, its
entries again the live pieces alone. Such a kernel's grid grows with its entries, and a
rank's plan has 5-13 live pieces among 100-150 piece slots at cp=8
(docs/attention-kernels.md, "FlashAttention-4").
"""

from __future__ import annotations

import contextlib
import functools
from typing import Protocol

import torch

from cpcompile.cache import per_plan
from cpcompile.kernels.contract import KeyPartials, Pieces, check_options, gpu_window, refuse_variant
from cpcompile.kernels.metadata import order
from cpcompile.kernels.metadata.scratch import add_back_grads, layer_calls, place_grads, scratch_rows, sum_layers
from cpcompile.kernels.sinks import joined
from cpcompile.kernels.triton import dead_rows

#: Most layers of pieces whose backward runs one call per layer in place (``in_place_backward``),
#: without and with grouped query heads: FA4's GQA backward sums dK/dV in float32 accumulators over
#: every key of a call, so a second call cost about what the copies do, until the layers' calls ran
#: side by side (docs/attention-kernels.md, "Forward entries longest first").
IN_PLACE_LAYERS = 2
IN_PLACE_LAYERS_GQA = 2


class ForwardCall(Protocol):
    def __call__(
        self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, window, softcap: float,
        seqused_k=None, seqused_q=None, sinks=None,
    ):  # fmt: skip
        """q ``[Tq, Hq, D]``, k, v ``[Tk, Hkv, D]``, ``cu_q``/``cu_k`` ``[B + 1]`` int32 (``cu_k``
        monotone unless ``seqused_k [B]`` gives the lengths), ``window``: ``(left, right)`` of
        ``varlen_attn`` (``(-1, -1)``: none), ``softcap`` the contract's (0: none; only a kernel made
        with ``variants`` is given another) -> ``(out [Tq, Hq, Dv], lse [Hq, Tq])``. ``seqused_q``
        (an ``in_place_backward`` kernel's only): ``[B]`` int32, each entry's query rows from
        ``cu_q[b]`` (``cu_q`` then not monotone; entries' rows disjoint); rows no entry holds
        are left unwritten. ``sinks`` (a ``joins_sinks`` kernel's only): ``[Hq]``, joined in the softmax."""


class BackwardCall(Protocol):
    def __call__(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, window,
        softcap: float, **rows
    ):  # fmt: skip
        """The gradients ``(dq, dk, dv)`` of one plain varlen call (``cu_k`` monotone, entries disjoint).
        ``rows`` (an ``in_place_backward`` kernel's only): ``seqused_q``, ``seqused_k`` ``[B]`` int32,
        each entry's used query rows and keys (``cu_k[b] + seqused_k[b] <= cu_k[b + 1]``), and
        ``dq``, ``dk``, ``dv``, the buffers to write (rows outside the used ones are left as they are)."""


@per_plan
def _consecutive_cu_k(k_start: torch.Tensor, k_len: torch.Tensor) -> torch.Tensor:
    """``[P + 1]`` cumulative key offsets of pieces whose key ranges are consecutive
    (``disjoint_keys``); built once per plan, shared by forward and backward."""
    return torch.cat([k_start, k_start[-1:] + k_len[-1:]])


@contextlib.contextmanager
def _side_by_side(device: torch.device, n: int):
    """``n`` stream contexts for ``n`` independent calls: on CUDA the current stream and ``n - 1`` others
    of the device, which start after the work queued so far and which the current stream waits for at
    the end; elsewhere, ``n`` no-ops. Memory the calls allocate belongs to their stream, and what
    they read or write from before stays in use until the current stream has waited for them."""
    if device.type != "cuda" or n < 2:
        yield [contextlib.nullcontext()] * n
        return
    current = torch.cuda.current_stream(device)
    others = _streams(device, n - 1)
    for stream in others:
        stream.wait_stream(current)
    try:
        yield [torch.cuda.stream(current), *map(torch.cuda.stream, others)]
    finally:  # also after an error: memory the calls use stays theirs until they are done
        for stream in others:
            current.wait_stream(stream)


@functools.cache
def _streams(device: torch.device, n: int) -> tuple[torch.cuda.Stream, ...]:
    return tuple(torch.cuda.Stream(device) for _ in range(n))


class VarlenKernel:
    """A backend (:class:`~cpcompile.kernels.contract.AttentionKernel`) made of one varlen
    forward call and one varlen backward call (module docstring)."""

    def __init__(
        self, name: str, forward_call: ForwardCall, backward_call: BackwardCall, *, in_place_backward=False,
        variants=False, joins_sinks=False,
    ):  # fmt: skip
        """``variants``: the calls run values of their own head dim and soft-capping (``contract.variant``);
        else such a call raises ``ValueError``. ``joins_sinks``: the forward call takes learnable sinks
        (``sinks=``) into its softmax; else they are applied after it (``kernels.sinks.apply``), one more
        pass over the output."""
        self._name, self._forward_call, self._backward_call = name, forward_call, backward_call
        self._in_place, self._variants, self._joins_sinks = in_place_backward, variants, joins_sinks

    def _check(self, q, v, softcap) -> None:
        if not self._variants:
            refuse_variant(self._name, q, v, softcap)

    def forward(
        self, q, k, v, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0, sinks=None
    ):  # fmt: skip
        """:meth:`~cpcompile.kernels.contract.AttentionKernel.forward`."""
        if sinks is not None and not self._joins_sinks:
            plain = self.forward(q, k, v, pieces, causal=causal, scale=scale, window=window, softcap=softcap)
            return joined(plain, sinks)
        sink = {} if sinks is None else {"sinks": sinks}
        self._check(q, v, softcap)
        band = gpu_window(self._name, causal, window, pieces)
        # The grid is sized by the bounds: tight ones save empty thread blocks. Rows of
        # padding pieces beyond max_q are skipped by the kernel and zeroed below.
        max_q, max_k = pieces.bounds(q, k)
        cu_q, k_start, k_len = pieces.tensors
        if pieces.disjoint_keys:  # consecutive key ranges, every row sees a key: the plain call
            cu_k = _consecutive_cu_k(k_start, k_len)
            return self._forward_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, band, softcap, **sink)
        if self._in_place:  # it takes each entry's query rows (seqused_q): the pieces' chunks, longest first
            entries = order.longest_first(cu_q, k_start, k_len, q.shape[0], k.shape[0], causal, band[0])
            used = {"seqused_q": entries.used_q, "seqused_k": entries.used_k}
            launch = (min(max_q, order.ROWS), max_k, causal, scale, band, softcap)
            out, lse = self._forward_call(q, k, v, entries.cu_q, entries.cu_k, *launch, **used, **sink)
        else:
            cu_k = torch.cat([k_start, k_start.new_full((1,), k.shape[0])])
            launch = (max_q, max_k, causal, scale, band, softcap)
            out, lse = self._forward_call(q, k, v, cu_q, cu_k, *launch, seqused_k=k_len, **sink)
        live = dead_rows.live_rows(cu_q, k_len, q.shape[0])
        # in place: the kernel's fresh outputs. A row of no key: lse -inf, with sinks the sink's logit
        if sinks is None:
            return dead_rows.zero(out, live), lse.masked_fill_(~live[None, :], float("-inf"))
        return dead_rows.zero(out, live), torch.where(live[None, :], lse, sinks.to(lse.dtype)[:, None])

    def backward(
        self, dout, q, k, v, out, lse, pieces: Pieces, *, causal: bool, scale: float, window=(-1, -1), softcap=0.0,
        grads=None, **options,
    ):  # fmt: skip
        """:meth:`~cpcompile.kernels.contract.AttentionKernel.backward`."""
        check_options(options, None if self._in_place else self._name)
        self._check(q, v, softcap)
        band = gpu_window(self._name, causal, window, pieces)
        max_q, max_k = pieces.bounds(q, k)
        cu_q, k_start, k_len = pieces.tensors
        call = self._backward_call
        if "layers" in options and not pieces.disjoint_keys:
            layered = (dout, q, k, v, out, lse, pieces, causal, scale, (band, softcap), max_q, max_k)
            return self._captured_backward(*layered, options["layers"], grads)
        if pieces.disjoint_keys:  # consecutive key ranges: the kernel's own layout, no copies
            cu_k = _consecutive_cu_k(k_start, k_len)
            dq, dk, dv = call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, band, softcap)
            return dq, *place_grads(dk, dv, k_start, k_len, grads)
        scratch = scratch_rows(cu_q, k_start, k_len, k.shape[0])
        max_q, max_k = min(max_q, scratch.max_q), min(max_k, scratch.max_k)  # exact: smaller grids
        n = k.shape[0]
        # in place, the layers' dK/dV buffers (and with GQA the kernel's float32 accumulators) span
        # every key, read or not; copied, only the copies: take the copies where they are fewer than
        # the keys no piece reads (an all-gather's rank reading a small part of the pack)
        few_unread = n - scratch.live_read <= scratch.rows
        live_rows = dead_rows.live_rows(cu_q, k_len, q.shape[0])  # rows whose piece sees a key
        launch = (max_q, max_k, causal, scale, band, softcap)
        most = IN_PLACE_LAYERS if q.shape[1] == k.shape[1] else IN_PLACE_LAYERS_GQA
        if self._in_place and scratch.ordered and scratch.num_layers <= most and few_unread:
            calls = layer_calls(cu_q, k_start, k_len, n, scratch.num_layers, scratch.layer_live)
            dq, dks, dvs = self._layer_calls(dout, q, k, v, out, lse, calls, scratch.num_layers, launch, True)
            dq = dead_rows.zero(dq, live_rows)
            if scratch.num_layers == 1 and grads is None and scratch.live_read == n:
                return dq, dks[:n], dvs[:n]  # each key's gradient is one piece's, written: nothing to add
            return dq, *add_back_grads(dks, dvs, scratch, grads, calls.index)
        src = scratch.src  # each piece's own copy of its keys (and a spare row past the last piece)
        # each copy ends at its piece's last query, as the keys did: the band stays in place
        kc, vc = k[src], v[src]
        if self._in_place:  # the live pieces alone as entries: one layer of disjoint copies
            calls = layer_calls(cu_q, scratch.cu[:-1], k_len, scratch.rows, 1, (scratch.live.shape[0],))
            rows = {"dq": torch.empty_like(q), "dk": torch.empty_like(kc), "dv": torch.empty_like(vc)}
            dq, dkc, dvc = self._entries_call(dout, q, kc, vc, out, lse, calls.call(0), launch, rows)
        else:
            dq, dkc, dvc = call(dout, q, kc, vc, out, lse, cu_q, scratch.cu, *launch)
        dk, dv = add_back_grads(dkc, dvc, scratch, grads)
        return dead_rows.zero(dq, live_rows), dk, dv

    def _layer_calls(self, dout, q, k, v, out, lse, calls, layers: int, launch, side_by_side: bool):
        """One in-place call per layer of ``calls`` (``metadata.scratch.LayerCalls``), side by side
        (:func:`_side_by_side`) or in turn -> ``dq`` (rows of pieces that see no key unwritten) and the
        layers' stacked ``dks``, ``dvs`` ``[L Tk + 1, Hkv, D]`` (layer ``l``'s rows ``[l Tk, (l + 1) Tk)``,
        the spare row last)."""
        n = k.shape[0]
        dq = torch.empty_like(q)  # each layer's call writes its pieces' rows
        dks, dvs = (t.new_empty((layers * n + 1, *t.shape[1:])) for t in (k, v))
        in_turn = contextlib.nullcontext([contextlib.nullcontext()] * layers)
        with _side_by_side(q.device, layers) if side_by_side else in_turn as contexts:
            for i, stream in enumerate(contexts):
                rows = {"dq": dq, "dk": dks[i * n : (i + 1) * n], "dv": dvs[i * n : (i + 1) * n]}
                with stream:
                    self._entries_call(dout, q, k, v, out, lse, calls.call(i), launch, rows)
        return dq, dks, dvs

    def _entries_call(self, dout, q, k, v, out, lse, entries, launch, rows):
        """One backward call of an ``in_place_backward`` kernel over ``entries`` (:meth:`LayerCalls.call`),
        ``launch`` its ``(max_q, max_k, causal, scale, window, softcap)``, writing ``rows`` (``dq``, ``dk``, ``dv``);
        a call without entries launches nothing."""
        if entries["seqused_q"].shape[0]:
            cu_q, cu_k = entries["cu_q"], entries["cu_k"]
            used = {"seqused_q": entries["seqused_q"], "seqused_k": entries["seqused_k"]}
            self._backward_call(dout, q, k, v, out, lse, cu_q, cu_k, *launch, **used, **rows)
        return rows["dq"], rows["dk"], rows["dv"]

    def _captured_backward(self, dout, q, k, v, out, lse, pieces, causal, scale, mask, max_q, max_k, layers, grads):
        """The backward of a call captured in a CUDA graph: ``layers`` calls in place (the bound of the pieces'
        layers, fixed for every pack the capture replays; a layer without pieces is a call whose entries use
        no rows), every size from the shapes, nothing read on the host. The sums are written at every key
        row (0 where no piece reads it), so ``grads`` may not bring buffers; with ``grads.partial`` the
        layers' rows come as they are. A pack whose pieces do not fit the layers, or whose key ranges fall,
        fails a device-side assertion: dK/dV summed without some piece would be wrong silently."""
        if grads is not None and grads.dk is not None:
            raise ValueError("a captured backward writes every dK/dV row: pass KeyGrads without buffers")
        cu_q, k_start, k_len = pieces.tensors
        n = k.shape[0]
        calls = layer_calls(cu_q, k_start, k_len, n, layers)  # every piece an entry of every call
        cu_k, used_k = calls.cu_k.view(layers, -1), calls.used_k.view(layers, -1)  # [L, P + 1], [L, P]
        live = torch.where(cu_q[1:] > cu_q[:-1], k_len, 0)
        torch._assert_async((used_k.sum(0) == live).all(), "a piece fits none of the captured layers")
        ends = cu_k[:, :-1] + used_k
        torch._assert_async((ends <= cu_k[:, 1:]).all(), "pieces' key ranges overlap or fall within a layer")
        launch = (max_q, max_k, causal, scale, *mask)  # mask: (window, softcap)
        # side by side, as outside a graph: a capture records the side stream's work as a branch of the graph
        # (forked from the capture's stream and joined back into it, its memory from the graph's pool)
        dq, dks, dvs = self._layer_calls(dout, q, k, v, out, lse, calls, layers, launch, True)
        dq = dead_rows.zero(dq, dead_rows.live_rows(cu_q, k_len, q.shape[0]))
        if grads is not None and grads.partial:
            return dq, *(KeyPartials(partial, calls.index, layers * n) for partial in (dks, dvs))
        index = calls.index if grads is None or grads.key_order is None else calls.index[:, grads.key_order]
        return dq, *(sum_layers(partial, index, layers * n) for partial in (dks, dvs))

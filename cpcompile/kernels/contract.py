"""The kernel contract: what every attention backend computes, stated once.

A backend is a module with the two functions of :class:`AttentionKernel`
(``reference``, ``flash``, ``cudnn``, ``fa4``, ``auto``); the ops call whichever
``select`` returns, so every backend must give the same answer to the same call.
A call's query pieces and their keys travel as one :class:`Pieces`, and where the
backward's dK/dV sums go as one :class:`KeyGrads`: their fields are documented there,
once, and the backends' signatures stay short.

Queries are cut into *pieces* by ``cu_q``: piece ``p`` is query rows
``[cu_q[p], cu_q[p + 1])`` and reads keys ``[k_start[p], k_start[p] + k_len[p])``
of the whole key buffer, so no key is copied per piece, and pieces' key ranges
may overlap (they are only read). Query head ``h`` reads key and value head
``h // (Hq // Hkv)``.

- Causal pieces are aligned bottom-right: row ``i`` of a piece of ``n`` rows sees
  the first ``k_len - n + 1 + i`` of its keys (a whole piece's keys when not causal).
- A ``window = (left, right)`` (``varlen_attn``'s; -1 unbounded; ``(-1, -1)`` none) narrows
  that further: row ``i`` sits at position ``x = q_pos + i`` and sees only keys whose
  position ``y`` has ``x - left <= y <= x + right``. A key's position is its row (or
  ``Pieces.k_pos``); ``q_pos`` defaults to the bottom-right alignment
  ``k_start + k_len - n`` (``Pieces.q_pos`` sets it). GPU backends run windows with
  ``right == 0`` on bottom-right aligned pieces, and any window on whole documents
  (``disjoint_keys``), and raise ``ValueError`` otherwise (:func:`gpu_window`).
- A row that sees no key (a padding piece, ``k_len = 0``; in a ring step, a piece
  with no key in the block) outputs 0 with ``lse = -inf`` and gets zero gradient.
- Values may have their own head dim ``Dv`` (multi-head latent attention: ``D = 192``,
  ``Dv = 128``); the output has it. ``softcap = c > 0`` caps each scaled score ``s`` to
  ``c * tanh(s / c)`` before the mask and softmax (Gemma 2's logit soft-capping; ``lse`` is of
  the capped scores); 0 leaves them. ``reference`` and ``fa4`` run both; ``flash`` and
  ``cudnn`` raise ``ValueError`` (:func:`refuse_variant`), and ``select`` passes them over.
- Softmax and gradients accumulate in float32 (float64 for float64 inputs).
  Backwards are reproducible run to run, except FA4's, which adds partial
  gradients with atomics (its runs differ in rounding).
  ``backward`` returns the exact sum of every piece's dK/dV, even where pieces'
  key ranges overlap, and leaves it in that dtype: callers sum it over ranks
  before the one rounding. (The GPU kernels write each piece's part in the input
  dtype, so there it is rounded once per piece before the sum.)
- Key ranges sorted by start have non-decreasing ends (prefixes of documents' keys,
  or their ``(left, 0)`` windows, as in every plan): the GPU backwards' scratch relies
  on it (``metadata.scratch.layers``; others raise ``ValueError``).
- A causal piece reads no key or at least as many keys as it has rows (every
  plan's do): cuDNN leaves the statistics of rows before a piece's first key
  undefined; ``reference`` needs no such promise.

What backends derive from the pieces is memoised per plan (``per_plan``), keyed on
tensors: they pass ``cu_q``, ``k_start`` and ``k_len`` to such functions, never a
:class:`Pieces` (a new object every call).

``tests/kernels/test_contract.py`` checks every backend's signatures against
:class:`AttentionKernel`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: == of tensor fields has no single truth value
class Pieces:
    """The query pieces of one call and the keys each reads (the piece contract: module docstring).

    ``P`` pieces over ``Tq`` query rows and ``Tk`` key rows:

    - ``cu_q``: ``[P + 1]`` int32, piece ``p``'s query rows ``[cu_q[p], cu_q[p + 1])``;
      non-decreasing from 0 to ``Tq`` (empty pieces allowed).
    - ``k_start``: ``[P]`` int32, each piece's first key row in ``k``.
    - ``k_len``: ``[P]`` int32, each piece's key count (0: it sees no key).
    - ``max_q``: launch bound, at least the query rows of every piece that sees keys
      (pieces that see none may be longer); ``None``: ``Tq``. GPU kernels size their
      grids by it.
    - ``max_k``: launch bound, at least every ``k_len``; ``None``: ``Tk``.
    - ``disjoint_keys``: the caller's promise that each piece reads the keys at its own
      rows (``k_start == cu_q[:-1]``, ``k_len == cu_q[1:] - cu_q[:-1]``: the documents
      of an unpadded pack); GPU backends then take a plain path.
    - ``q_pos``: ``[P]`` int32, the position of each piece's first query, where a window
      places its rows (``None``: bottom-right, ``k_start + k_len - n``).
    - ``k_pos``: ``[Tk]`` int64, each key row's position (``None``: its row); a ring step's
      block holds positions with gaps.
    """

    cu_q: Tensor
    k_start: Tensor
    k_len: Tensor
    max_q: int | None = None
    max_k: int | None = None
    disjoint_keys: bool = False
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(cu_q, k_start, k_len)``: what ``per_plan`` functions take."""
        return self.cu_q, self.k_start, self.k_len

    def bounds(self, q: Tensor, k: Tensor) -> tuple[int, int]:
        """The launch bounds ``(max_q, max_k)``, at most ``q``'s and ``k``'s rows."""
        max_q = q.shape[0] if self.max_q is None else min(q.shape[0], self.max_q)
        max_k = k.shape[0] if self.max_k is None else min(k.shape[0], self.max_k)
        return max_q, max_k


@dataclasses.dataclass(frozen=True, eq=False)
class KeyGrads:
    """Where :meth:`AttentionKernel.backward` puts its dK/dV sums (default: new tensors, key order).

    - ``key_order``: ``[Tk]`` int64, a permutation of the key rows: dK/dV row ``i`` is
      key ``key_order[i]``'s (default: key ``i``'s), so that the sums go to a
      reduce-scatter in the all-gather's order as they are.
    - ``dk``, ``dv``: two buffers in ``k``'s and ``v``'s shapes, given together (rows in ``key_order``),
      0 at the rows of keys that no piece reads: the sums are written into the other
      rows, in the buffers' dtype, and the buffers returned.
    - ``partial``: return the parts of the sums, not the sums (:class:`KeyPartials`), in key
      order: a caller that adds other ranks' parts anyway (the sparse exchange) then sums
      every key's rows once, where a kernel's float32 sums of its layers would be written
      and read again. Not with ``key_order`` or buffers.
    """

    key_order: Tensor | None = None
    dk: Tensor | None = None
    dv: Tensor | None = None
    partial: bool = False

    def __post_init__(self) -> None:
        if (self.dk is None) != (self.dv is None):
            raise ValueError("KeyGrads takes dk and dv together, or neither")
        if self.partial and (self.key_order is not None or self.dk is not None):
            raise ValueError("KeyGrads(partial=True) takes no key_order and no buffers: the parts come in key order")


@dataclasses.dataclass(frozen=True, eq=False)
class KeyPartials:
    """dK or dV of ``Tk`` keys as rows not yet added (what :class:`KeyGrads` ``partial`` asks for):
    key ``i``'s gradient is the sum over ``l`` of ``rows[index[l, i]]``, leaving out ``spare``.

    - ``rows``: ``[m, Hkv, D]``, in the dtype the backend computes them in (``k``'s for FA4's
      layers and the copies' rows; at least float32 for the reference), each a piece's, or a
      layer of pieces', gradient of one key, or a key's whole sum.
    - ``index``: ``[L, Tk]`` int64 rows of ``rows``; ``spare`` where layer ``l`` adds nothing
      to key ``i`` (no piece of it reads the key). ``rows[spare]``, where it exists, is never read.
    """

    rows: Tensor
    index: Tensor
    spare: int


class BackwardOptions(TypedDict, total=False):
    """Facts about a backward call that one backend uses and the others accept and ignore.

    - ``pack_keys``: where ``k`` holds only the keys that are read (the sparse exchange),
      the pack's key count; ``auto`` budgets cuDNN's backward scratch against it
      (default: ``k``'s rows).
    - ``layers``: the call is captured in a CUDA graph (``ops.captured``): at most this many
      pieces read any one key (``metadata.scratch.layers``), a bound fixed for every pack the
      capture replays. FA4's backward then reads nothing on the host: one call per layer in
      place, every dK/dV row written (``varlen``); ``reference`` ignores it; the other
      backends raise ``ValueError``.
    """

    pack_keys: int
    layers: int


def check_options(options: dict, kernel: str | None = None) -> None:
    """Raise ``TypeError`` for a keyword that is no :class:`BackwardOptions` field, as a
    misspelt keyword argument would: backends take the options as ``**options``. With
    ``kernel``, the backend's name, ``layers`` (a captured call) raises ``ValueError``: the
    backend derives host-side sizes from the plan, which a capture would replay for every pack."""
    unknown = sorted(options.keys() - BackwardOptions.__optional_keys__)
    if unknown:
        known = sorted(BackwardOptions.__optional_keys__)
        raise TypeError(f"backward() got unexpected keyword arguments {unknown}; backend options are {known}")
    if kernel is not None and "layers" in options:
        raise ValueError(
            f"kernel {kernel!r} cannot run in a CUDA graph capture (its backward sizes its work on the host, per "
            "plan): captured CP attention runs 'fa4' (or 'reference' off CUDA)"
        )


def gpu_window(kernel: str, causal: bool, window: tuple[int, int], pieces: Pieces) -> tuple[int, int]:
    """The window a GPU backend passes to its kernel (``(-1, -1)``: none beyond ``causal``), or
    ``ValueError`` where GPU backends cannot run the call's: they take one window per call,
    placed by the bottom-right alignment, which places every row where pieces' keys end at
    their last query (``(left, 0)`` windows, no ``q_pos``/``k_pos``) or where each piece reads
    its own rows (``disjoint_keys``: whole documents, any window)."""
    if window == (-1, -1) or (window == (-1, 0) and causal):
        return (-1, -1)
    if pieces.disjoint_keys and pieces.q_pos is None and pieces.k_pos is None:
        return window
    if not causal or window[1] != 0 or pieces.q_pos is not None or pieces.k_pos is not None:
        raise ValueError(
            f"kernel {kernel!r} runs sliding windows (left, 0) of the all-gather and exchange paths only, got "
            f"window_size={window} ({'a ring step' if pieces.k_pos is not None else 'keys past the query'}); "
            "use kernel='reference' (StrategySpec.kernel) for it"
        )
    return window


def variant(q: Tensor, v: Tensor, softcap: float = 0.0) -> str | None:
    """What a call with ``q`` ``[Tq, Hq, D]``, ``v`` ``[Tk, Hkv, Dv]`` and ``softcap`` asks beyond what every
    GPU backend runs, in words (``None``: nothing): a value head dim other than ``D``, soft-capping."""
    needs = []
    if v.shape[-1] != q.shape[-1]:
        needs.append(f"a value head dim ({v.shape[-1]}) other than the query/key head dim ({q.shape[-1]})")
    if softcap:
        needs.append(f"logit soft-capping (softcap={softcap})")
    return " and ".join(needs) or None


def refuse_variant(kernel: str, q: Tensor, v: Tensor, softcap: float = 0.0) -> None:
    """Raise ``ValueError`` where backend ``kernel`` is asked what it does not run (:func:`variant`)."""
    what = variant(q, v, softcap)
    if what is not None:
        raise ValueError(
            f"kernel {kernel!r} cannot run {what}: FlashAttention-4 (kernel='fa4') or the reference kernel runs it"
        )


@runtime_checkable
class AttentionKernel(Protocol):
    """An attention backend: a module with these two functions (the piece contract: module docstring).

    ``Tq`` query rows, ``Tk`` key rows, ``Hq`` query heads, ``Hkv`` key and value heads
    (``Hq % Hkv == 0``), head dim ``D`` (``Dv`` of the values). GPU backends take CUDA fp16/bf16 tensors;
    ``reference`` any device and floating dtype.
    """

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, pieces: Pieces, *, causal: bool, scale: float,
        window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Attention of every piece over its keys.

        Args:
            q: ``[Tq, Hq, D]``.
            k, v: ``[Tk, Hkv, D]``, ``[Tk, Hkv, Dv]``, ``q``'s dtype: the whole key buffer that pieces index.
            pieces: the pieces of ``q`` and the keys each reads (:class:`Pieces`).
            causal: the bottom-right causal band within each piece.
            scale: the softmax scale.
            window: ``(left, right)``, the band around each row's position (module docstring).
            softcap: ``c > 0`` caps the scaled scores to ``c * tanh(s / c)``; 0: none (module docstring).
            sinks: ``[Hq]`` learnable sinks joined to every row's softmax (``cpcompile.attention.sinks``),
                ``out`` and ``lse`` then final; ``None``: none. FA4 joins them in its kernel, the others
                after it (``kernels.sinks.apply``).

        Returns:
            ``out`` ``[Tq, Hq, Dv]`` in ``q``'s dtype; ``lse`` ``[Hq, Tq]`` float32 (float64
            for float64 inputs), the log-sum-exp of each row's scaled (and capped) scores, ``-inf``
            for rows that see no key (with sinks: of the scores and the sink, ``sinks[h]`` there).
        """
        ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pieces: Pieces, *,
        causal: bool, scale: float, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        grads: KeyGrads | None = None, **options: Unpack[BackwardOptions],
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients of :meth:`forward` with respect to ``q``, ``k`` and ``v``.

        Args:
            dout: ``[Tq, Hq, Dv]``, ``q``'s dtype: the gradient of ``out``.
            q, k, v, pieces, causal, scale, window, softcap: as given to :meth:`forward`.
            out, lse: what :meth:`forward` returned for them.
            grads: the order and buffers of the dK/dV sums (:class:`KeyGrads`; default:
                key order, new tensors).
            options: :class:`BackwardOptions`; a backend ignores those it does not use,
                and an unknown name raises ``TypeError`` (:func:`check_options`).

        Returns:
            ``dq`` ``[Tq, Hq, D]`` in ``q``'s dtype (0 for rows that see no key); ``dk``,
            ``dv`` (``k``'s and ``v``'s shapes) float32 (float64 for float64 inputs), the exact sums
            over all pieces (where each key's gradient is one piece's, so there is nothing
            to add, they may come in ``k``'s dtype: ``disjoint_keys``, or pieces whose key
            ranges are disjoint and cover every key), or ``grads``' buffers; with
            ``grads.partial``, two :class:`KeyPartials` instead.
        """
        ...

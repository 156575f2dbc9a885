"""Sliding-window (local) attention: the window argument, and the keys it leaves each piece.

``window_size = (left, right)`` follows ``varlen_attn``: a query at position ``i`` of its
document sees the keys ``j`` of that document with ``i - left <= j <= i + right``; ``-1``
leaves a side unbounded, so ``(-1, 0)`` is causal and ``(-1, -1)`` full attention.

Design constraint: a window only narrows the key range of each piece of a plan, so every
path (all-gather, sparse exchange, ring) and every layout run it through the same pieces.
A piece covering positions ``[a, b)`` of a document of ``L`` real tokens that starts at ``s``
reads the keys ``[s + max(0, a - left), s + min(L, b + right))`` (``left``/``right`` of -1:
``0`` and ``L``). With ``right == 0`` that range ends at the piece's last query, so the
kernels' bottom-right alignment still places every row; otherwise the kernel is told where
the piece's first query sits (``q_pos``), since a range cut by the document's end or start
no longer fixes it.
"""

from __future__ import annotations

import torch

from cpcompile.cache import per_plan, twinned

#: The windows that need no band: full attention and causal attention.
UNBANDED = ((-1, -1), (-1, 0))


def check_window(window_size: object, name: str = "window_size") -> tuple[int, int]:
    """``window_size`` as a ``(left, right)`` tuple of ints, each ``>= -1``; raises ``TypeError`` or
    ``ValueError`` naming ``name``, the value and what is accepted."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{name} must be a (left, right) pair of ints, got {window_size!r}")
    for side, value in zip(("left", "right"), window_size):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be a (left, right) pair of ints, got {side} = {value!r}")
        if value < -1:
            raise ValueError(f"{name} {side} must be -1 (unbounded) or >= 0, got {tuple(window_size)!r}")
    return int(window_size[0]), int(window_size[1])


def resolve_window(causal: bool, window_size: object | None) -> tuple[int, int]:
    """The ``(left, right)`` window of a call given ``causal`` and ``window_size`` (``None``: from
    ``causal`` alone). A window's right side of 0 is causal, so a window with ``causal=False``
    stands alone, and ``causal=True`` accepts only windows with ``right == 0``."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    window = check_window(window_size)
    if causal and window[1] != 0:
        raise ValueError(f"causal=True needs window_size with right = 0, got {window}; pass causal=False with it")
    return window


def is_causal(window: tuple[int, int]) -> bool:
    """Whether a window's band ends at each query (the kernels' causal alignment)."""
    return window[1] == 0


@per_plan
@twinned  # on the host where the plan has twins, uploaded with them: the exchange reads its sizes
def narrow_keys(cu_q, k_start, k_len_causal, k_len_full, left: int, right: int):
    """:func:`window_keys` of any window, as new tensors, once per plan and window (``per_plan``):
    every layer gets the same tensors, and what the ops derive from them (the exchange's plan) is
    derived once."""
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    live = k_len_full > 0  # [P] real pieces (padding and empty slots read no key)
    end = k_len_causal.long()  # one past the piece's last position in its document: b
    first = end - q_len  # the piece's first position: a
    lo = (first - left).clamp(min=0) if left >= 0 else torch.zeros_like(first)
    hi = torch.minimum(k_len_full.long(), end + right) if right >= 0 else k_len_full.long()
    n = torch.where(live, hi - lo, 0)
    doc = k_start.long()
    return (
        torch.where(live, doc + lo, doc).to(torch.int32),
        n.to(torch.int32),
        torch.where(live, doc + first, doc).to(torch.int32),
    )


def window_keys(cu_q, k_start, k_len_causal, k_len_full, window: tuple[int, int]):
    """Each piece's keys under ``window``, from a plan's tensors (:class:`cpcompile.plan.pieces.AttentionPlan`).

    Args:
        cu_q: ``[P + 1]`` int32; k_start, k_len_causal, k_len_full: ``[P]`` int32 (the plan's).
        window: ``(left, right)`` (:func:`check_window`).
    Returns:
        ``(k_start, k_len, q_pos)``, each ``[P]`` int32: the first key and the key count of each
        piece, and the physical position of its first query (the band's alignment; with
        ``right == 0`` the bottom-right one, which kernels need not be told, except on the
        ring). The windows of :data:`UNBANDED` are the plan's own tensors, with ``q_pos``
        ``None``; others :func:`narrow_keys`.
    """
    if window == (-1, 0):
        return k_start, k_len_causal, None
    if window == (-1, -1):
        return k_start, k_len_full, None
    return narrow_keys(cu_q, k_start, k_len_causal, k_len_full, *window)


def beyond_gpu(window: tuple[int, int], *, whole_documents: bool = False, ring: bool = False) -> str | None:
    """Why no GPU kernel runs a call with ``window`` (``None``: they do; ``kernels.select``'s ``band``):
    they place one window per call by the bottom-right alignment (``kernels.contract.gpu_window``),
    which holds for ``(left, 0)`` windows and for any window over whole documents."""
    if window in UNBANDED or whole_documents:
        return None
    if ring:
        return f"window_size={window} on the ring (a block's keys are not consecutive positions)"
    if window[1] != 0:
        return f"window_size={window} on pieces of documents (keys past the query)"
    return None

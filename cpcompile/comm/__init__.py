"""Every transport: what moves bytes between ranks, and nothing that computes attention.

- :mod:`~cpcompile.comm.groups`: process groups by name, and the cross-rank agreement an
  op runs before its first collective.
- :mod:`~cpcompile.comm.collectives`: row collectives (all-gather, reduce-scatter,
  all-to-all) across torch versions.
- :mod:`~cpcompile.comm.kv_gather`: the all-gather path's K/V gathers and dK/dV
  reduce-scatters, and the buffers kept for them.
- :mod:`~cpcompile.comm.exchange`: the sparse exchange's per-plan agreement on which rows
  each rank reads, and the all-to-alls that send them and return their gradients.
- :mod:`~cpcompile.comm.ring`: point-to-point rings: the CP ring's K/V rotation and the
  TP overlap's gather and reduce-scatter rings on capacity buffers.

``cpcompile.attention`` registers the ops and runs the kernels (``cpcompile.kernels``)
between these transports.
"""

"""Choosing a configuration before a run: the advisor's report and CLI (:mod:`~cpcompile.advisor.advise`,
``python -m cpcompile.advisor``), which presents the cost, communication and step-time models of
:mod:`cpcompile.cost` (the ones ``auto`` decides with at run time), and the assumed-link opt-in
:mod:`~cpcompile.advisor.comm_model`."""

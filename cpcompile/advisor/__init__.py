"""Choosing a configuration before a run: the communication model (:mod:`~cpcompile.advisor.comm_model`)
and the advisor's report and CLI (:mod:`~cpcompile.advisor.advise`, ``python -m cpcompile.advisor``)."""

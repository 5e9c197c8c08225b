"""Offline work on recorded routing traces: cache replay, Belady's optimum, predictors' evaluation.

Nothing here runs inside the engine; it reads traces of expert ids (``bench/data``) and the
runtime's own policies and predictors (``jmoe.offload``). Import the module you need:

- ``jmoe.traces.load``: trace files, loading, validation, tuning/report splits, ``TraceError``,
  ``write_trace_starts`` (a few tokens of every trace, as the same files);
- ``jmoe.traces.belady``: ``BeladyOracle``, the offline optimum as a cache policy;
- ``jmoe.traces.replay``: ``replay`` (cache and prefetch simulator, semantics in its docstring),
  ``run_one``, ``POLICIES``, ``PREFETCH_SETTINGS``;
- ``jmoe.traces.tiers``: ``replay_tiers`` (device slots above a host tier above the disk, inclusive or
  exclusive, with read-ahead; semantics in its docstring), ``run_tiers``;
- ``jmoe.traces.tuning``: LFRU and prefetch constants searched on the tuning split, ``fit_table``;
- ``jmoe.traces.comparison``: the held-out comparisons the replay reports tabulate (policies, prefetch
  settings, the tiers' grid and its equalities);
- ``jmoe.traces.evaluation``: predicted sets of a predictor over a trace, ``precision_recall``;
- ``jmoe.traces.router_guess``: the router guess (the engine's prefetch guess) on a real model;
- ``jmoe.traces.forced_routing``: ``TraceRouting``, a trace slice as the routing override of
  ``Model.generate_detailed``.

``python -m bench.replay`` is the command line over these modules (its Markdown writers: ``bench/helpers``).
Nothing here imports ``bench``.
"""

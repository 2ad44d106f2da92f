"""The tools around the library: the seed-scenario demo, its engine model, and
the baselines it compares against (vLLM's publisher and the drop-on-full fix).

Nothing in :mod:`coalesce` imports this package: ``coalesce demo`` loads it on
demand, and ``coalesce subscribe`` and the vLLM plugin never do.
"""

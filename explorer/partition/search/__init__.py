"""Helpers the partitioners share; no partitioner is registered here.

* :mod:`.fallback` -- never slower than the ``single`` and ``data-parallel`` baselines, the
  memory headroom retries, the one memory error every partitioner raises;
* :mod:`.layers` -- contiguous runs of weighted layers;
* :mod:`.op_problem`, :mod:`.list_schedule`, :mod:`.driver` -- the op-level problem, the
  list-scheduling estimate and memory repair, and the search driver that ParDNN and Baechi's
  placers share.
"""

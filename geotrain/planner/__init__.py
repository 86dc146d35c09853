"""The planner: which VMs to rent where, spot or on demand, for the lowest cost per sample.

Pure arithmetic over plain input files, with no torch or hivemind, so it starts instantly
(scipy and matplotlib load only when a plan is solved or drawn):

- inputs: :mod:`~geotrain.pricing.catalog`, :mod:`~geotrain.pricing.egress`, :mod:`~geotrain.planner.network`,
  :mod:`~geotrain.planner.profiles` (shipped defaults in ``geotrain/data/planner/``), read by
  :mod:`~geotrain.pricing.table`;
- :mod:`~geotrain.planner.model`: predicted throughput, granularity and cost of one configuration;
- :mod:`~geotrain.planner.solve`: the search (its docstring explains the MILP formulation), with
  :mod:`~geotrain.planner.problem` (inputs and request), :mod:`~geotrain.planner.prune`,
  :mod:`~geotrain.planner.size_search` (one swarm size) and :mod:`~geotrain.planner.milp` (HiGHS via scipy);
- :mod:`~geotrain.planner.report`, :mod:`~geotrain.planner.command`: `geotrain plan` and `geotrain profile`;
- :mod:`~geotrain.planner.validation`: predictions next to published measurements.

Run without the rest of geotrain: ``python -m geotrain.planner plan --profile convnext_large``.
"""

"""The planner: which VMs to rent where, spot or on demand, for the lowest cost per sample.

Pure arithmetic over plain input files, with no torch or hivemind, so it starts instantly:

- :mod:`~geotrain.planner.catalog`, :mod:`~geotrain.planner.egress`, :mod:`~geotrain.planner.network`,
  :mod:`~geotrain.planner.profiles`: the inputs (shipped defaults in ``geotrain/data/planner/``);
- :mod:`~geotrain.planner.model`: predicted throughput, granularity and cost of one configuration;
- :mod:`~geotrain.planner.solve`: the mixed-integer programs (HiGHS via scipy) that choose one;
- :mod:`~geotrain.planner.report`, :mod:`~geotrain.planner.command`: `geotrain plan` and `geotrain profile`;
- :mod:`~geotrain.planner.validation`: predictions next to published measurements.

Run without the rest of geotrain: ``python -m geotrain.planner plan --profile convnext_large``.
"""

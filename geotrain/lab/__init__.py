"""The lab: emulated regions on one machine, to run real swarms across "continents" without a cloud.

    sudo geotrain lab up --topology C            # the [EMJ24] four-continent setup
    sudo geotrain lab run us -- geotrain coordinator --host 10.77.1.2 ...
    sudo geotrain lab down

Modules: ``topology`` (the YAML format and the shipped [EMJ24] setups), ``network`` (namespaces,
veth links, TUN device, policy routing; up and down), ``relay`` (the userspace delay line with
per-pair rate limits), ``nat`` (the NAT gateway of a region behind NAT, in the relay), ``bench`` (``geotrain bench``: a swarm in the lab, measured next to the
planner's prediction) and ``command`` (the CLI). Importing this package loads neither torch nor
hivemind: the lab launches peers through the CLI, like a user.
"""

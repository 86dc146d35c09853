"""geotrain's changes to hivemind's own classes, installed in one place
(:func:`geotrain.hive.hivemind_contract.install_patches`)."""

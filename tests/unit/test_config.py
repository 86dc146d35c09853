"""The config tree: defaults, network profiles, precedence, and errors that name the key."""

from __future__ import annotations

import re

import pytest

from geotrain.config import NETWORK_PROFILES, ConfigError, load_config, parse_override, validate_config


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_need_no_file():
    config = load_config()
    assert config.swarm.run_id == "geotrain"
    assert config.task.name == "cv" and config.task.preset == "tiny"
    assert config.optimizer.grad_compression == "fp16"  # the default the [EMJ24] runs used
    assert config.optimizer.target_batch_size >= config.optimizer.batch_size_per_step


@pytest.mark.parametrize("profile", sorted(NETWORK_PROFILES))
def test_network_profile_sets_its_knobs_together(profile):
    config = load_config(set_args=[f"optimizer.network_profile={profile}"])
    for key, value in NETWORK_PROFILES[profile].items():
        assert getattr(config.optimizer, key) == value


def test_profiles_grow_more_patient_with_distance():
    order = ["loopback", "lan", "continent", "intercontinental"]
    timeouts = [NETWORK_PROFILES[name]["averaging_timeout_s"] for name in order]
    assert timeouts == sorted(timeouts)
    assert NETWORK_PROFILES["intercontinental"]["delayed_parameter_updates"] is True


def test_explicit_value_wins_over_the_profile(tmp_path):
    path = write(tmp_path, "optimizer:\n  network_profile: intercontinental\n  averaging_timeout_s: 42\n")
    config = load_config(path)
    assert config.optimizer.averaging_timeout_s == 42
    assert config.optimizer.delayed_parameter_updates is True


def test_precedence_defaults_then_file_then_set_then_flags(tmp_path):
    path = write(tmp_path, "optimizer:\n  target_batch_size: 2048\n  learning_rate: 0.1\n")
    config = load_config(path, overrides={"optimizer.target_batch_size": 8192},
                         set_args=["optimizer.target_batch_size=4096", "optimizer.learning_rate=0.2"],
                         defaults={"optimizer.learning_rate": 0.3, "optimizer.network_profile": "loopback"})
    assert config.optimizer.target_batch_size == 8192
    assert config.optimizer.learning_rate == 0.2
    assert config.optimizer.network_profile == "loopback"


def test_a_default_does_not_override_the_file(tmp_path):
    path = write(tmp_path, "optimizer:\n  network_profile: continent\n")
    config = load_config(path, defaults={"optimizer.network_profile": "loopback"})
    assert config.optimizer.network_profile == "continent"


def test_errors_list_every_wrong_key(tmp_path):
    path = write(tmp_path, "swarm:\n  port: 70000\n  colour: blue\ntask:\n  name: chess\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "swarm.port" in message and "65535" in message
    assert "swarm.colour: unknown key" in message
    assert "task.name" in message


def test_data_path_is_required_for_real_sources():
    with pytest.raises(ConfigError, match="task.data.path: required when task.data.source is 'folder'"):
        load_config(set_args=["task.data.source=folder"])


def test_identity_and_announce_addresses():
    config = load_config(overrides={"swarm.host": "0.0.0.0", "swarm.port": 31337,
                                    "swarm.announce_host": "203.0.113.7"})
    assert config.swarm.host_maddrs() == ["/ip4/0.0.0.0/tcp/31337"]
    assert config.swarm.announce_maddrs() == ["/ip4/203.0.113.7/tcp/31337"]


def test_override_syntax():
    assert parse_override("optimizer.learning_rate=0.01") == ("optimizer.learning_rate", 0.01)
    assert parse_override("swarm.initial_peers=[/ip4/1.2.3.4/tcp/1/p2p/Qm]") == (
        "swarm.initial_peers", ["/ip4/1.2.3.4/tcp/1/p2p/Qm"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("learning_rate")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(set_args=["optimizer.network_profile=continent", "task.preset=tiny"])
    path = write(tmp_path, config.to_yaml())
    assert load_config(path) == config


def test_an_unknown_network_profile_is_one_line_not_a_list_of_missing_keys():
    with pytest.raises(ConfigError) as error:
        validate_config({"optimizer": {"network_profile": "moon"}})
    lines = str(error.value).splitlines()[1:]
    assert len(lines) == 1 and "optimizer.network_profile" in lines[0] and "'moon'" in lines[0], lines


def test_a_check_of_two_keys_names_them_once():
    with pytest.raises(ConfigError) as error:
        validate_config({"optimizer": {"target_batch_size": 16, "batch_size_per_step": 32}})
    assert str(error.value).splitlines()[1].strip().startswith("optimizer.target_batch_size (16) is below")


@pytest.mark.parametrize("address, problem", [
    ("/ip4/999.1.1.1/tcp/1/p2p/12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx", "'999.1.1.1' is not an IPv4"),
    ("/ip4/10.0.0.1/tcp/1/p2p/garbage0", "peer id 'garbage0' is not base58"),
    ("/ip4/10.0.0.1/tcp/1/p2p/QmafccJR848kZ8KvPNnG5UQt6pXqGd6RBQt4fuHyKpP4r", "is not a libp2p peer id"),
    ("/p2p/12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx", "does not start with a host"),
    ("/ip4/10.0.0.1/p2p/12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx", "no /tcp/PORT"),
    ("/dns4/-bad-/tcp/1/p2p/12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx", "is not a host name"),
])
def test_peer_addresses_are_checked_before_anything_dials_them(address, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        validate_config({"swarm": {"initial_peers": [address]}})


@pytest.mark.parametrize("address", [
    "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx",
    "/ip6/::1/tcp/31337/p2p/QmafccJR848kZ8KvPNnG5UQt6pXqGd6RBQt4fuHyKpP4rQ",
    "/dns4/coordinator.example.org/tcp/31337/p2p/QmafccJR848kZ8KvPNnG5UQt6pXqGd6RBQt4fuHyKpP4rQ",
])
def test_real_peer_addresses_pass(address):
    assert validate_config({"swarm": {"initial_peers": [address]}}).swarm.initial_peers == [address]


def test_checkpoints_record_the_config_without_the_mirrors_credentials():
    config = validate_config({"coordinator": {"mirror_url": "s3://bucket/run",
                                              "mirror_options": {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}}})
    shared = config.shareable_yaml()
    assert "s3cr3t-value" not in shared and "AKIAEXAMPLE" not in shared
    assert "<redacted>" in shared and "s3://bucket/run" in shared
    assert "s3cr3t-value" in config.to_yaml()  # the resolved config beside a run keeps what the user wrote


def test_a_mirror_needs_a_coordinator_that_holds_state():
    with pytest.raises(ConfigError, match="holds no state"):
        validate_config({"coordinator": {"mirror_url": "s3://bucket/run", "hold_state": False}})


def test_powersgd_has_a_rank_of_four_by_default_and_takes_another():
    assert validate_config({"optimizer": {"grad_compression": "powersgd"}}).optimizer.powersgd_rank == 4
    assert load_config(set_args=["optimizer.grad_compression=powersgd", "optimizer.powersgd_rank=1"]
                       ).optimizer.powersgd_rank == 1
    with pytest.raises(ConfigError, match="powersgd_rank"):
        validate_config({"optimizer": {"grad_compression": "powersgd", "powersgd_rank": 0}})


@pytest.mark.parametrize("other, message", [
    ({"use_local_updates": True}, "powersgd needs gradient averaging.*use_local_updates averages parameters"),
    ({"mode": "diloco"}, "powersgd does not apply to optimizer.mode diloco"),
])
def test_powersgd_refuses_modes_without_gradient_averaging(other, message):
    with pytest.raises(ConfigError, match=message):
        validate_config({"optimizer": {"grad_compression": "powersgd", **other}})
    validate_config({"optimizer": {"grad_compression": "uniform8bit", **other}})  # the others compress those too


# -- a key written twice, and infinite numbers --------------------------------------------------------

@pytest.mark.parametrize("text, key, lines", [
    ("optimizer:\n  learning_rate: 0.1\nswarm:\n  run_id: a\noptimizer:\n  target_batch_size: 64\n", "optimizer", (1, 5)),
    ("optimizer:\n  learning_rate: 0.1\n  target_batch_size: 64\n  learning_rate: 0.2\n",
     "optimizer.learning_rate", (2, 4)),
    ("cost:\n  egress_usd_per_gb:\n    - {source: a, usd_per_gb: 1, source: b}\n",
     "cost.egress_usd_per_gb[0].source", (3, 3)),
])
def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path, text, key, lines):
    """YAML would keep the second and silently drop the first (a whole section, for one written twice)."""
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    message = str(error.value)
    assert f"key {key!r} is written twice, at line {lines[0]} and at line {lines[1]}" in message, message
    assert message.startswith(f"config {tmp_path / 'config.yaml'} is not valid YAML at line {lines[1]}")


def test_keys_merged_from_an_anchor_may_still_be_overridden(tmp_path):
    path = write(tmp_path, "coordinator:\n  mirror_options:\n    <<: {key: a, secret: b}\n    key: c\n")
    assert load_config(path).coordinator.mirror_options == {"key": "c", "secret": "b"}


@pytest.mark.parametrize("key, value", [
    ("optimizer.learning_rate", ".inf"),
    ("optimizer.learning_rate", ".nan"),
    ("optimizer.diloco.outer_learning_rate", ".inf"),
    ("optimizer.averaging_timeout_s", ".inf"),
    ("guard.ban_s", ".inf"),
    ("swarm.bootstrap_timeout_s", ".inf"),
    ("cost.instance_usd_per_hour", "{n1-standard-8: .inf}"),
])
def test_infinite_or_nan_settings_are_refused(key, value):
    with pytest.raises(ConfigError, match=re.escape(key) + r"(\.n1-standard-8)?: input should be a finite number"):
        load_config(set_args=[f"{key}={value}"])


def test_lr_inf_on_the_command_line_is_refused(capsys):
    from geotrain.cli import main

    assert main(["local", "--lr", "inf"], embedded=True) == 2
    err = capsys.readouterr().err
    assert "optimizer.learning_rate: input should be a finite number, got inf" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, expected", [
    (["--delayed-parameter-updates"], {"delayed_parameter_updates": True}),
    (["--local-updates"], {"use_local_updates": True}),
    (["--grad-compression", "uniform8bit"], {"grad_compression": "uniform8bit"}),
    (["--grad-compression", "none"], {"grad_compression": "none"}),
])
@pytest.mark.parametrize("command", ["peer", "local"])
def test_a_training_mode_flag_reaches_the_config(command, flags, expected):
    from geotrain.cli import TRAINING_FLAGS, build_parser, config_from_args

    config = config_from_args(build_parser().parse_args([command, *flags]), [TRAINING_FLAGS])
    assert {key: getattr(config.optimizer, key) for key in expected} == expected

"""The one configuration tree of geotrain, and the one place where its defaults live.

A config is YAML with these sections (every key is optional)::

    swarm:      {run_id: mnist-demo, initial_peers: [/ip4/203.0.113.7/tcp/31337/p2p/Qm...]}
    optimizer:  {network_profile: intercontinental, target_batch_size: 8192, batch_size_per_step: 64}
    task:       {name: cv, preset: resnet50, data: {source: webdataset, path: "s3://bucket/shards-{000..099}.tar"}}
    metrics:    {port: 9100, region: us-central1, cloud: gcp, instance_type: n1-standard-8}
    training:   {max_epochs: 100}
    cost:       {instance_usd_per_hour: {n1-standard-8: 0.18}, egress_budget_usd_per_hour: 2.0}

Command-line flags override it (``--target-batch-size 4096``), and so does the generic
``--set optimizer.learning_rate=0.01``. Anything a user can get wrong fails with a
:class:`ConfigError` that names the key and says what was expected.

Network profiles set the timing and traffic knobs of the optimizer together; an explicit
value in the config wins over the profile. See :data:`NETWORK_PROFILES` for the values and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from geotrain.errors import ConfigError
from geotrain.hive.dht.multiaddrs import multiaddr_problem, peer_id_problem
from geotrain.tasks.presets import PRESET_NAMES
from geotrain.text_files import load_yaml, read_user_text

TaskName = Literal["cv", "nlp", "asr", "emulated"]
NetworkProfileName = Literal["loopback", "lan", "continent", "intercontinental"]
GradCompression = Literal["none", "fp16", "uniform8bit", "powersgd"]
OptimizerName = Literal["sgd", "adam", "adamw", "lamb"]


class _Strict(BaseModel):
    # allow_inf_nan=False: every float setting is a finite number (a rate, a size, seconds); an infinite
    # learning rate or timeout is a typo, and null (None) is how a key says "no limit" where it may.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Why these values:
# - loopback: every peer on one machine (`geotrain local`, tests). Messages take microseconds, so a
#   group forms within a second and a round that has not finished in 10 s never will; on a shared
#   CPU a stuck round would otherwise stall the run for a whole minute.
# - lan: peers in one zone see ~0.5 ms RTT and multi-Gbit/s links [EMJ24 Table 3], so a group forms
#   in a few seconds and an all-reduce of a few hundred MB finishes quickly; compute and communication
#   are not overlapped because there is little communication to hide.
# - continent: regions of one continent are tens of ms apart; DHT look-ups take several round trips,
#   so matchmaking gets more time, and averaging of a large model over ~1 Gbit/s needs a longer timeout.
# - intercontinental: 100-270 ms RTT and 70-210 Mbit/s per TCP stream [EMJ24 Table 3]. A ResNet-50 round
#   (25.6M params, fp16 -> ~51 MB, each peer sending ~2*M/N to the others) takes tens of seconds, so the
#   timeout is long and delayed parameter updates overlap that time with the next epoch's compute, as
#   the [EMJ24] runs did.
# request_timeout_s bounds the wait for a group leader's answer; hivemind needs it below the
# matchmaking time, or two peers asking each other can deadlock until the averaging timeout.
# progress_refresh_s is how often a peer that sees no others looks again for their progress records;
# on a LAN a look-up is cheap, across oceans each one costs several round trips.
# progress_expiration_s is how long a peer's progress record lives; a live peer renews it every half of
# that. A peer that died without a goodbye (SIGKILL, a VM gone) stays "in the swarm" for the others
# until its record expires: they keep counting its samples and wait for it in matchmaking. Short on
# loopback and LAN, where a renewal costs milliseconds; hivemind's 60 s between continents.
# state_download_min_mbit_s and state_download_stall_s: a state donor that sends nothing for the stall
# time, or less than the minimum rate after a few seconds, is dropped for the next (nearest first:
# geotrain.hive.state.donors); the last donor gets the state's bytes at that rate. Set well below what one
# link of the profile carries (the thinnest intercontinental links of [EMJ24] Table 3 carry tens of Mbit/s).
# fp16 gradient compression halves the traffic at no measurable loss of accuracy [EMJ24 used it
# in every run]; it is the default everywhere.
NETWORK_PROFILES: dict[str, dict[str, Any]] = {
    "loopback": {
        "progress_expiration_s": 10.0,
        "matchmaking_time_s": 1.5,
        "request_timeout_s": 0.5,
        "averaging_timeout_s": 10.0,
        "progress_refresh_s": 0.5,
        "grad_compression": "fp16",
        "delayed_parameter_updates": False,
        "state_download_min_mbit_s": 20.0,
        "state_download_stall_s": 10.0,
    },
    "lan": {
        "progress_expiration_s": 20.0,
        "matchmaking_time_s": 3.0,
        "request_timeout_s": 1.0,
        "averaging_timeout_s": 60.0,
        "progress_refresh_s": 0.5,
        "grad_compression": "fp16",
        "delayed_parameter_updates": False,
        "state_download_min_mbit_s": 20.0,
        "state_download_stall_s": 10.0,
    },
    "continent": {
        "progress_expiration_s": 30.0,
        "matchmaking_time_s": 10.0,
        "request_timeout_s": 3.0,
        "averaging_timeout_s": 180.0,
        "progress_refresh_s": 1.0,
        "grad_compression": "fp16",
        "delayed_parameter_updates": False,
        "state_download_min_mbit_s": 5.0,
        "state_download_stall_s": 15.0,
    },
    "intercontinental": {
        "progress_expiration_s": 60.0,
        "matchmaking_time_s": 20.0,
        "request_timeout_s": 5.0,
        "averaging_timeout_s": 600.0,
        "progress_refresh_s": 3.0,
        "grad_compression": "fp16",
        "delayed_parameter_updates": True,
        "state_download_min_mbit_s": 1.0,
        "state_download_stall_s": 30.0,
    },
}


class SwarmConfig(_Strict):
    """How this peer joins the DHT."""

    run_id: str = Field("geotrain", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                        description="Name of the training run; peers with the same run_id train one model.")
    initial_peers: list[str] = Field(default_factory=list,
                                     description="Multiaddrs of peers already in the swarm, e.g. the coordinator's.")
    initial_peers_file: Path | None = Field(
        None, description="A trainer waits (up to bootstrap_timeout_s) for this file of addresses, written by "
                          "`geotrain coordinator --initial-peers-file`, and joins through them too.")
    known_peers_file: Path | None = Field(
        None, description="Keep the addresses of the peers this one is connected to here (rewritten every epoch) and "
                          "join through them too after a restart: a trainer rejoins while the coordinator is down. "
                          "A coordinator keeps them in STATE_DIR/known_peers.txt unless this is set.")
    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 on a cloud VM.")
    port: int = Field(0, ge=0, le=65535, description="TCP port to listen on; 0 picks a free one.")
    announce_host: str | None = Field(None, description="Public address others dial (behind 1:1 NAT).")
    announce_port: int | None = Field(None, ge=1, le=65535, description="Public port, when it differs from port.")
    identity_path: Path | None = Field(None, description="Private key file; keeps the peer id across restarts.")
    client_mode: bool = Field(False, description="Dial out only (behind NAT without open ports).")
    check_reachability: bool = Field(
        True, description="After joining, a trainer asks an initial peer to connect back to the addresses it "
                          "announces; if none connects (NAT, a closed port) it rejoins in client mode rather than be "
                          "a peer the others dial in vain.")
    bootstrap_timeout_s: float = Field(30.0, gt=0, description="How long to wait for an initial peer to answer.")
    token_file: Path | None = Field(
        None, description="A private swarm: a file holding the swarm's secret token (or set GEOTRAIN_SWARM_TOKEN); "
                          "peers without it get no DHT answers, no averaging and no state.")
    allow: list[str] = Field(
        default_factory=list, description="Peer ids admitted to averaging and state downloads (geotrain identity "
                                          "prints a peer's id); empty: every peer (with the token, if one is set).")
    allow_file: Path | None = Field(None, description="A file of admitted peer ids, one per line (# comments).")

    @model_validator(mode="after")
    def _check_allowed_peer_ids(self) -> "SwarmConfig":
        for peer_id in self.allow:
            problem = peer_id_problem(peer_id)
            if problem is not None:
                raise ValueError(f"swarm.allow: {peer_id!r} is not a peer id ({problem}); "
                                 "`geotrain identity FILE` prints a peer's id")
        return self

    @model_validator(mode="after")
    def _check_initial_peers(self) -> "SwarmConfig":
        for address in self.initial_peers:
            problem = multiaddr_problem(address)
            if problem is not None:
                raise ValueError(
                    f"swarm.initial_peers: {address!r} is not a peer's address ({problem}); expected the form "
                    "/ip4/HOST/tcp/PORT/p2p/PEER_ID, exactly as `geotrain coordinator` prints it")
        return self

    def host_maddrs(self) -> list[str]:
        return [f"/ip4/{self.host}/tcp/{self.port}"]

    def announce_maddrs(self) -> list[str] | None:
        if self.announce_host is None:
            return None
        return [f"/ip4/{self.announce_host}/tcp/{self.announce_port or self.port}"]


class DiLoCoConfig(_Strict):
    """``optimizer.mode: diloco``: local inner steps, an outer step on the averaged pseudo-gradient every round.

    Defaults are the DiLoCo paper's (Douillard et al., arXiv 2311.08105: H = 500 inner steps, outer SGD with
    Nesterov momentum, lr 0.7, momentum 0.9); docs/diloco.md shows the trade-off over H measured here.
    """

    inner_steps: int = Field(
        500, ge=1, description="H: micro-steps per trainer between outer rounds (on average: a round comes when "
                               "the swarm has done H x batch_size_per_step x trainers samples).")
    outer_learning_rate: float = Field(0.7, gt=0, description="Learning rate of the outer SGD step.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Momentum of the outer SGD step.")
    nesterov: bool = Field(True, description="Nesterov momentum for the outer step.")
    overlap_rounds: bool = Field(
        True, description="Run a round's all-reduce in the background while the next inner steps run; its outer "
                          "step lands when the all-reduce is done, keeping the inner steps taken since. false: the "
                          "trainer waits for every round (the DiLoCo paper's form).")
    matchmaking_time_s: float | None = Field(
        None, gt=0, description="How long a round waits for the trainers to meet; none: twice the network profile's "
                                "matchmaking time, at least 5 s (rounds are rare, and a trainer that misses one has to "
                                "load the others' state).")


class OptimizerConfig(_Strict):
    """The shared-batch optimizer (hivemind.Optimizer) and its timing across the network."""

    mode: Literal["sync", "diloco"] = Field(
        "sync", description="sync: the swarm averages gradients every epoch (target_batch_size samples) and steps "
                            "together; diloco: each trainer steps on its own and the swarm averages pseudo-gradients "
                            "every optimizer.diloco.inner_steps micro-steps (docs/diloco.md).")
    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    network_profile: NetworkProfileName = "lan"
    target_batch_size: int = Field(4096, gt=0, description="Samples the whole swarm accumulates per epoch.")
    batch_size_per_step: int = Field(32, gt=0, description="Samples one peer processes per micro-step.")
    optimizer: OptimizerName = "adamw"
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_compression: GradCompression
    powersgd_rank: int = Field(
        4, ge=1, description="grad_compression powersgd: rank r of the factors sent for each gradient matrix (m x n: "
                             "r (m + n) values instead of m n; lower sends less and approximates more coarsely).")
    delayed_parameter_updates: bool
    use_local_updates: bool = Field(False, description="Step locally each micro-step; average parameters instead.")
    offload_optimizer: bool = Field(
        True, description="Keep an fp32 copy of the parameters and the optimizer state in host memory (hivemind's "
                          "offload_optimizer): the GPU holds only the model and its gradients.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning rate after the warmup, by the swarm's epoch: constant, or a cosine or "
                                "linear decay to min_learning_rate at schedule_epochs.")
    warmup_epochs: int = Field(0, ge=0, description="Epochs of linear warmup from 0 to learning_rate.")
    schedule_epochs: int | None = Field(
        None, ge=1, description="Epoch at which the decay reaches min_learning_rate; default training.max_epochs.")
    min_learning_rate: float = Field(0.0, ge=0, description="Learning rate at the end of the decay.")
    grad_clip_norm: float | None = Field(
        None, gt=0, description="Clip the averaged gradients to this global L2 norm before each step; none: no clip.")
    matchmaking_time_s: float = Field(gt=0)
    averaging_timeout_s: float = Field(gt=0)
    request_timeout_s: float = Field(gt=0, description="How long to wait for a group leader's answer.")
    progress_refresh_s: float = Field(gt=0, description="How often to look for the swarm's progress when alone.")
    progress_expiration_s: float = Field(
        gt=0, description="How long a peer's progress record lives; a peer that died without a goodbye counts "
                          "for the others until then.")
    load_state_timeout_s: float = Field(
        120.0, gt=0, description="Wait at least this long for a state download; longer when the state's bytes at "
                                 "state_download_min_mbit_s need it.")
    state_download_min_mbit_s: float = Field(
        gt=0, description="A state donor still below this rate after 10 s is dropped for the next one; the last "
                          "one gets the state's bytes at this rate.")
    state_download_stall_s: float = Field(gt=0, description="A state donor that sends nothing this long is dropped.")
    state_download_max_donors: int = Field(
        3, ge=1, description="A state whose nearest current donor is in another region comes in stripes from up to "
                             "this many donors of its epoch, in as many regions, at once; 1: always from one "
                             "donor (DiLoCo always loads from one).")
    state_download_stripe_min_mb: float = Field(
        8.0, ge=0, description="Smaller states come from one donor (a striped download first asks for a header).")
    average_state_every: int = Field(1, ge=1, description="Average parameters and optimizer state every N epochs.")
    group_size: int | None = Field(
        None, ge=2, description="A swarm of a known, fixed number of trainers (geotrain local sets it): a round's "
                                "matchmaking ends as soon as this many have joined, not after the matchmaking time. "
                                "It is also the largest group: more trainers average in separate groups, so leave it "
                                "unset for a swarm that grows.")

    @model_validator(mode="before")
    @classmethod
    def _apply_network_profile(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        profile = data.get("network_profile", "lan")
        if profile not in NETWORK_PROFILES:
            return data  # the field validator reports it, naming the choices
        merged = {**NETWORK_PROFILES[profile], **data}
        if data.get("mode") == "diloco" and "delayed_parameter_updates" not in data:
            merged["delayed_parameter_updates"] = False  # no gradient averaging to delay; the profile's default
        return merged

    @model_validator(mode="after")
    def _check_timeouts(self) -> "OptimizerConfig":
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError(
                f"optimizer.request_timeout_s ({self.request_timeout_s}) must be below optimizer.matchmaking_time_s "
                f"({self.matchmaking_time_s}); otherwise matchmaking can deadlock until the averaging timeout")
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> "OptimizerConfig":
        if self.use_local_updates and self.delayed_parameter_updates:
            raise ValueError("optimizer.use_local_updates can not be combined with optimizer.delayed_parameter_updates "
                             "(on in the intercontinental network profile): local updates average no gradients to "
                             "delay; pass --no-delayed-parameter-updates")
        if self.delayed_parameter_updates and not self.offload_optimizer:
            raise ValueError("optimizer.delayed_parameter_updates needs optimizer.offload_optimizer: the delayed "
                             "step runs on the offloaded copy in the background")
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(f"optimizer.min_learning_rate ({self.min_learning_rate}) is above "
                             f"optimizer.learning_rate ({self.learning_rate}); expected a decay, not a rise")
        return self

    @property
    def round_matchmaking_time_s(self) -> float:
        """How long an averaging round waits for its group: DiLoCo's own window, else the profile's."""
        if self.mode != "diloco":
            return self.matchmaking_time_s
        if self.diloco.matchmaking_time_s is not None:
            return self.diloco.matchmaking_time_s
        return max(5.0, 2 * self.matchmaking_time_s)

    def describe_rounds(self) -> str:
        """What one epoch of the swarm is, for operators: e.g. "epochs of 4096 samples"."""
        if self.mode == "diloco":
            return f"outer rounds of {self.diloco.inner_steps} micro-steps per trainer (DiLoCo)"
        return f"epochs of {self.target_batch_size} samples"

    @model_validator(mode="after")
    def _check_mode(self) -> "OptimizerConfig":
        if self.mode != "diloco":
            return self
        if self.delayed_parameter_updates:
            raise ValueError("optimizer.delayed_parameter_updates does not apply to optimizer.mode diloco (there is "
                             "no gradient averaging to delay); remove it or pass --no-delayed-parameter-updates")
        if self.use_local_updates:
            raise ValueError("optimizer.use_local_updates does not combine with optimizer.mode diloco: DiLoCo "
                             "already steps locally, and averages pseudo-gradients instead of parameters")
        return self

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> "OptimizerConfig":
        if self.target_batch_size < self.batch_size_per_step:
            raise ValueError(
                f"optimizer.target_batch_size ({self.target_batch_size}) is below optimizer.batch_size_per_step "
                f"({self.batch_size_per_step}); expected target_batch_size >= batch_size_per_step")
        return self

    @model_validator(mode="after")
    def _check_powersgd(self) -> "OptimizerConfig":
        if self.grad_compression != "powersgd":
            return self
        if self.mode == "diloco":
            raise ValueError("optimizer.grad_compression powersgd does not apply to optimizer.mode diloco: PowerSGD "
                             "compresses sync mode's gradient averaging, and DiLoCo averages pseudo-gradients in its "
                             "state averager; use none, fp16 or uniform8bit")
        if self.use_local_updates:
            raise ValueError("optimizer.grad_compression powersgd needs gradient averaging, and "
                             "optimizer.use_local_updates averages parameters instead; use none, fp16 or uniform8bit, "
                             "or pass --no-local-updates")
        return self


class DataConfig(_Strict):
    """Where a task's samples come from."""

    source: Literal["synthetic", "folder", "webdataset"] = "synthetic"
    path: str | None = Field(None, description="Local folder/file/glob, or an fsspec URL for webdataset shards.")
    tokenizer_path: str | None = Field(None, description="NLP only: a tokenizer.json; default is built in.")
    part: str | None = Field(
        None, pattern=r"^[0-9]+/[1-9][0-9]*$",
        description="webdataset only, I/N: read only the I-th (from 0) of N disjoint parts of the shards, e.g. one "
                    "part per trainer of a VM; none: every shard, in an order of this peer's own.")

    @model_validator(mode="after")
    def _check_path(self) -> "DataConfig":
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"task.data.path: required when task.data.source is {self.source!r}")
        if self.part is not None:
            index, count = (int(number) for number in self.part.split("/"))
            if index >= count:
                raise ValueError(f"task.data.part: {self.part!r} names part {index} of {count}; parts count from 0, "
                                 f"so expected 0/{count} to {count - 1}/{count}")
            if self.source != "webdataset":
                raise ValueError("task.data.part: only for task.data.source webdataset (shards split into parts)")
        return self

    def part_index_and_count(self) -> tuple[int, int]:
        """(I, N) of ``part``; (0, 1) reads every shard."""
        if self.part is None:
            return 0, 1
        index, count = self.part.split("/")
        return int(index), int(count)


class TaskConfig(_Strict):
    name: TaskName = "cv"
    preset: str = "tiny"
    data: DataConfig = Field(default_factory=DataConfig)
    seed: int = Field(0, ge=0, description="Seed of the model's initial weights; equal on every peer.")

    @model_validator(mode="after")
    def _check_preset(self) -> "TaskConfig":
        known = PRESET_NAMES[self.name]
        if self.preset not in known:
            raise ValueError(f"task.preset: unknown preset {self.preset!r} for task {self.name!r}; "
                             f"expected one of {', '.join(known)}")
        return self


class MetricsConfig(_Strict):
    port: int | None = Field(None, ge=0, le=65535, description="Prometheus endpoint port; none disables it.")
    host: str = Field("127.0.0.1", description="Address of the metrics endpoint; loopback unless told otherwise.")
    region: str = Field("local", description="Label: the VM's region, e.g. us-central1 (startup scripts set it).")
    cloud: str = Field("local", description="Label: the VM's cloud, e.g. gcp, aws, azure (gcp and google are the "
                                            "price files' gc).")
    instance_type: str = Field("local", description="Label: the VM's instance type, e.g. g4dn.xlarge.")
    purchase: Literal["spot", "on-demand"] | None = Field(
        None, description="How the VM is rented: spot or on-demand; none: spot for a trainer, on-demand for the "
                          "coordinator (as the startup scripts rent them). With cloud, region and instance_type it "
                          "picks the VM's price from the catalog (see cost).")
    publish_interval_s: float = Field(
        5.0, gt=0, le=600, description="How often a peer measures its traffic and publishes its metric record in the "
                                       "DHT (at most 600 s: peers refuse records that live over an hour).")
    target_epoch: int | None = Field(
        None, ge=1, description="Epoch the swarm's ETA counts down to; default: training.max_epochs.")

    def purchase_for(self, role: str) -> str:
        """How this peer's VM is rented: ``purchase`` when set, else what ``role`` usually runs on."""
        return self.purchase or self.default_purchase(role)

    @staticmethod
    def default_purchase(role: str) -> str:
        """Trainers run on spot VMs; the coordinator holds the durable state, so it runs on demand."""
        return "on-demand" if role == "coordinator" else "spot"


class EgressPrice(_Strict):
    """USD per GB that the sender's cloud bills for bytes from one region to another ("*" matches any)."""

    source: str = "*"
    destination: str = "*"
    usd_per_gb: float = Field(ge=0)


class CostConfig(_Strict):
    """How the coordinator (and ``geotrain status``) prices the swarm it sees: the planner's price files.

    The swarm's $/h comes from the same files ``geotrain plan`` reads (default: the shipped
    ``geotrain/data/planner/instances.csv`` and ``egress.csv``; see :mod:`geotrain.pricing.catalog` and
    :mod:`geotrain.pricing.egress`), so a planned swarm and the running one cost the same:

    - a VM: the catalog's price for its ``metrics`` labels (cloud, region, instance_type, purchase);
      clouds are matched as the files name them (``gcp``/``google`` are ``gc``). A region the catalog
      does not list is not priced from another region.
    - egress: each peer's measured bytes per second to each region times the price the sender's cloud
      bills on that route (egress file, by continent from the catalog). Traffic within a region is free
      (VMs of one region share a zone, as the planner assumes).

    The keys below override the files. What neither prices is counted, never guessed: VMs in
    ``geotrain_swarm_unpriced_peers``, routes in ``geotrain_swarm_unpriced_routes``; give their prices
    here or in your own files. For example::

        cost:
          catalog_path: prices/instances.csv            # your provider's current prices
          instance_usd_per_hour: {n1-standard-8: 0.38}  # wins over the catalog, any cloud and region
          egress_usd_per_gb:                            # between regions; the most specific rule wins
            - {source: us-central1, destination: europe-west4, usd_per_gb: 0.02}
            - {destination: australia-southeast1, usd_per_gb: 0.15}
          egress_budget_usd_per_hour: 2.0
    """

    catalog_path: Path | None = Field(
        None, description="Instance catalog CSV, as `geotrain plan --catalog` takes; none: the shipped one.")
    egress_prices_path: Path | None = Field(
        None, description="Egress price CSV, as `geotrain plan --egress` takes; none: the shipped one.")
    instance_usd_per_hour: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Hourly price by instance type (the peers' --instance-type); wins over "
                                          "the catalog for every cloud, region and purchase.")
    egress_usd_per_gb: list[EgressPrice] = Field(
        default_factory=list, description="Rules by source and destination region (\"*\" matches any) for "
                                          "traffic between regions; the most specific match wins over the files.")
    same_region_usd_per_gb: float | None = Field(
        None, ge=0, description="Price of traffic between peers of one region; none: the planner's same_region "
                                "price of the sender's cloud (set the inter-zone price when your VMs are spread "
                                "over zones).")
    egress_budget_usd_per_hour: float | None = Field(
        None, ge=0, description="Alert when the swarm's egress costs more than this per hour.")


class PreemptionConfig(_Strict):
    """Where spot preemption notices come from (see geotrain/stopping/notices.py)."""

    source: Literal["auto", "aws", "gcp", "azure", "signal", "none"] = "auto"
    poll_interval_s: float = Field(5.0, gt=0, description="How often to ask AWS/Azure for notices (AWS: ~5 s).")
    exit_budget_s: float = Field(20.0, gt=0, description="Leave the swarm within this many seconds of a notice.")
    aws_metadata_url: str = "http://169.254.169.254"
    gcp_metadata_url: str = "http://metadata.google.internal"
    azure_metadata_url: str = "http://169.254.169.254"


COORDINATOR_PORT = 31337


class CoordinatorConfig(_Strict):
    """The coordinator's address and durable state: checkpoints of the swarm's training state."""

    port: int = Field(COORDINATOR_PORT, ge=0, le=65535,
                      description="The coordinator's DHT port (the swarm's bootstrap address) unless swarm.port is set.")
    state_dir: Path = Field(Path("geotrain-state"), description="Where the identity and the checkpoints are kept.")

    hold_state: bool = Field(True, description="Keep the swarm's state and checkpoint it; needs the run's task.")
    checkpoint_every_epochs: int = Field(10, ge=1, description="Checkpoint when the swarm is this many epochs on.")
    checkpoint_every_s: float = Field(600.0, gt=0, description="...or this many seconds after the last one.")
    refresh_in_region: bool = Field(
        True, description="Download the swarm's state every epoch while a trainer is in this coordinator's region "
                          "(metrics.region), so that the state it offers newcomers is current; off: only for "
                          "checkpoints.")
    keep_checkpoints: int = Field(3, ge=1, description="How many checkpoints to keep (locally and mirrored).")
    mirror_url: str | None = Field(None, description="fsspec URL to mirror checkpoints to, e.g. s3://bucket/run.")
    mirror_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options of the mirror, e.g. {endpoint_url: ..., key: ...}; "
                                          "credentials may also come from the storage's usual environment variables.")

    @model_validator(mode="after")
    def _check_mirror(self) -> "CoordinatorConfig":
        if self.mirror_url and not self.hold_state:
            raise ValueError("coordinator.mirror_url: a coordinator that holds no state (--no-state) writes no "
                             "checkpoints to mirror; drop --mirror-url or --no-state")
        return self


Precision = Literal["auto", "fp32", "fp16", "bf16"]


class TrainingConfig(_Strict):
    """How one trainer runs: where it computes, in which precision, how its data is read, how long."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto (the first CUDA GPU if there is one, else the CPU), cpu, cuda or cuda:N.")
    precision: Precision = Field(
        "auto", description="fp32, fp16 (autocast and a grad scaler: T4, V100) or bf16 (autocast: A10, L4, A100, "
                            "H100 and CPUs); auto picks bf16 on GPUs that have it, else fp16, and fp32 on the CPU.")
    data_workers: int = Field(2, ge=0, description="DataLoader worker processes that read, decode and augment "
                                                   "samples; 0 reads them in the training loop's own thread.")
    max_epochs: int | None = Field(None, ge=1, description="Stop after this many global epochs; none runs on.")
    data_seed: int | None = Field(None, ge=0, description="Seed of this peer's data order; default from its id.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads of this peer; none: torch's choice.")
    wait_for_peers: int = Field(1, ge=1, description="Before the first step, wait until this many trainers "
                                                     "(this one included) are in the swarm.")
    wait_for_peers_timeout_s: float = Field(
        60.0, gt=0, description="Train anyway when that many trainers have not joined within this time.")
    events_path: Path | None = Field(None, description="Write one JSON line per state change of this peer here.")
    final_agreement_timeout_s: float = Field(
        60.0, gt=0, le=1200, description="At max_epochs, how long trainers try to agree on one final state (at most "
                                         "1200 s: peers refuse records that live over an hour).")


class GuardConfig(_Strict):
    """What every peer checks so that one bad peer cannot break the swarm (docs/security.md)."""

    contribution_norm_factor: float = Field(
        30.0, gt=1, description="Refuse a peer's gradient part whose L2 norm is over this many times this peer's own "
                                "for the same part (a gradient scaled up, by a fault or on purpose).")
    max_claimed_batches: float = Field(
        2.0, ge=1, description="A peer may claim at most this many target batches of samples as its averaging "
                               "weight in one round.")
    ban_s: float = Field(600.0, ge=0, description="A peer whose contribution was refused is left out of this peer's "
                                                  "averaging groups for this long.")
    step_norm_factor: float = Field(
        10.0, gt=1, description="Skip a step whose averaged gradient norm is over this many times the median of the "
                                "last steps' (every peer sees the same average, so every peer skips it).")
    step_norm_window: int = Field(16, ge=4, description="Steps in that median; the check starts after 4.")
    keep_last_good_parameters: bool = Field(
        True, description="Keep a host-memory copy of the parameters of the last finite step and restore it if a "
                          "step or a downloaded state brings non-finite ones (one parameter-sized copy).")
    max_concurrent_downloads: int = Field(4, ge=1, description="State downloads this peer serves at once; more are "
                                                               "sent on to other donors.")


class GeotrainConfig(_Strict):
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)

    @model_validator(mode="after")
    def _check_schedule_horizon(self) -> "GeotrainConfig":
        if self.optimizer.lr_schedule != "constant" and self.schedule_epochs() is None:
            raise ValueError(f"optimizer.schedule_epochs: a {self.optimizer.lr_schedule} schedule needs the epoch its "
                             "decay ends at; set optimizer.schedule_epochs or training.max_epochs")
        return self

    def schedule_epochs(self) -> int | None:
        """The epoch at which the learning-rate decay ends."""
        return self.optimizer.schedule_epochs or self.training.max_epochs

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def shareable_yaml(self) -> str:
        """The config without secrets (the mirror's storage options hold credentials): what checkpoints record."""
        data = self.model_dump(mode="json")
        data["coordinator"]["mirror_options"] = {key: "<redacted>" for key in data["coordinator"]["mirror_options"]}
        return yaml.safe_dump(data, sort_keys=False)

    def coordinator_port(self) -> int:
        """The port the coordinator listens on: swarm.port when it was given, else coordinator.port."""
        return self.swarm.port if "port" in self.swarm.model_fields_set else self.coordinator.port


RESOLVED_CONFIG_NAME = "config.resolved.yaml"


def write_resolved_config(config: GeotrainConfig, directory: Path) -> Path:
    """The config as it was resolved (file, flags and defaults), beside the run's outputs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_CONFIG_NAME
    path.write_text(config.to_yaml())
    return path


def _describe_error(error: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "config"
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
        first_word = message.split(" ", 1)[0].rstrip(":")
        if "." in first_word and first_word.startswith(f"{key}."):
            return message  # already names its key
    if "input" in error and error["type"] not in ("missing",) and not isinstance(error["input"], dict):
        return f"{key}: {message[0].lower() + message[1:]}, got {error['input']!r}"
    return f"{key}: {message[0].lower() + message[1:]}"


def validate_config(data: dict[str, Any], origin: str = "config") -> GeotrainConfig:
    """Build the config tree, turning pydantic's errors into one message per wrong key."""
    try:
        return GeotrainConfig.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
        # an unknown network profile sets none of its keys: their "field required" would only be noise
        bad_profiles = {e["loc"][:-1] for e in errors if e["loc"][-1:] == ("network_profile",)}
        profile_keys = set(next(iter(NETWORK_PROFILES.values())))
        errors = [e for e in errors if not (e["type"] == "missing" and e["loc"][:-1] in bad_profiles
                                            and e["loc"][-1] in profile_keys)]
        lines = [_describe_error(e) for e in errors]
        raise ConfigError(f"{origin} is not valid:\n  " + "\n  ".join(lines)) from None


def _set_dotted(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    parts = dotted_key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted_key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``optimizer.learning_rate=0.01`` -> ("optimizer.learning_rate", 0.01), the value read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optimizer.learning_rate=0.01")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def read_yaml(path: Path) -> dict[str, Any]:
    text = read_user_text(path, "config", ConfigError)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"config {path} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping of sections (swarm, optimizer, task, ...), "
                          f"got {type(data).__name__}")
    return data


def _has_dotted(data: dict[str, Any], dotted_key: str) -> bool:
    node: Any = data
    for part in dotted_key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None,
                set_args: list[str] | None = None, defaults: dict[str, Any] | None = None) -> GeotrainConfig:
    """Command defaults, then a YAML file (optional), then ``--set KEY=VALUE``, then explicit flags."""
    data: dict[str, Any] = read_yaml(path) if path else {}
    for key, value in (defaults or {}).items():
        if not _has_dotted(data, key):
            _set_dotted(data, key, value)
    for text in set_args or []:
        _set_dotted(data, *parse_override(text))
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    return validate_config(data, origin=str(path) if path else "config")

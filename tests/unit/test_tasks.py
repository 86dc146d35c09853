"""The task interface: tiny presets learn, weights are reproducible, big presets have the [EMJ24] sizes."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from geotrain.config import TaskConfig
from geotrain.tasks import EMJ24_PARAMETER_COUNTS, PRESET_NAMES, build_task

TASK_NAMES = ("cv", "nlp", "asr")  # the learning tasks; "emulated" (compute emulated) is tested in tests/lab
# (optimizer learning rate, steps): a plain AdamW, as the trainer would use, with no schedule
TRAINING = {"cv": (3e-3, 30), "nlp": (3e-3, 100), "asr": (3e-3, 60)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _task(name: str, preset: str = "tiny", seed: int = 0, **data):
    return build_task(TaskConfig(name=name, preset=preset, seed=seed, data=data or {}))


def test_every_task_has_a_tiny_preset():
    assert set(PRESET_NAMES) == {*TASK_NAMES, "emulated"}
    for presets in PRESET_NAMES.values():
        assert "tiny" in presets


def test_unknown_preset_names_the_key_and_the_choices():
    config = TaskConfig.model_construct(name="cv", preset="resnet9000", seed=0, data=TaskConfig().data)
    with pytest.raises(ValueError, match=r"task\.preset.*resnet9000.*resnet50"):
        build_task(config)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_tiny_preset_learns_synthetic_data(name):
    torch.manual_seed(0)
    task = _task(name)
    model = task.build_model()
    batches = task.build_data(batch_size=16, data_seed=1)
    learning_rate, steps = TRAINING[name]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    losses = []
    for _ in range(steps):
        loss = task.loss(model, next(batches))
        assert loss.dim() == 0 and torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    print(f"{name}: mean loss of the first 10 steps {first:.3f}, of the last 10 {last:.3f}")
    assert last < 0.7 * first, f"{name}: loss fell only from {first:.3f} to {last:.3f}"


@pytest.mark.parametrize("name", TASK_NAMES)
def test_same_seed_gives_identical_weights_and_other_seeds_differ(name):
    first = _task(name, seed=7).build_model().state_dict()
    torch.rand(100)  # the trainer's own draws in between must not matter
    again = _task(name, seed=7).build_model().state_dict()
    other = _task(name, seed=8).build_model().state_dict()
    assert first.keys() == again.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first if first[key].is_floating_point())


def test_building_a_model_leaves_the_global_random_state_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    _task("cv").build_model()
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_batches_are_full_and_depend_only_on_the_data_seed(name):
    task = _task(name)
    first = next(task.build_data(batch_size=5, data_seed=11))
    again = next(task.build_data(batch_size=5, data_seed=11))
    other = next(task.build_data(batch_size=5, data_seed=12))
    assert all(value.shape[0] == 5 for value in first.values())
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert any(first[key].shape != other[key].shape or not torch.equal(first[key], other[key]) for key in first)


def test_batch_shapes_of_the_tiny_presets():
    images = next(_task("cv").build_data(4, 0))
    assert images["images"].shape == (4, 3, 32, 32) and images["labels"].dtype == torch.int64
    text = next(_task("nlp").build_data(4, 0))
    assert text["input_ids"].shape == text["labels"].shape == text["attention_mask"].shape == (4, 64)
    masked = text["labels"] != -100
    assert masked.any(dim=1).all()  # every sequence contributes to the loss
    assert 0.05 < masked.float().mean() < 0.3  # about 15% of the tokens
    speech = next(_task("asr").build_data(4, 0))
    assert speech["features"].shape == (4, 40, 150)
    assert speech["targets"].shape[0] == 4 and (speech["target_lengths"] > 0).all()


@pytest.mark.parametrize("name, preset", [(name, preset) for name, counts in EMJ24_PARAMETER_COUNTS.items()
                                          for preset in counts])
def test_big_presets_have_the_parameter_counts_of_emj24(name, preset):
    # [EMJ24] section 3 lists the sizes; building on the meta device allocates no weights
    expected = EMJ24_PARAMETER_COUNTS[name][preset]
    assert _task(name, preset).parameter_count() == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("preset", ["whisper-tiny", "whisper-base", "whisper-small"])
def test_whisper_sized_presets_match_whisper_encoders(preset):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from geotrain.tasks.speech import PRESETS, VOCAB_SIZE

    spec = PRESETS[preset]
    config = WhisperConfig(d_model=spec.width, encoder_layers=spec.num_layers, encoder_attention_heads=spec.num_heads,
                           encoder_ffn_dim=spec.feed_forward_size, num_mel_bins=spec.num_mel_bins,
                           max_source_positions=round(spec.window_s * 50), vocab_size=100, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    with torch.device("meta"):
        whisper = WhisperEncoder(config)
    # Whisper stores its sinusoidal positions as a (frozen) parameter; ours are computed
    whisper_count = sum(p.numel() for name, p in whisper.named_parameters() if "embed_positions" not in name)
    ctc_head = spec.width * VOCAB_SIZE + VOCAB_SIZE
    assert _task("asr", preset).parameter_count() == whisper_count + ctc_head


def test_tiny_presets_are_small():
    assert _task("cv").parameter_count() < 1_000_000
    assert _task("nlp").parameter_count() < 500_000
    assert _task("asr").parameter_count() < 500_000


def _modules_loaded_after_each(*steps: str) -> list[set[str]]:
    """The top-level modules loaded after each step of code, run one after the other in one fresh Python."""
    script = "import sys\n" + "".join(f"{code}\nprint(' '.join(sys.modules))\n" for code in steps)
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return [{name.split(".")[0] for name in line.split()} for line in output.splitlines()[-len(steps):]]


def _modules_loaded_after(code: str) -> set[str]:
    return _modules_loaded_after_each(code)[0]


def test_importing_the_package_or_the_config_loads_no_heavy_library():
    # the config validates presets against PRESET_NAMES: a CLI's --help must not wait for torch
    loaded = _modules_loaded_after("import geotrain.tasks, geotrain.config\ngeotrain.config.TaskConfig(name='nlp')")
    assert not loaded & {"torch", "timm", "transformers", "torchaudio"}
    from geotrain.tasks import Task

    assert Task.__name__ == "Task"  # still importable by name, on demand


def test_a_cv_run_never_loads_transformers_or_torchaudio():
    loaded = _modules_loaded_after(
        "from geotrain.config import TaskConfig\n"
        "from geotrain.tasks import build_task\n"
        "task = build_task(TaskConfig(name='cv'))\n"
        "model = task.build_model(); task.loss(model, next(task.build_data(2, 0))).backward()")
    assert "timm" in loaded
    assert not loaded & {"transformers", "torchaudio"}


def test_a_peer_of_another_task_loads_timm_only_for_its_lamb_optimizer():
    # timm brings torchvision and torch's compiler: about 2 s of every (re)joining peer's start
    peer, with_lamb = _modules_loaded_after_each(
        "import geotrain.trainer, geotrain.coordinator",
        "from geotrain.hive.optim.factory import optimizer_class_of\n"
        "assert optimizer_class_of('adamw').__name__ == 'AdamW'\n"
        "assert 'timm' not in sys.modules\n"
        "assert optimizer_class_of('lamb').__module__.startswith('timm.')")
    assert "torch" in peer and "hivemind" in peer
    assert not peer & {"timm", "torchvision", "transformers", "torchaudio"}
    assert "timm" in with_lamb

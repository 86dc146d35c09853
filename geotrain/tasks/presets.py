"""Names of the task presets, and the model sizes they reproduce: pure data, safe to import anywhere.

The config validates ``task.preset`` against :data:`PRESET_NAMES` without importing torch, and the
planner may read :data:`EMJ24_PARAMETER_COUNTS` to size a run before any model exists. The
architectures behind these names live in the domain modules (``vision``, ``language``, ``speech``).
"""

from __future__ import annotations

import re


class EmulatedPresets(tuple):
    """Presets of the ``emulated`` task: ``tiny``, or a planner profile's model ``PROFILE[@GPU][/DIVISOR]``.

    ``convnext_large`` emulates ConvNextLarge on the profile's first GPU (a T4): 197.8M parameters and
    the profile's seconds per sample; ``convnext_large@A10/80`` the same on an A10 with an 80 times
    smaller model. Any planner profile name is accepted here; the task says so when it does not exist.
    """

    PATTERN = re.compile(r"^(?P<profile>[A-Za-z0-9_.-]+?)(?:@(?P<gpu>[A-Za-z0-9]+))?(?:/(?P<divisor>[1-9][0-9]*))?$")

    def __contains__(self, preset: object) -> bool:
        return isinstance(preset, str) and bool(self.PATTERN.match(preset))


# "tiny" comes first in each: it is the default, trains on a laptop CPU, and is what tests and demos use.
PRESET_NAMES: dict[str, tuple[str, ...]] = {
    "cv": ("tiny", "resnet18", "resnet50", "resnet152", "wide_resnet101_2", "convnext_large"),
    "nlp": ("tiny", "roberta-base", "roberta-large", "xlm-roberta-large"),
    "asr": ("tiny", "whisper-tiny", "whisper-base", "whisper-small"),
    # compute emulated by sleeping a profile's GPU time (geotrain/tasks/emulated.py; used by `geotrain bench`)
    "emulated": EmulatedPresets(("tiny", "convnext_large", "roberta_xlm", "PROFILE[@GPU][/DIVISOR]")),
}

# Parameter counts of the models trained in [EMJ24] (A. Erben, R. Mayer, H.-A. Jacobsen, "How Can We Train
# Deep Learning Models Across Clouds and Continents? An Experimental Study", PVLDB 17(6), 2024, section 3).
# The presets of the same name build models whose parameter_count() is within 1% of these (tests check it).
# The Whisper models of [EMJ24] are encoder-decoders; our ASR presets are their encoders with a CTC head,
# so they have no entry here (see geotrain/tasks/speech.py for what "whisper-sized" means).
EMJ24_PARAMETER_COUNTS: dict[str, dict[str, int]] = {
    "cv": {
        "resnet18": 11_700_000,
        "resnet50": 25_600_000,
        "resnet152": 60_200_000,
        "wide_resnet101_2": 126_900_000,
        "convnext_large": 197_800_000,
    },
    "nlp": {
        "roberta-base": 124_700_000,
        "roberta-large": 355_400_000,
        "xlm-roberta-large": 560_100_000,  # "RoBERTa-XLM" in [EMJ24]
    },
}

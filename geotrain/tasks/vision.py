"""Image classification (task ``cv``) with timm models, as in the [EMJ24] ImageNet-1K runs.

Presets: the five CNNs of [EMJ24] at ImageNet shape (224x224 RGB, 1000 classes), built from timm with
random init, and ``tiny``, a four-stage ResNet with 16-128 channels on 32x32 images and 10 classes that
steps in a few tens of ms on a laptop CPU. Batches are ``{"images": float (B, 3, H, W), "labels": int64 (B,)}``;
the loss is cross-entropy. Images from files (folders and shards) for the timm presets go through timm's
ImageNet training transforms for the model (random resized crop, horizontal flip, colour jitter, then the
ImageNet mean and standard deviation), in the DataLoader's worker processes; the ``tiny`` preset's are
resized, centre-cropped and normalised the same way, without augmentation.

Synthetic data: every class has a fixed smooth "prototype" image (drawn once from a constant seed, so
every peer shares the distribution); a sample is its class prototype plus per-pixel Gaussian noise.
A small model separates the classes within about a hundred steps.

Used through :func:`geotrain.tasks.build_task`; data conventions are in ``geotrain/tasks/data.py``.
"""

from __future__ import annotations

import functools
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import timm
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from timm.models.resnet import BasicBlock, ResNet

from geotrain.tasks import data
from geotrain.tasks.base import Batch, Task, check_part, to_model_device

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# One distribution for every peer and every data_seed: data_seed picks samples, never the dataset.
SYNTHETIC_DISTRIBUTION_SEED = 1_000_003
SYNTHETIC_PROTOTYPE_PX = 4  # prototypes are this coarse, then upsampled: smooth images a CNN picks up fast
SYNTHETIC_NOISE_STD = 1.0


@dataclass(frozen=True)
class VisionPreset:
    timm_name: str | None  # None: the hand-sized tiny ResNet
    image_size_px: int
    num_classes: int


PRESETS: dict[str, VisionPreset] = {
    "tiny": VisionPreset(None, image_size_px=32, num_classes=10),
    # Parameter counts from [EMJ24] section 3 (see presets.EMJ24_PARAMETER_COUNTS); timm's builds match them.
    "resnet18": VisionPreset("resnet18", 224, 1000),  # 11.7M
    "resnet50": VisionPreset("resnet50", 224, 1000),  # 25.6M
    "resnet152": VisionPreset("resnet152", 224, 1000),  # 60.2M
    "wide_resnet101_2": VisionPreset("wide_resnet101_2", 224, 1000),  # 126.9M
    "convnext_large": VisionPreset("convnext_large", 224, 1000),  # 197.8M
}


class VisionTask(Task):
    name = "cv"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.spec = PRESETS[config.preset]

    def _create_model(self) -> torch.nn.Module:
        if self.spec.timm_name is None:
            # one BasicBlock per stage and a quarter of ResNet18's widths: ~0.33M parameters
            return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=self.spec.num_classes,
                          channels=(16, 32, 64, 128), stem_width=16)
        return timm.create_model(self.spec.timm_name, pretrained=False, num_classes=self.spec.num_classes)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        batch = to_model_device(model, batch)
        return F.cross_entropy(model(batch["images"]), batch["labels"])

    def batch_stream(self, batch_size: int, data_seed: int, part: tuple[int, int] = (0, 1)) -> data.BatchStream:
        source, path = self.config.data.source, self.config.data.path
        check_part(part, source)
        if source == "synthetic":
            return data.BatchStream(functools.partial(self._synthetic_batches, batch_size, data_seed),
                                    f"synthetic {self.preset} images")
        self._train_transform  # built here, so that forked workers inherit it
        if source == "folder":
            files = _image_folder(path, self.spec.num_classes, self.preset)
            return data.BatchStream(functools.partial(self._folder_batches, files, batch_size, data_seed),
                                    f"image folder {path!r}")
        shards = data.open_shards(path, data_seed, part)
        return data.BatchStream(functools.partial(self._webdataset_batches, shards, batch_size),
                                f"webdataset shards {path!r}")

    @functools.cached_property
    def _train_transform(self):
        """timm's ImageNet training transform for the preset's model; None for ``tiny`` (no augmentation)."""
        if self.spec.timm_name is None:
            return None
        from timm.data import create_transform, resolve_data_config
        from timm.models import get_pretrained_cfg

        pretrained = get_pretrained_cfg(self.spec.timm_name)  # the registry's defaults; nothing is downloaded
        size_px = self.spec.image_size_px
        config = resolve_data_config({"input_size": (3, size_px, size_px)},
                                     pretrained_cfg=pretrained.to_dict() if pretrained is not None else None)
        return create_transform(**config, is_training=True)

    def _image(self, encoded: bytes) -> torch.Tensor:
        """A normalised (3, size, size) training image from the bytes of an image file."""
        transform = self._train_transform
        if transform is None:
            return _decode_image(encoded, self.spec.image_size_px)
        with Image.open(io.BytesIO(encoded)) as image:
            return transform(image.convert("RGB"))

    def _synthetic_batches(self, batch_size: int, data_seed: int, worker: int, _workers: int) -> Iterator[Batch]:
        size_px, num_classes = self.spec.image_size_px, self.spec.num_classes
        distribution = torch.Generator().manual_seed(SYNTHETIC_DISTRIBUTION_SEED)
        prototypes = torch.randn(num_classes, 3, SYNTHETIC_PROTOTYPE_PX, SYNTHETIC_PROTOTYPE_PX, generator=distribution)
        draws = torch.Generator().manual_seed(data.worker_seed(data_seed, "synthetic", worker))
        while True:
            labels = torch.randint(num_classes, (batch_size,), generator=draws)
            clean = F.interpolate(prototypes[labels], size=(size_px, size_px), mode="bilinear", align_corners=False)
            noise = torch.randn(batch_size, 3, size_px, size_px, generator=draws) * SYNTHETIC_NOISE_STD
            yield {"images": clean + noise, "labels": labels}

    def _folder_batches(self, files: list[tuple[Path, int]], batch_size: int, data_seed: int, worker: int,
                        workers: int) -> Iterator[Batch]:
        description = f"image folder {self.config.data.path!r}"

        def samples():
            for _, (file, label) in data.worker_passes(files, data_seed, worker, workers, description):
                try:
                    image = self._image(file.read_bytes())
                except (OSError, UnidentifiedImageError) as error:
                    raise data.DataSourceError(f"image {str(file)!r} cannot be read ({error}); expected an image "
                                               f"file ({'/'.join(IMAGE_SUFFIXES)})") from None
                yield image, label

        return data.batches(samples(), batch_size, _collate)

    def _webdataset_batches(self, shards: data.ShardStream, batch_size: int, _worker: int,
                            _workers: int) -> Iterator[Batch]:
        return data.batches(self._webdataset_samples(iter(shards)), batch_size, _collate)

    def _webdataset_samples(self, shard_samples: Iterator[dict]) -> Iterator[tuple[torch.Tensor, int]]:
        for sample in shard_samples:
            _, image_bytes = data.require_field(sample, tuple(s[1:] for s in IMAGE_SUFFIXES), "an image per sample")
            _, label_bytes = data.require_field(sample, ("cls",), "the class index as text, e.g. 000123.cls")
            where = f"webdataset shard {sample['__url__']!r}, sample {sample['__key__']!r}"
            try:
                label = int(label_bytes.decode().strip())
            except (ValueError, UnicodeDecodeError) as error:
                raise data.DataSourceError(f"{where}: .cls is not an integer class index ({error})") from None
            try:
                image = self._image(image_bytes)
            except (OSError, UnidentifiedImageError) as error:
                raise data.DataSourceError(f"{where}: the image cannot be decoded ({error})") from None
            if not 0 <= label < self.spec.num_classes:
                raise data.DataSourceError(f"{where}: class index {label} is outside 0..{self.spec.num_classes - 1}, "
                                           f"the classes of preset {self.preset!r}")
            yield image, label


def _image_folder(path: str, num_classes: int, preset: str) -> list[tuple[Path, int]]:
    """(image file, class index) pairs of an image folder with one sub-folder per class."""
    root = Path(path).expanduser()
    expected = "an image folder with one sub-folder per class, e.g. PATH/cat/1.jpg, PATH/dog/2.jpg"
    if not root.is_dir():
        raise data.DataSourceError(f"task.data.path {path!r}: not a directory; expected {expected}")
    class_dirs = sorted(child for child in root.iterdir() if child.is_dir() and not child.name.startswith("."))
    if not class_dirs:
        raise data.DataSourceError(f"task.data.path {path!r}: has no class sub-folders; expected {expected}")
    if len(class_dirs) > num_classes:
        raise data.DataSourceError(f"task.data.path {path!r}: has {len(class_dirs)} class sub-folders but preset "
                                   f"{preset!r} has {num_classes} classes; expected at most {num_classes}")
    files = [(file, label) for label, class_dir in enumerate(class_dirs)
             for file in sorted(class_dir.rglob("*")) if file.is_file() and file.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise data.DataSourceError(f"task.data.path {path!r}: no image files ({'/'.join(IMAGE_SUFFIXES)}) in its "
                                   f"class sub-folders; expected {expected}")
    logger.info("image folder %s: %d images in %d classes", path, len(files), len(class_dirs))
    return files


def _decode_image(encoded: bytes, size_px: int) -> torch.Tensor:
    """A normalised (3, size, size) tensor: shorter side resized to ``size_px``, then centre-cropped."""
    with Image.open(io.BytesIO(encoded)) as image:
        image = image.convert("RGB")
        scale = size_px / min(image.size)
        width, height = max(size_px, round(image.width * scale)), max(size_px, round(image.height * scale))
        image = image.resize((width, height), Image.BILINEAR)
        left, top = (width - size_px) // 2, (height - size_px) // 2
        image = image.crop((left, top, left + size_px, top + size_px))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (pixels - mean) / std


def _collate(samples: list[tuple[torch.Tensor, int]]) -> Batch:
    images, labels = zip(*samples)
    return {"images": torch.stack(images), "labels": torch.tensor(labels, dtype=torch.int64)}

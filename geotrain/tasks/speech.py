"""Speech recognition (task ``asr``): a Whisper-sized encoder with a CTC head on log-Mel features.

[EMJ24] trained Whisper Tiny/Base/Small on Common Voice. We train only the encoder half, with a linear CTC
head over characters, so a run needs no decoder, no 51k-token vocabulary and no beam search:

- ``whisper-tiny``, ``whisper-base``, ``whisper-small``: "sized" means the encoder is Whisper's encoder at
  that size, layer for layer: 80 log-Mel bins, two 3-wide convolutions (the second with stride 2, so 50
  positions per second), sinusoidal positions, pre-LayerNorm transformer blocks (width / blocks / heads /
  feed-forward = 384/4/6/1536, 512/6/8/2048, 768/12/12/3072), a final LayerNorm; and clips padded to
  Whisper's 30 s window. The parameter count is Whisper's encoder's, less its stored table of fixed
  positions (ours are computed), plus the CTC head: 7.6M, 19.8M and 87.0M (a test checks it against
  transformers' WhisperEncoder); not the 39M/74M/244M of the full encoder-decoder models.
- ``tiny``: the same architecture at width 64 with 2 blocks, 40 Mel bins and 1.5 s clips.

Features follow Whisper's front end (16 kHz audio, 25 ms windows every 10 ms, log10 Mel power clamped to
8 decades below its maximum), then each clip is standardised to zero mean and unit variance, which lets
small models leave CTC's all-blank plateau quickly (see :func:`standardise`). Padding frames are zero and
masked out of attention and of the loss. Batches are ``{"features": float (B, mels, frames),
"feature_lengths": int64 (B,), "targets": int64 (B, longest transcript), "target_lengths": int64 (B,)}``;
the loss is CTC, averaged over the batch after dividing each utterance's loss by its transcript length.

Decoding, resampling, padding and the log-Mel features of each batch are computed where the batch is made:
in each DataLoader worker, on its own share of the files or shards.

Characters: blank (id 0), space, apostrophe, a-z. Transcripts are lower-cased, other whitespace becomes a
space, and characters outside the set are dropped. Clips longer than the preset's window are skipped
with a warning.

Synthetic data: a random string of letters, each letter rendered as 0.1 s of a tone with its own fixed
pitch (250 Hz to 6 kHz, evenly spaced on the Mel scale so that Mel bins tell them apart) under a smooth
envelope, plus noise; the transcript is the letters.
"""

from __future__ import annotations

import functools
import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from geotrain.tasks import data
from geotrain.tasks.base import Batch, Task, check_part, to_model_device

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16_000
WINDOW_SAMPLES = 400  # 25 ms at 16 kHz, as in Whisper
HOP_SAMPLES = 160  # 10 ms: 100 feature frames per second
CHARACTERS = " 'abcdefghijklmnopqrstuvwxyz"
BLANK_ID = 0  # CTC blank; character i of CHARACTERS has id i + 1
VOCAB_SIZE = len(CHARACTERS) + 1
AUDIO_SUFFIXES = (".wav", ".flac")

SYNTHETIC_LETTER_S = 0.1
SYNTHETIC_LOWEST_PITCH_HZ = 250.0
SYNTHETIC_HIGHEST_PITCH_HZ = 6000.0
SYNTHETIC_NOISE_STD = 0.02


@dataclass(frozen=True)
class SpeechPreset:
    width: int
    num_layers: int
    num_heads: int
    feed_forward_size: int
    num_mel_bins: int
    window_s: float  # every clip is padded to this length; longer clips are skipped


PRESETS: dict[str, SpeechPreset] = {
    "tiny": SpeechPreset(64, 2, 2, 256, num_mel_bins=40, window_s=1.5),
    # Whisper's encoder dimensions (Radford et al., "Robust Speech Recognition via Large-Scale Weak
    # Supervision", 2022, Table 1); [EMJ24] trained these three model sizes.
    "whisper-tiny": SpeechPreset(384, 4, 6, 1536, num_mel_bins=80, window_s=30.0),
    "whisper-base": SpeechPreset(512, 6, 8, 2048, num_mel_bins=80, window_s=30.0),
    "whisper-small": SpeechPreset(768, 12, 12, 3072, num_mel_bins=80, window_s=30.0),
}


# ------------------------------------------------------------------------------------------------ model

class SelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)  # a key bias shifts every score of a query equally
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = [projection(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                 for projection in (self.query, self.key, self.value)]
        attended = F.scaled_dot_product_attention(*heads, attn_mask=keep[:, None, None, :])
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, num_heads: int, feed_forward_size: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = SelfAttention(width, num_heads)
        self.feed_forward_norm = nn.LayerNorm(width)
        self.feed_forward = nn.Sequential(nn.Linear(width, feed_forward_size), nn.GELU(),
                                          nn.Linear(feed_forward_size, width))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), keep)
        return x + self.feed_forward(self.feed_forward_norm(x))


class SpeechEncoderCTC(nn.Module):
    """Whisper-style encoder plus a linear CTC head: log-Mel frames in, per-position log-probabilities out."""

    def __init__(self, spec: SpeechPreset, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(spec.num_mel_bins, spec.width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(spec.width, spec.width, kernel_size=3, stride=2, padding=1)
        self.blocks = nn.ModuleList(EncoderBlock(spec.width, spec.num_heads, spec.feed_forward_size)
                                    for _ in range(spec.num_layers))
        self.final_norm = nn.LayerNorm(spec.width)
        self.head = nn.Linear(spec.width, vocab_size)

    @staticmethod
    def output_lengths(feature_lengths: torch.Tensor) -> torch.Tensor:
        return (feature_lengths - 1) // 2 + 1  # the stride-2 convolution with padding 1

    def forward(self, features: torch.Tensor, feature_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)  # (B, positions, width)
        x = x + _sinusoids(x.shape[1], x.shape[2], x.device).to(x.dtype)
        lengths = self.output_lengths(feature_lengths)
        keep = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
        for block in self.blocks:
            x = block(x, keep)
        logits = self.head(self.final_norm(x))
        return F.log_softmax(logits.float(), dim=-1), lengths


def _sinusoids(length: int, width: int, device: torch.device) -> torch.Tensor:
    """Fixed sine/cosine positions with timescales from 1 to 10,000 (computed, not stored: no parameters)."""
    inverse_timescales = torch.exp(-math.log(10_000) / (width // 2 - 1) * torch.arange(width // 2, device=device))
    angles = torch.arange(length, device=device)[:, None] * inverse_timescales[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


# ------------------------------------------------------------------------------------------------- task

class SpeechTask(Task):
    name = "asr"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.spec = PRESETS[config.preset]

    def _create_model(self) -> torch.nn.Module:
        return SpeechEncoderCTC(self.spec)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        batch = to_model_device(model, batch)
        log_probs, lengths = model(batch["features"], batch["feature_lengths"])
        # zero_infinity: a transcript too long for its clip contributes nothing instead of inf
        return F.ctc_loss(log_probs.transpose(0, 1), batch["targets"], lengths, batch["target_lengths"],
                          blank=BLANK_ID, reduction="mean", zero_infinity=True)

    def batch_stream(self, batch_size: int, data_seed: int, part: tuple[int, int] = (0, 1)) -> data.BatchStream:
        source, path = self.config.data.source, self.config.data.path
        check_part(part, source)
        self._mel  # built here (torchaudio imported once), so that forked workers inherit it
        if source == "synthetic":
            clips, description = functools.partial(self._synthetic_clips, data_seed), f"synthetic {self.preset} audio"
        elif source == "folder":
            files = _audio_files(path)
            clips, description = functools.partial(self._folder_clips, files, data_seed), f"audio folder {path!r}"
        else:
            shards = data.open_shards(path, data_seed, part)
            clips, description = functools.partial(self._webdataset_clips, shards), f"webdataset shards {path!r}"
        return data.BatchStream(functools.partial(self._batches, clips, batch_size), description)

    def _batches(self, clips: Callable[[int, int], Iterator[tuple[torch.Tensor, str]]], batch_size: int, worker: int,
                 workers: int) -> Iterator[Batch]:
        return data.batches(self._fitting(clips(worker, workers)), batch_size, self._collate)

    # ------------------------------------------------------------------------------------------ sources

    def _synthetic_clips(self, data_seed: int, worker: int, _workers: int) -> Iterator[tuple[torch.Tensor, str]]:
        letters = CHARACTERS[2:]
        letter_samples = round(SYNTHETIC_LETTER_S * SAMPLE_RATE_HZ)
        # pitches evenly spaced on the Mel scale (the HTK formula torchaudio uses), so each letter has its own bins
        lowest_mel, highest_mel = (2595 * math.log10(1 + pitch_hz / 700)
                                   for pitch_hz in (SYNTHETIC_LOWEST_PITCH_HZ, SYNTHETIC_HIGHEST_PITCH_HZ))
        pitches_hz = 700 * (10 ** (torch.linspace(lowest_mel, highest_mel, len(letters)) / 2595) - 1)
        time_s = torch.arange(letter_samples) / SAMPLE_RATE_HZ
        # a Hann envelope returns to silence between letters, so a repeated letter is heard twice
        tones = torch.sin(2 * math.pi * pitches_hz[:, None] * time_s[None, :]) * torch.hann_window(letter_samples)
        max_letters = int(self.spec.window_s / SYNTHETIC_LETTER_S) - 1
        draws = torch.Generator().manual_seed(data.worker_seed(data_seed, "synthetic", worker))
        while True:
            count = int(torch.randint(max(1, max_letters // 3), max_letters + 1, (1,), generator=draws))
            indices = torch.randint(len(letters), (count,), generator=draws)
            loudness = 0.3 + 0.7 * torch.rand(1, generator=draws)
            audio = loudness * tones[indices].reshape(-1)
            audio = audio + SYNTHETIC_NOISE_STD * torch.randn(audio.shape, generator=draws)
            yield audio, "".join(letters[i] for i in indices.tolist())

    def _folder_clips(self, files: list[Path], data_seed: int, worker: int,
                      workers: int) -> Iterator[tuple[torch.Tensor, str]]:
        description = f"audio folder {self.config.data.path!r}"
        for _, file in data.worker_passes(files, data_seed, worker, workers, description):
            try:
                encoded = file.read_bytes()
                transcript = file.with_suffix(".txt").read_text(encoding="utf-8", errors="replace")
            except OSError as error:
                raise data.DataSourceError(f"audio file {str(file)!r} cannot be read ({error.strerror})") from None
            yield _decode_audio(encoded, str(file)), transcript

    def _webdataset_clips(self, shards: data.ShardStream, _worker: int,
                          _workers: int) -> Iterator[tuple[torch.Tensor, str]]:
        for sample in shards:
            extension, encoded = data.require_field(sample, ("flac", "wav"), "a .wav or .flac member")
            _, transcript = data.require_field(sample, ("txt",), "a .txt member with the transcript")
            where = f"webdataset shard {sample['__url__']!r}, sample {sample['__key__']}.{extension}"
            yield _decode_audio(encoded, where), transcript.decode("utf-8", errors="replace")

    # ------------------------------------------------------------------------------------ clips to batch

    def _fitting(self, clips: Iterator[tuple[torch.Tensor, str]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(audio, character ids) of the clips that fit the preset's window."""
        window_samples = round(self.spec.window_s * SAMPLE_RATE_HZ)
        skipped = 0
        for audio, transcript in clips:
            if audio.numel() > window_samples:
                skipped += 1
                if skipped in (1, 10, 100, 1000) or skipped % 10_000 == 0:  # a log line per order of magnitude
                    logger.warning("skipped %d clips longer than the %.1f s window of preset %s",
                                   skipped, self.spec.window_s, self.preset)
                continue
            yield audio, encode_transcript(transcript)

    @functools.cached_property
    def _mel(self) -> nn.Module:
        import torchaudio

        return torchaudio.transforms.MelSpectrogram(sample_rate=SAMPLE_RATE_HZ, n_fft=WINDOW_SAMPLES,
                                                    hop_length=HOP_SAMPLES, n_mels=self.spec.num_mel_bins, power=2.0)

    def _collate(self, clips: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
        window_samples = round(self.spec.window_s * SAMPLE_RATE_HZ)
        audio = torch.zeros(len(clips), window_samples)
        for row, (clip, _) in enumerate(clips):
            audio[row, :clip.numel()] = clip
        # a centred STFT gives one frame more than window / hop; drop it, so 30 s are Whisper's 3000 frames
        window_frames = window_samples // HOP_SAMPLES
        feature_lengths = torch.tensor([min(clip.numel() // HOP_SAMPLES + 1, window_frames) for clip, _ in clips])
        features = standardise(log_mel(self._mel(audio))[..., :window_frames], feature_lengths)
        targets = nn.utils.rnn.pad_sequence([ids for _, ids in clips], batch_first=True, padding_value=BLANK_ID)
        return {"features": features, "feature_lengths": feature_lengths, "targets": targets,
                "target_lengths": torch.tensor([ids.numel() for _, ids in clips])}


def _audio_files(path: str) -> list[Path]:
    """The audio files at ``path``, each checked for its transcript up front (not hours into a run)."""
    expected = "a directory of .wav/.flac files, each with its transcript in a same-named .txt beside it"
    files = data.list_files(path, AUDIO_SUFFIXES, expected)
    for file in files:
        transcript = file.with_suffix(".txt")
        if not transcript.is_file():
            raise data.DataSourceError(f"audio file {str(file)!r} has no transcript {str(transcript)!r}; "
                                       f"expected {expected}")
    return files


def log_mel(mel_power: torch.Tensor) -> torch.Tensor:
    """Whisper's log of Mel power: log10, floored 8 decades below each clip's peak (so silence is bounded)."""
    log_power = mel_power.clamp(min=1e-10).log10()
    return torch.maximum(log_power, log_power.amax(dim=(-2, -1), keepdim=True) - 8.0)


def standardise(features: torch.Tensor, feature_lengths: torch.Tensor) -> torch.Tensor:
    """Each clip's features to zero mean and unit variance over its frames; padding frames become 0.

    Whisper feeds its fixed-scaled log-Mel straight in; at that scale a tone or a vowel moves only a few
    bins by about one unit, and small models sit on CTC's all-blank plateau for hundreds of steps.
    Standardising per clip (as ASR front ends commonly do) makes the same models learn within tens.
    """
    valid = (torch.arange(features.shape[-1])[None, :] < feature_lengths[:, None]).unsqueeze(1)  # (B, 1, frames)
    count = valid.sum(dim=(1, 2), keepdim=True) * features.shape[1]
    mean = (features * valid).sum(dim=(1, 2), keepdim=True) / count
    variance = ((features - mean).square() * valid).sum(dim=(1, 2), keepdim=True) / count
    return ((features - mean) / (variance + 1e-5).sqrt()).masked_fill(~valid, 0.0)


def encode_transcript(text: str) -> torch.Tensor:
    """Character ids of a transcript, normalised as the module docstring describes."""
    normalised = " ".join("".join(c if c in CHARACTERS else " " if c.isspace() else "" for c in text.lower()).split())
    return torch.tensor([CHARACTERS.index(c) + 1 for c in normalised], dtype=torch.int64)


def _decode_audio(encoded: bytes, where: str) -> torch.Tensor:
    """Mono float audio at 16 kHz from the bytes of a .wav or .flac file."""
    import soundfile

    try:
        samples, sample_rate_hz = soundfile.read(io.BytesIO(encoded), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise data.DataSourceError(f"{where}: cannot decode audio ({error}); expected a .wav or .flac file") from None
    audio = torch.from_numpy(samples).mean(dim=1)
    if sample_rate_hz != SAMPLE_RATE_HZ:
        import torchaudio.functional

        audio = torchaudio.functional.resample(audio, sample_rate_hz, SAMPLE_RATE_HZ)
    return audio

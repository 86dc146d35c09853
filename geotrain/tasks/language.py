"""Masked language modelling (task ``nlp``) with RoBERTa models, as in the [EMJ24] Wikipedia runs.

Presets: ``roberta-base``, ``roberta-large`` and ``xlm-roberta-large`` (the "RoBERTa-XLM" of [EMJ24]) with
the published architectures and vocabulary sizes, built with random init from transformers configs, on
512-token sequences; and ``tiny`` (2 layers, hidden size 64, byte vocabulary, 64-token sequences).

Tokenizer: built in and offline by default, UTF-8 bytes shifted past RoBERTa's special ids
(``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3, ``<mask>``=4, byte b = 5 + b). ``task.data.tokenizer_path``
may name a ``tokenizer.json`` (the `tokenizers` library's format) with ``<s> <pad> </s> <mask>`` (or
``[CLS] [PAD] [SEP] [MASK]``) tokens; the model's vocabulary is then the larger of the preset's and the
tokenizer's, so every peer must use the same file.

Batches are ``{"input_ids", "attention_mask", "labels"}``, each int64 (B, sequence_length). Masking is
BERT's: 15% of the non-special tokens are chosen, of those 80% become ``<mask>``, 10% a random token and
10% stay; ``labels`` holds the original token there and -100 elsewhere, so the loss (mean cross-entropy)
counts only chosen positions.

Synthetic data: token sequences from a fixed random Markov chain over 128 tokens of the vocabulary, both
drawn from a constant seed (one distribution for every peer). The tokens form 16 topics of 8 and each token's
four successors (fixed probabilities) lie in its own topic, so a masked token is predictable: its topic
from the context, which of the topic's tokens from its left neighbour. Text files and shards are tokenized as a stream,
documents separated by ``</s>``, and cut into full-length sequences (a document's end flows into the next
document, RoBERTa's "full sentences" packing, so no position is padding); a file without text adds nothing.
Reading, tokenizing, packing and masking happen where the batches are made: in each DataLoader worker, on
its own share of the files or shards, with its own shuffling and masking streams.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from geotrain.tasks import data
from geotrain.tasks.base import Batch, Task, check_part, to_model_device

MASK_FRACTION = 0.15
SYNTHETIC_DISTRIBUTION_SEED = 2_000_003
# The synthetic chain's 128 tokens fall into 16 topics of 8; a sequence never leaves its topic.
SYNTHETIC_TOPICS = 16
SYNTHETIC_TOPIC_STATES = 8
SYNTHETIC_SUCCESSOR_PROBABILITIES = (0.6, 0.25, 0.1, 0.05)
TEXT_READ_CHARS = 1 << 20  # tokenize files in ~1 MB pieces: bounded memory for corpora of any size
IGNORE_INDEX = -100  # label of positions the loss skips (transformers' convention)


@dataclass(frozen=True)
class LanguagePreset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    sequence_length_tokens: int
    multilingual: bool = False  # XLM-R: same architecture, its own model class and 250k vocabulary


PRESETS: dict[str, LanguagePreset] = {
    "tiny": LanguagePreset(vocab_size=261, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256,
                           sequence_length_tokens=64),
    # Parameter counts from [EMJ24] section 3 (see presets.EMJ24_PARAMETER_COUNTS): 124.7M, 355.4M, 560.1M.
    "roberta-base": LanguagePreset(50265, 768, 12, 12, 3072, 512),
    "roberta-large": LanguagePreset(50265, 1024, 24, 16, 4096, 512),
    "xlm-roberta-large": LanguagePreset(250002, 1024, 24, 16, 4096, 512, multilingual=True),
}


class ByteTokenizer:
    """UTF-8 bytes as tokens, after RoBERTa's special ids: needs no file and no download."""

    bos_id, pad_id, eos_id, unk_id, mask_id = 0, 1, 2, 3, 4
    _first_byte_id = 5
    vocab_size = _first_byte_id + 256

    content_ids = list(range(_first_byte_id, vocab_size))  # ids that stand for text, not structure

    def encode(self, text: str) -> list[int]:
        return [self._first_byte_id + byte for byte in text.encode("utf-8")]


class FileTokenizer:
    """A `tokenizers` library tokenizer.json; it must define BOS, PAD, EOS and MASK tokens."""

    _NAMES = {"bos_id": ("<s>", "[CLS]"), "pad_id": ("<pad>", "[PAD]"),
              "eos_id": ("</s>", "[SEP]"), "mask_id": ("<mask>", "[MASK]")}

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(Path(path).expanduser()))
        except Exception as error:  # tokenizers raises a bare Exception for missing and malformed files
            raise data.DataSourceError(f"task.data.tokenizer_path {path!r}: cannot load it ({error}); expected a "
                                       "tokenizer.json written by the tokenizers library") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        for attribute, names in self._NAMES.items():
            ids = (self._tokenizer.token_to_id(name) for name in names)
            token_id = next((token_id for token_id in ids if token_id is not None), None)
            if token_id is None:
                raise data.DataSourceError(f"task.data.tokenizer_path {path!r}: has none of the tokens {names}; "
                                           "masked language modelling needs <s>, <pad>, </s> and <mask> tokens")
            setattr(self, attribute, token_id)
        special_ids = {self.bos_id, self.pad_id, self.eos_id, self.mask_id}
        self.content_ids = [i for i in range(self.vocab_size) if i not in special_ids]

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


class LanguageTask(Task):
    name = "nlp"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.spec = PRESETS[config.preset]

    @functools.cached_property
    def tokenizer(self) -> ByteTokenizer | FileTokenizer:
        path = self.config.data.tokenizer_path
        return FileTokenizer(path) if path else ByteTokenizer()

    @functools.cached_property
    def _content_id_tensor(self) -> torch.Tensor:
        return torch.tensor(self.tokenizer.content_ids)

    @property
    def vocab_size(self) -> int:
        return max(self.spec.vocab_size, self.tokenizer.vocab_size)

    def _create_model(self) -> torch.nn.Module:
        from transformers import RobertaConfig, RobertaForMaskedLM, XLMRobertaConfig, XLMRobertaForMaskedLM

        config_class, model_class = ((XLMRobertaConfig, XLMRobertaForMaskedLM) if self.spec.multilingual
                                     else (RobertaConfig, RobertaForMaskedLM))
        tokenizer = self.tokenizer
        config = config_class(
            vocab_size=self.vocab_size, hidden_size=self.spec.hidden_size,
            num_hidden_layers=self.spec.num_layers, num_attention_heads=self.spec.num_heads,
            intermediate_size=self.spec.intermediate_size,
            # RoBERTa numbers positions from pad_id + 1, hence two more than the sequence length
            max_position_embeddings=self.spec.sequence_length_tokens + 2, type_vocab_size=1,
            layer_norm_eps=1e-5, pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id)
        return model_class(config)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        batch = to_model_device(model, batch)
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).loss

    def batch_stream(self, batch_size: int, data_seed: int, part: tuple[int, int] = (0, 1)) -> data.BatchStream:
        self.tokenizer  # load it now: a bad tokenizer_path should fail here, not at the first batch
        source, path = self.config.data.source, self.config.data.path
        check_part(part, source)
        if source == "synthetic":
            return data.BatchStream(functools.partial(self._synthetic_batches, batch_size, data_seed),
                                    f"synthetic {self.preset} text")
        if source == "folder":
            files = data.list_files(path, (".txt",), "a text file, a directory of *.txt files or a glob like "
                                                     "/corpus/*.txt")
            return data.BatchStream(functools.partial(self._folder_batches, files, batch_size, data_seed),
                                    f"text files {path!r}")
        shards = data.open_shards(path, data_seed, part)
        return data.BatchStream(functools.partial(self._webdataset_batches, shards, batch_size, data_seed),
                                f"webdataset shards {path!r}")

    def _synthetic_batches(self, batch_size: int, data_seed: int, worker: int, _workers: int) -> Iterator[Batch]:
        return self._masked(self._synthetic_sequences(batch_size, data_seed, worker), data_seed, worker)

    def _folder_batches(self, files: list[Path], batch_size: int, data_seed: int, worker: int,
                        workers: int) -> Iterator[Batch]:
        documents = self._folder_documents(files, data_seed, worker, workers)
        sequences = data.batches(self._pack(documents, data_seed, worker), batch_size, torch.stack)
        return self._masked(sequences, data_seed, worker)

    def _webdataset_batches(self, shards: data.ShardStream, batch_size: int, data_seed: int, worker: int,
                            _workers: int) -> Iterator[Batch]:
        documents = self._webdataset_documents(iter(shards))
        sequences = data.batches(self._pack(documents, data_seed, worker), batch_size, torch.stack)
        return self._masked(sequences, data_seed, worker)

    def _masked(self, sequences: Iterator[torch.Tensor], data_seed: int, worker: int) -> Iterator[Batch]:
        masking = torch.Generator().manual_seed(data.worker_seed(data_seed, "masking", worker))
        return (self._mask(token_ids, masking) for token_ids in sequences)

    # ------------------------------------------------------------------------------------------ sources

    def _synthetic_sequences(self, batch_size: int, data_seed: int, worker: int) -> Iterator[torch.Tensor]:
        tokenizer, length = self.tokenizer, self.spec.sequence_length_tokens
        distribution = random.Random(SYNTHETIC_DISTRIBUTION_SEED)
        # a small tokenizer.json may have fewer ordinary tokens than the chain wants: shrink the chain to fit
        topic_size = min(SYNTHETIC_TOPIC_STATES, len(tokenizer.content_ids))
        topics = min(SYNTHETIC_TOPICS, len(tokenizer.content_ids) // topic_size)
        states = torch.tensor(distribution.sample(tokenizer.content_ids, topics * topic_size))
        probabilities = torch.tensor(SYNTHETIC_SUCCESSOR_PROBABILITIES[:topic_size])
        # a state's successors lie in its own topic: the context says the topic, the left neighbour the rest
        successors = torch.tensor([[topic * topic_size + offset
                                    for offset in distribution.sample(range(topic_size), len(probabilities))]
                                   for topic in range(topics) for _ in range(topic_size)])
        draws = torch.Generator().manual_seed(data.worker_seed(data_seed, "synthetic", worker))
        while True:
            state = torch.randint(len(states), (batch_size,), generator=draws)
            choices = torch.multinomial(probabilities, batch_size * (length - 2), replacement=True, generator=draws)
            choices = choices.view(batch_size, length - 2)
            path = []
            for step in range(length - 2):
                path.append(state)
                state = successors[state, choices[:, step]]
            yield self._wrap(states[torch.stack(path, dim=1)])

    def _folder_documents(self, files: list[Path], data_seed: int, worker: int, workers: int) -> Iterator[str]:
        """This worker's text pieces, pass after pass ("" ends a document with text)."""
        path = self.config.data.path
        pass_characters, current_pass, corpus_has_text = 0, 0, None
        for epoch, file in data.worker_passes(files, data_seed, worker, workers, f"text files {path!r}"):
            if epoch != current_pass:
                # a pass without text is fine while other workers' files have some; if none has, the packer
                # would spin forever (or fill sequences with nothing but </s>): check the whole corpus, once
                if pass_characters == 0 and corpus_has_text is None:
                    corpus_has_text = any(piece.strip() for other in files for piece in _read_text_pieces(other))
                    if not corpus_has_text:
                        raise data.DataSourceError(f"text files {path!r}: all {len(files)} file(s) are empty; "
                                                   "expected text")
                pass_characters, current_pass = 0, epoch
            characters = 0
            for piece in _read_text_pieces(file):
                characters += len(piece.strip())
                yield piece
            if characters:
                yield ""  # end of document: the packer puts </s> here
            pass_characters += characters

    def _webdataset_documents(self, shard_samples: Iterator[dict]) -> Iterator[str]:
        for sample in shard_samples:
            _, text = data.require_field(sample, ("txt",), "a .txt member with the sample's text")
            yield text.decode("utf-8", errors="replace")
            yield ""

    # ------------------------------------------------------------------------------------ tokens to batch

    def _pack(self, pieces: Iterable[str], data_seed: int, worker: int) -> Iterator[torch.Tensor]:
        """Cut a stream of text pieces ("" = end of document) into full sequences, shuffled by a buffer."""
        content_length = self.spec.sequence_length_tokens - 2
        tokenizer = self.tokenizer

        def chunks() -> Iterator[torch.Tensor]:
            buffer: list[int] = []
            for piece in pieces:
                buffer.extend(tokenizer.encode(piece) if piece else [tokenizer.eos_id])
                while len(buffer) >= content_length:
                    yield self._wrap(torch.tensor(buffer[:content_length]).unsqueeze(0))[0]
                    del buffer[:content_length]

        shuffling = random.Random(data.worker_seed(data_seed, "packing", worker))
        return data.shuffle_buffer(chunks(), data.DEFAULT_SHUFFLE_BUFFER_SAMPLES, shuffling)

    def _wrap(self, content: torch.Tensor) -> torch.Tensor:
        """``<s> content </s>`` for a (B, L-2) tensor of token ids."""
        tokenizer = self.tokenizer
        bos = torch.full((content.shape[0], 1), tokenizer.bos_id, dtype=torch.int64)
        eos = torch.full((content.shape[0], 1), tokenizer.eos_id, dtype=torch.int64)
        return torch.cat([bos, content.to(torch.int64), eos], dim=1)

    def _mask(self, token_ids: torch.Tensor, generator: torch.Generator) -> Batch:
        """BERT masking of a (B, L) batch of token ids: 15% chosen, 80% <mask>, 10% random, 10% kept."""
        tokenizer = self.tokenizer
        special = ((token_ids == tokenizer.bos_id) | (token_ids == tokenizer.eos_id) | (token_ids == tokenizer.pad_id))
        chosen = (torch.rand(token_ids.shape, generator=generator) < MASK_FRACTION) & ~special
        # a sequence without a chosen token would add nothing to the loss; choose one of its tokens instead
        empty_rows = ~chosen.any(dim=1)
        if empty_rows.any():
            scores = torch.rand(token_ids.shape, generator=generator).masked_fill(special, -1.0)
            forced = torch.zeros_like(chosen).scatter_(1, scores.argmax(dim=1, keepdim=True), True)
            chosen |= forced & empty_rows.unsqueeze(1) & ~special
        labels = token_ids.masked_fill(~chosen, IGNORE_INDEX)
        roll = torch.rand(token_ids.shape, generator=generator)
        content_ids = self._content_id_tensor
        random_tokens = content_ids[torch.randint(len(content_ids), token_ids.shape, generator=generator)]
        input_ids = torch.where(chosen & (roll < 0.8), tokenizer.mask_id, token_ids)
        input_ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_tokens, input_ids)
        return {"input_ids": input_ids, "attention_mask": (token_ids != tokenizer.pad_id).to(torch.int64),
                "labels": labels}


def _read_text_pieces(file: Path) -> Iterator[str]:
    """A text file in pieces of about :data:`TEXT_READ_CHARS`, split at line ends (tokenizers split words)."""
    try:
        with open(file, encoding="utf-8", errors="replace") as stream:
            while True:
                piece = stream.read(TEXT_READ_CHARS)
                if not piece:
                    return
                yield piece + stream.readline()
    except OSError as error:
        raise data.DataSourceError(f"text file {str(file)!r} cannot be read ({error.strerror})") from None

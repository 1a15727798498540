"""The corpus, the tokenizer and the training blocks, all made locally (nothing is downloaded).

The corpus is generated from a small grammar with its own seeded generator, so it is the same for
every run, whatever ``--seed`` says: the training seed changes the model's initialisation, the
data order and dropout, never the data.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("[UNK]", "[PAD]", "[BOS]", "[EOS]")

_ADJECTIVES = (
    "red", "blue", "green", "yellow", "small", "large", "quiet", "loud", "old", "young", "fast",
    "slow", "happy", "sleepy", "clever", "brave", "tiny", "giant", "bright", "dark",
)
_NOUNS = (
    "cat", "dog", "fox", "bird", "horse", "mouse", "rabbit", "owl", "bear", "wolf", "frog", "duck",
    "goat", "lion", "tiger", "whale", "child", "farmer", "sailor", "teacher", "baker", "doctor",
    "robot", "wizard",
)
_VERBS = (
    "sees", "chases", "follows", "finds", "helps", "meets", "watches", "greets", "likes", "avoids",
    "feeds", "calls", "teaches", "carries", "paints",
)
_PLACES = (
    "garden", "forest", "river", "village", "market", "castle", "harbor", "mountain", "kitchen",
    "library",
)
_ADVERBS = ("quickly", "slowly", "quietly", "happily", "carefully", "often", "rarely", "again")
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _noun_phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(("the", "a", "every", "one"))]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    return words


def make_sentences(count: int, seed: int = 1234) -> list[str]:
    """``count`` sentences of a small English-like grammar, the same for the same seed.

    Three kinds: "<subject> <verb> <object> [in the <place>] [<adverb>] ." (learnable agreement of
    articles, adjectives and nouns), counting runs ("count three four five six .") and
    "where is the <noun> ? in the <place> ." pairs, so the loss has structure to find.
    """
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.7:
            words = [*_noun_phrase(rng), rng.choice(_VERBS), *_noun_phrase(rng)]
            if rng.random() < 0.5:
                words += ["in", "the", rng.choice(_PLACES)]
            if rng.random() < 0.3:
                words.append(rng.choice(_ADVERBS))
            words.append(".")
        elif kind < 0.85:
            start = rng.randrange(len(_NUMBERS) - 3)
            length = rng.randint(3, len(_NUMBERS) - start)
            words = ["count", *_NUMBERS[start : start + length], "."]
        else:
            words = ["where", "is", "the", rng.choice(_NOUNS), "?"]
            words += ["in", "the", rng.choice(_PLACES), "."]
        sentences.append(" ".join(words))
    return sentences


def build_tokenizer(sentences: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary is every word of ``sentences``, sorted, after the
    special tokens: the same corpus always gives the same ids."""
    words = sorted({word for sentence in sentences for word in sentence.split()})
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )


class TokenBlocks(Dataset):
    """The corpus as one token stream (each sentence followed by EOS) cut into ``block_size``
    blocks; the remainder is dropped. Items are ``{"input_ids", "labels"}`` (the model shifts the
    labels itself)."""

    def __init__(
        self, sentences: list[str], tokenizer: PreTrainedTokenizerFast, block_size: int
    ) -> None:
        stream: list[int] = []
        for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
        usable = len(stream) // block_size * block_size
        if usable == 0:
            raise ValueError(
                f"the corpus has {len(stream)} tokens, fewer than one block of {block_size}; "
                "use more sentences or a smaller --block_size"
            )
        self.blocks = torch.tensor(stream[:usable], dtype=torch.long).view(-1, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone()}

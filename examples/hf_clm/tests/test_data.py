"""The locally made corpus, tokenizer and training blocks of the hf_clm example.

The Trainer's resume and determinism depend on the data being the same in every run: the same
sentences, the same token ids, the same blocks. These tests pin that down without the model.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None:
    pytest.skip("the hf_clm example needs transformers and tokenizers: pip install -e '.[hf]'",
                allow_module_level=True)

from tinyclm.data import SPECIAL_TOKENS, TokenBlocks, build_tokenizer, make_sentences


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return make_sentences(300)


def test_the_corpus_depends_only_on_its_own_seed(sentences: list[str]) -> None:
    assert make_sentences(300) == sentences
    assert make_sentences(300, seed=7) != sentences
    assert all(sentence.endswith((".", "?")) for sentence in sentences)


def test_the_tokenizer_is_word_level_over_the_corpus_and_round_trips(sentences: list[str]) -> None:
    tokenizer = build_tokenizer(sentences)
    words = {word for sentence in sentences for word in sentence.split()}
    assert len(tokenizer) == len(words) + len(SPECIAL_TOKENS)
    ids = tokenizer(sentences[0], add_special_tokens=False)["input_ids"]
    assert len(ids) == len(sentences[0].split())
    assert tokenizer.decode(ids) == sentences[0]
    assert tokenizer.unk_token_id not in ids
    # built twice from the same corpus: the same ids (no download, no training randomness)
    assert build_tokenizer(list(reversed(sentences))).get_vocab() == tokenizer.get_vocab()


def test_blocks_are_the_token_stream_cut_to_length(sentences: list[str]) -> None:
    tokenizer = build_tokenizer(sentences)
    blocks = TokenBlocks(sentences, tokenizer, block_size=16)
    item = blocks[0]
    assert item["input_ids"].shape == (16,) and item["input_ids"].equal(item["labels"])
    stream = blocks.blocks.flatten().tolist()
    assert stream.count(tokenizer.eos_token_id) >= len(blocks) * 16 // 40  # one per sentence
    first = tokenizer(sentences[0], add_special_tokens=False)["input_ids"]
    assert stream[: len(first) + 1] == [*first, tokenizer.eos_token_id]


def test_a_corpus_shorter_than_a_block_is_refused() -> None:
    short = ["count one two three ."]
    with pytest.raises(ValueError, match="fewer than one block"):
        TokenBlocks(short, build_tokenizer(short), block_size=64)

"""IncrementalDetokenizer: streamed deltas add up to the full text and never split a character."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mstar.engine.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

CORPUS = [
    "The rocket 🚀 flew over the café near the fjord.",
    "naïve façade — déjà vu, 東京タワー, 🙂🙃 emoji and ascii text alike",
    "plain words and more plain words",
]


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE small enough that multi-byte characters span several tokens."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(backend, eos_token_ids=[backend.token_to_id("<|end|>")])


def test_multibyte_characters_span_several_tokens(byte_tokenizer):
    ids = byte_tokenizer.encode("🚀")
    assert len(ids) > 1
    assert "\ufffd" in byte_tokenizer.decode(ids[:1])


@pytest.mark.parametrize("text", [*CORPUS, "🚀🚀 東京 ok"])
def test_deltas_concatenate_to_full_text(byte_tokenizer, text):
    prompt = byte_tokenizer.encode("plain words ")
    ids = byte_tokenizer.encode(text)
    rng = random.Random(len(text))
    detok = IncrementalDetokenizer(byte_tokenizer, prompt)
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])  # the engine may hand over several ids at once
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert "".join(deltas) == byte_tokenizer.decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_in_stream(byte_tokenizer):
    end = byte_tokenizer.eos_token_ids[0]
    ids = [*byte_tokenizer.encode("café"), end]
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == "café"


def test_long_stream_keeps_window_bounded(byte_tokenizer):
    ids = byte_tokenizer.encode("plain words and more plain words " * 40)
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == byte_tokenizer.decode(ids)
    assert len(detok._ids) < 80


def test_template_errors_and_missing_template(byte_tokenizer):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        byte_tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(
        byte_tokenizer.backend,
        chat_template="{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ messages | tojson }}",
    )
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert strict.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '[{"role": "user", "content": "é"}]'
    )

"""Choice text assembly with the real tokenizer: stop strings, hold-back, logprobs shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from mstar.engine.outputs import TokenLogprob
from mstar.engine.server.choice import (
    LOGPROB_FLOOR,
    ChoiceState,
    chat_logprobs,
    completion_logprobs,
)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


def choice(tok: Tokenizer, stop: list[str] | None = None, include: bool = False) -> ChoiceState:
    prompt = ids(tok, "w3 w4")
    return ChoiceState(
        0, IncrementalDetokenizer(tok, prompt), stop=stop, include_stop_str_in_output=include
    )


def drain(c: ChoiceState) -> str:
    out = ""
    while (d := c.take()) is not None:
        out += d.text
    return out


def test_plain_text_streams_token_by_token(tok: Tokenizer) -> None:
    c = choice(tok)
    full = tok.decode(ids(tok, "w5 w6 w7"))
    shown = ""
    for t in ids(tok, "w5 w6 w7"):
        assert not c.add([t], None)
        d = c.take()
        assert d is not None and d.finish_reason is None
        shown += d.text
    c.finish("length")
    last = c.take()
    assert last is not None and last.finish_reason == "length"
    shown += last.text
    assert shown.strip() == full.strip()
    assert c.num_tokens == 3
    assert c.take() is None  # the finish is reported once


def test_stop_string_across_tokens_is_cut_and_never_shown(tok: Tokenizer) -> None:
    c = choice(tok, stop=["w7 w8"])
    shown = ""
    stopped = False
    for t in ids(tok, "w5 w6 w7 w8 w9"):
        stopped = c.add([t], None)
        if (d := c.take()) is not None:
            shown += d.text
            # While "w7" could start the stop string it stays held back.
            assert "w7" not in shown
        if stopped:
            break
    assert stopped and c.finish_reason == "stop"
    assert shown.strip() == "w5 w6"
    assert c.num_tokens == 4  # usage counts the tokens that made the stop string


def test_stop_string_kept_when_asked(tok: Tokenizer) -> None:
    c = choice(tok, stop=["w6"], include=True)
    assert c.add(ids(tok, "w5 w6 w7"), None)
    assert drain(c).strip() == "w5 w6"


def test_earliest_of_several_stops_wins(tok: Tokenizer) -> None:
    c = choice(tok, stop=["w9", "w6"])
    assert c.add(ids(tok, "w5 w6 w7 w8 w9"), None)
    assert drain(c).strip() == "w5"
    assert c.num_tokens == 2


def test_held_back_text_released_when_stop_fails_to_complete(tok: Tokenizer) -> None:
    c = choice(tok, stop=["w5 w9"])
    c.add(ids(tok, "w5"), None)
    assert c.take() is None  # "w5" might begin the stop string
    c.add(ids(tok, "w6"), None)
    d = c.take()
    assert d is not None and d.text.strip() == "w5 w6"  # no tail can start the stop any more
    c.add(ids(tok, "w5"), None)
    assert c.take() is None
    c.finish("length")
    assert drain(c).strip() == "w5"  # the end of generation releases the held tail


def test_logprob_shapes(tok: Tokenizer) -> None:
    t5, t6 = ids(tok, "w5 w6")
    c = choice(tok)
    lps = [
        TokenLogprob(t5, -0.5, ((t5, -0.5), (t6, -1.5))),
        TokenLogprob(t6, float("-inf"), ((t5, -0.1),)),
    ]
    c.add([t5, t6], lps)
    c.finish("length")
    d = c.take()
    assert d is not None and len(d.pieces) == 2
    legacy = completion_logprobs(tok, d.pieces, 0)
    assert legacy["tokens"] == ["w5", "w6"]
    assert legacy["token_logprobs"] == [-0.5, LOGPROB_FLOOR]
    assert legacy["top_logprobs"][0] == {"w5": -0.5, "w6": -1.5}
    assert legacy["text_offset"][0] == 0 and legacy["text_offset"][1] > 0
    modern = chat_logprobs(tok, d.pieces, 1)["content"]
    assert [e["token"] for e in modern] == ["w5", "w6"]
    assert modern[0]["bytes"] == list(b"w5")
    assert modern[0]["top_logprobs"] == [{"token": "w5", "logprob": -0.5, "bytes": list(b"w5")}]
    assert modern[1]["logprob"] == LOGPROB_FLOOR

"""Tokenizer wrapper: ``tokenizers`` for text <-> ids, sandboxed jinja2 for chat templates.

The engine must not depend on transformers at run time, yet chat prompts must render exactly as
``transformers.apply_chat_template`` renders them (same jinja environment options, filters and
globals), or the model sees a prompt format it was not trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from mstar.engine.model.config import ModelLoadError


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (``raise_exception`` in the template)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON, as in transformers.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """Text <-> token ids plus the model's chat template and special token ids."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self._tok = backend
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(
        cls, path: str | Path, *, extra_eos_ids: Iterable[int] = (), bos_id: int | None = None
    ) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat template and generation eos ids."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"missing tokenizer.json in {folder}")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"cannot read {tok_file}: {exc}") from exc
        tcfg: dict[str, Any] = {}
        tcfg_file = folder / "tokenizer_config.json"
        if tcfg_file.is_file():
            try:
                tcfg = json.loads(tcfg_file.read_text())
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"cannot parse {tcfg_file}: {exc}") from exc
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(tcfg.get(key))
            if text is not None:
                special[key] = text
        eos: list[int] = []
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            try:
                eos += _as_id_list(json.loads(gen_file.read_text()).get("eos_token_id"))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ModelLoadError(f"cannot parse {gen_file}: {exc}") from exc
        eos += list(extra_eos_ids)
        if "eos_token" in special:
            eos_id = backend.token_to_id(special["eos_token"])
            if eos_id is not None:
                eos.append(eos_id)
        bos = bos_id
        if "bos_token" in special:
            found = backend.token_to_id(special["bos_token"])
            bos = found if found is not None else bos
        return cls(
            backend,
            chat_template=template if isinstance(template, str) else None,
            special_tokens=special,
            eos_token_ids=eos,
            bos_token_id=bos,
        )

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        return int(found) if found is not None else None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the conversation with the model's template, as transformers does."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        template = _compile_template(self.chat_template)
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(kwargs)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas that never split a character.

    Decoding a token alone can yield half a UTF-8 sequence (byte-level BPE) or lose a leading
    space (SentencePiece), so each delta is the difference between decoding a short window that
    starts a few tokens back with and without the newest tokens; a window ending in U+FFFD
    waits for the bytes that complete it.
    """

    _LOOKBACK = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        tail = list(prompt_ids)[-(self._LOOKBACK + 1) :]
        self._ids: list[int] = tail
        self._prefix = max(len(tail) - self._LOOKBACK, 0)
        self._read = len(tail)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly complete text (possibly empty)."""
        self._ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        # Drop ids the window can no longer reach so long generations stay O(1) per token.
        if self._prefix > 64:
            self._ids = self._ids[self._prefix :]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation, emit whatever is pending, even an incomplete character."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta

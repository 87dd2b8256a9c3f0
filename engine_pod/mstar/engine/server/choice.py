"""One choice's output text: incremental detokenization, stop strings, logprobs, hold-back.

The engine produces token ids; users see text. Stop strings live in text, so the server
watches the decoded text, cuts it at the first stop string and tells the caller to abort the
engine request. While streaming, the tail that could still be the start of a stop string is
held back, so a client never sees text that a later token turns into a stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mstar.engine.outputs import TokenLogprob

#: JSON has no -inf; OpenAI-compatible servers report it as this floor.
LOGPROB_FLOOR = -9999.0


class TokenizerLike(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizerLike(Protocol):
    def add(self, new_ids: list[int]) -> str: ...


@dataclass
class Piece:
    """One generated token and the text it added (may be empty mid UTF-8 sequence)."""

    token_id: int
    text: str
    start: int
    logprob: TokenLogprob | None = None


@dataclass
class Delta:
    """What a choice may show the client now."""

    text: str
    pieces: list[Piece]
    finish_reason: str | None


class ChoiceState:
    """Accumulates one engine request's tokens into user-visible text."""

    def __init__(
        self,
        index: int,
        detokenizer: DetokenizerLike,
        *,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """``min_tokens``: stop strings are not looked for before this many tokens (vLLM's)."""
        self.index = index
        self._min_tokens = min_tokens
        self._detok = detokenizer
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._pending: list[Piece] = []
        self._emitted = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._reported = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> bool:
        """Take new tokens; True when a stop string ended the choice (abort the engine side)."""
        for i, token_id in enumerate(token_ids):
            if self.finished:
                break
            self.num_tokens += 1
            piece = Piece(token_id, self._detok.add([token_id]), len(self.text))
            if logprobs is not None and i < len(logprobs):
                piece.logprob = logprobs[i]
            self._pending.append(piece)
            before = len(self.text)
            self.text += piece.text
            if self._stop and self.num_tokens >= self._min_tokens and self._check_stop(before):
                return True
        return False

    def _check_stop(self, before: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            pos = self.text.find(stop, max(0, before - len(stop) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        cut = best[0] + (len(best[1]) if self._include_stop else 0)
        self.text = self.text[:cut]
        kept: list[Piece] = []
        for piece in self._pending:
            if piece.start >= cut:
                break
            piece.text = piece.text[: max(0, cut - piece.start)]
            kept.append(piece)
        self._pending = kept
        self.finish_reason = "stop"
        return True

    def finish(self, reason: str) -> None:
        """The engine ended the choice: emit what the detokenizer still holds back."""
        if self.finish_reason is not None:
            return
        flush = getattr(self._detok, "flush", None)
        if flush is not None:
            tail = flush()
            before = len(self.text)
            self.text += tail
            if self._stop and self._check_stop(before):
                return
        self.finish_reason = reason

    def _safe_limit(self) -> int:
        """Text before the earliest tail that could still grow into a stop string."""
        n = len(self.text)
        for p in range(max(0, n - self._holdback), n):
            tail = self.text[p:]
            if any(s.startswith(tail) for s in self._stop):
                return p
        return n

    def take(self) -> Delta | None:
        """The text (and tokens) safe to show now; None when nothing new is to be said."""
        if self.finished:
            pieces, self._pending = self._pending, []
            end = len(self.text)
        else:
            limit = self._safe_limit()
            pieces = []
            while self._pending and self._pending[0].start + len(self._pending[0].text) <= limit:
                pieces.append(self._pending.pop(0))
            end = pieces[-1].start + len(pieces[-1].text) if pieces else self._emitted
        text = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        reason = None
        if self.finished and not self._reported:
            reason = self.finish_reason
            self._reported = True
        if not pieces and not text and reason is None:
            return None
        return Delta(text, pieces, reason)


def clamp_logprob(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: TokenizerLike, pieces: list[Piece], offset: int
) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for piece in pieces:
        lp = piece.logprob
        tokens.append(token_text(tokenizer, piece.token_id))
        token_logprobs.append(clamp_logprob(lp.logprob) if lp else 0.0)
        top: dict[str, float] = {}
        if lp is not None:
            top[tokens[-1]] = clamp_logprob(lp.logprob)
            for tid, value in lp.top:
                top.setdefault(token_text(tokenizer, tid), clamp_logprob(value))
        tops.append(top)
        offsets.append(offset + piece.start)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: TokenizerLike, pieces: list[Piece], top_n: int) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content: list[dict[str, Any]] = []
    for piece in pieces:
        lp = piece.logprob
        entry = _chat_entry(token_text(tokenizer, piece.token_id), lp.logprob if lp else 0.0)
        entry["top_logprobs"] = (
            [_chat_entry(token_text(tokenizer, tid), value) for tid, value in lp.top[:top_n]]
            if lp is not None
            else []
        )
        content.append(entry)
    return {"content": content}

"""Prompt logprobs on the wire: what a request asks for and how the answer is shaped.

Two spellings ask the engine to score the prompt (`SamplingParams.prompt_logprobs`):

- OpenAI's `echo: true` with `logprobs: k` on `/v1/completions` (what lm-evaluation-harness's
  loglikelihood sends): the choice's `logprobs` starts with the prompt's tokens, the first with
  `null` logprob and top (it has no context), then the generated ones, offsets into the echoed
  text;
- vLLM's `prompt_logprobs: k` (both routes): a list, `null` for the first token, then per
  token `{token id: {logprob, rank, decoded_token}}` holding the prompt token and the `k` most
  likely (on the choice for completions, on the response for chat, as vLLM places them).
"""

from __future__ import annotations

from typing import Any

from mstar.engine.model.tokenizer import IncrementalDetokenizer
from mstar.engine.outputs import TokenLogprob
from mstar.engine.sampling_params import InvalidParameter, SamplingParams
from mstar.engine.server.choice import TokenizerLike, clamp_logprob, token_text


def parse_prompt_logprobs(body: dict[str, Any], echo_top: int | None) -> int | None:
    """The prompt scoring a request asks for: vLLM's `prompt_logprobs` (0-20) or, on
    completions, ``echo_top`` (`logprobs` when `echo` is set); the larger when both."""
    raw = body.get("prompt_logprobs")
    if raw is not None and (
        isinstance(raw, bool)
        or not isinstance(raw, int)
        or not 0 <= raw <= SamplingParams.MAX_LOGPROBS
    ):
        raise InvalidParameter(
            "prompt_logprobs",
            f"'prompt_logprobs' must be an integer in [0, {SamplingParams.MAX_LOGPROBS}]",
        )
    asked = [k for k in (raw, echo_top) if k is not None]
    return max(asked) if asked else None


def _prompt_pieces(tok: Any, prompt_ids: list[int]) -> tuple[list[str], list[int]]:
    """Each prompt token's text and where it starts in the decoded prompt (decoded as the
    choice's text is, so a tokenizer whose tokens carry no spaces still lines up)."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    offsets: list[int] = []
    at = 0
    for t in prompt_ids:
        offsets.append(at)
        at += len(detok.add([t]))
    return [token_text(tok, t) for t in prompt_ids], offsets


def echo_logprobs(
    tok: TokenizerLike, prompt_ids: list[int], scores: list[TokenLogprob], top: int
) -> dict[str, Any]:
    """The prompt's part of a completions `logprobs` (OpenAI's legacy shape)."""
    texts, offsets = _prompt_pieces(tok, prompt_ids)
    token_logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for text, s in zip(texts[1:], scores, strict=False):
        token_logprobs.append(clamp_logprob(s.logprob))
        entry = {text: clamp_logprob(s.logprob)}
        for tid, value in s.top[:top]:
            entry.setdefault(token_text(tok, tid), clamp_logprob(value))
        tops.append(entry)
    n = len(token_logprobs)
    return {
        "tokens": texts[:n],
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets[:n],
    }


def join_echo(prompt: dict[str, Any], generated: dict[str, Any], shift: int) -> dict[str, Any]:
    """The echoed prompt's logprobs followed by the generated tokens', whose offsets move past
    the echoed text (``shift`` characters)."""
    out = {key: list(values) for key, values in prompt.items()}
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        out[key].extend(generated[key])
    out["text_offset"].extend(shift + o for o in generated["text_offset"])
    return out


def vllm_prompt_logprobs(
    tok: TokenizerLike, prompt_ids: list[int], scores: list[TokenLogprob]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None, then per token its entry and its top alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for s in scores:
        entry = {
            str(s.token_id): {
                "logprob": clamp_logprob(s.logprob),
                "rank": s.rank,
                "decoded_token": token_text(tok, s.token_id),
            }
        }
        for i, (tid, value) in enumerate(s.top):
            entry.setdefault(
                str(tid),
                {
                    "logprob": clamp_logprob(value),
                    "rank": i + 1,
                    "decoded_token": token_text(tok, tid),
                },
            )
        out.append(entry)
    return out[: len(prompt_ids)]

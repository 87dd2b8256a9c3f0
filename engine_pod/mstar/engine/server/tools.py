"""Tool calling: the `tools` / `tool_choice` a chat request declares, and the calls in its output.

- `none`: tools are left out of the prompt; the output is plain content.
- `auto`: the model decides. Calls are read from its text in the Hermes / Qwen2.5 format,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside them is content.
- `required`: the output is constrained (grammar) to a JSON array of one or more calls, each
  naming a declared tool with arguments valid for its schema: exactly one with
  `parallel_tool_calls: false`, at most one per declared tool when it is unset (`max_calls`),
  any number when it is true.

A list of calls cut by `max_tokens` keeps its complete calls (`parse_output`); the cut tail is
dropped and the finish reason stays "length".
- a named function: the output is constrained to that function's arguments.

Templates that know tools (they mention `tools`) render them themselves; for others a system
message lists them in the Hermes format, so `auto` has a format to follow.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mstar.engine.sampling_params import GrammarSpec, InvalidParameter

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as the request declared it (what chat templates expect)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolConfig:
    """A chat request's tools; `choice` is "none", "auto", "required" or a tool's name."""

    tools: tuple[Tool, ...]
    choice: str
    #: `parallel_tool_calls`; None when the request left it unset.
    parallel: bool | None

    @property
    def max_calls(self) -> int | None:
        """Most calls one turn may make (None: no bound). Unset, OpenAI's default is parallel
        calls; a turn of parallel calls does each of several jobs once, so the bound is one
        call per declared tool. Without it a small model forced to call repeats its call until
        `max_tokens` (pydantic-ai's `final_result`, measured) and every call is lost."""
        if self.parallel is False:
            return 1
        return len(self.tools) if self.parallel is None else None

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def grammar(self) -> GrammarSpec | None:
        """The grammar a forced choice constrains the output to (None for none / auto)."""
        if self.choice == "required":
            calls: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": [call_schema(t) for t in self.tools]},
            }
            if self.max_calls is not None:
                calls["maxItems"] = self.max_calls
            return GrammarSpec.json_schema(calls)
        if self.forced:
            return GrammarSpec.json_schema(self._named().parameters)
        return None

    def _named(self) -> Tool:
        return next(t for t in self.tools if t.name == self.choice)

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """Tools to show the model: the named one only when forced to it; none for "none"."""
        if self.choice == "none":
            return None
        if self.forced and self.choice != "required":
            return [self._named().openai()]
        return [t.openai() for t in self.tools]


def call_schema(tool: Tool) -> dict[str, Any]:
    """One call of ``tool`` as JSON: its name and its arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# -- parsing the request ---------------------------------------------------------------------


def parse_tools(body: dict[str, Any]) -> ToolConfig | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> a `ToolConfig` (None: no tools).

    Raises `InvalidParameter` naming the parameter at fault (the server answers 400)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(raw, list):
        raise InvalidParameter("tools", "'tools' must be a list")
    tools = tuple(_parse_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "'tools' names must be unique")
    return ToolConfig(tools, _parse_choice(choice, names), parallel)


def _parse_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidParameter(
            "tools", f"'{where}' must be {{'type': 'function', 'function': ...}}"
        )
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidParameter("tools", f"'{where}.function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidParameter(
            "tools", f"'{where}.function.name' is required: 1-64 letters, digits, '_', '.' or '-'"
        )
    description = fn.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise InvalidParameter("tools", f"'{where}.function.description' must be a string")
    params = fn.get("parameters")
    if params is None:  # OpenAI: a function without parameters takes none
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidParameter(
            "tools", f"'{where}.function.parameters' must be a JSON schema object"
        )
    return Tool(name, description, params)


def _parse_choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidParameter(
                "tool_choice",
                "'tool_choice' must be 'none', 'auto', 'required' or a named function",
            )
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise InvalidParameter(
            "tool_choice",
            "'tool_choice' must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
        )
    if name not in names:
        raise InvalidParameter(
            "tool_choice", f"'tool_choice' names '{name}', which is not in 'tools'"
        )
    return str(name)


# -- rendering the conversation ----------------------------------------------------------------


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
) -> list[dict[str, Any]]:
    """Messages for the chat template. ``native``: the template renders tools and tool calls
    itself (arguments as objects, as transformers passes them); otherwise calls become Hermes
    text in the assistant's content and the tools a system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
        elif native:
            out.append({**m, "tool_calls": [_with_object_arguments(c) for c in calls]})
        else:
            text = "".join(_hermes_call(c["function"]) for c in calls)
            out.append({"role": m["role"], "content": m["content"] + text})
    if tools and not native:
        system = _hermes_system(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call["function"])
    with contextlib.suppress(json.JSONDecodeError):  # else: what the client sent
        fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


def _hermes_call(fn: dict[str, Any]) -> str:
    try:
        arguments: Any = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        arguments = fn["arguments"]
    return f"{CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': arguments})}\n{CALL_CLOSE}"


def _hermes_system(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You can call functions. Their signatures are inside <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, answer with a JSON object holding its name and arguments inside "
        f'{CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n{{"name": "...", "arguments": {{}}}}\n'
        f"{CALL_CLOSE}"
    )


# -- reading the output ------------------------------------------------------------------------


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's `tool_calls`."""
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_from(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return new_call(obj["name"], text)


def parse_output(config: ToolConfig, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished choice's text -> (content, tool calls). Text that is not a well-formed call
    of a declared tool stays content."""
    names = {t.name for t in config.tools}
    if config.choice == "none":
        return text, []
    if config.forced and config.choice != "required":
        return None, [new_call(config.choice, text)]
    if config.choice == "required":
        calls = [c for c in (_call_from(i, names) for i in _complete_items(text)) if c is not None]
        return (None, calls) if calls else (text, [])
    calls = []
    closed = text.rfind(CALL_CLOSE)
    if 0 <= closed < text.rfind(CALL_OPEN):  # a call cut short after complete ones: dropped
        text = text[: text.rfind(CALL_OPEN)]
    for block in _CALL_RE.findall(text):
        try:
            call = _call_from(json.loads(block), names)
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # one malformed block: the whole text is the answer
        calls.append(call)
    if not calls:
        return text, []
    content = _CALL_RE.sub("", text).strip()
    return content or None, calls


def _complete_items(text: str) -> list[Any]:
    """The complete items of a JSON array, also of one cut short (`max_tokens`)."""
    decoder = json.JSONDecoder()
    at = text.find("[")
    items: list[Any] = []
    if at < 0:
        return items
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


class ToolStream:
    """One streamed choice's deltas when tools are declared (chat only).

    A named function streams its arguments as they come. `auto` streams content until a
    ``<tool_call>`` may be starting (a tail that could open one is held back), then holds the
    rest; `required` holds everything. At the end, held text becomes whole tool calls (one
    delta each), or content when it does not parse as calls.
    """

    def __init__(self, config: ToolConfig) -> None:
        self.config = config
        self.text = ""
        self._sent = 0
        self._named: dict[str, Any] | None = None
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas (`content` or `tool_calls`) to send for ``text``, the choice's new text."""
        self.text += text
        cfg = self.config
        if cfg.choice == "none":
            return self._content(len(self.text))
        if cfg.choice == "auto":
            opened = self.text.find(CALL_OPEN)
            return self._content(opened if opened >= 0 else _safe_end(self.text))
        if cfg.choice == "required" or not text:
            return []
        if self._named is None:
            self._named = new_call(cfg.choice, "")
            self.calls = [self._named]
            return [
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            **self._named,
                            "function": {"name": cfg.choice, "arguments": text},
                        }
                    ]
                }
            ]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self._sent:
            return []
        piece, self._sent = self.text[self._sent : end], end
        return [{"content": piece}]

    def end(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the finish reason ("tool_calls" when calls were made)."""
        cfg = self.config
        if cfg.forced and cfg.choice != "required":
            deltas: list[dict[str, Any]] = []
            if self._named is None:  # no text at all: still the call, with empty arguments
                self._named = new_call(cfg.choice, "")
                self.calls = [self._named]
                deltas = [{"tool_calls": [{"index": 0, **self._named}]}]
            return deltas, _with_calls(reason, True)
        _, calls = parse_output(cfg, self.text) if cfg.choice != "none" else (None, [])
        if not calls:
            return self._content(len(self.text)), reason
        self.calls = calls
        deltas = [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
        return deltas, _with_calls(reason, True)


def reported_reason(config: ToolConfig | None, text: str, reason: str) -> str:
    """The finish reason a choice reports (and `/metrics` counts): "tool_calls" when its
    complete text holds calls and it stopped by itself."""
    if config is None or config.choice == "none" or reason != "stop":
        return reason
    return _with_calls(reason, bool(parse_output(config, text)[1]))


def _with_calls(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


def _safe_end(text: str) -> int:
    """Where content may be sent up to: before a tail that could grow into ``<tool_call>``."""
    for start in range(max(0, len(text) - len(CALL_OPEN) + 1), len(text)):
        if CALL_OPEN.startswith(text[start:]):
            return start
    return len(text)

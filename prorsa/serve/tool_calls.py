"""Tool calls on ``/v1/chat/completions``, parsed by vLLM's own tool-call parsers.

A request's ``tools`` reach the chat template (the model sees them as ``vllm serve`` would
show them). With ``--tool-call-parser NAME`` (the names ``vllm serve`` takes: ``hermes``
for Qwen2.5, ``qwen3_coder``, ``llama3_json``, ...), the reply's text is parsed into
OpenAI ``tool_calls`` and the finish reason becomes ``tool_calls``, as vLLM's server does
with ``--enable-auto-tool-choice``; without one, the text is returned as it is (a trainer
that parses tool calls itself needs nothing more). ``tool_choice`` ``"required"`` or a
named function would need guided decoding, which prorsa does not do: a 400.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prorsa.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

#: ``tool_choice`` values served (the model decides; or tools are shown but not parsed).
TOOL_CHOICES = ("auto", "none")


def check_tools(tools: Any, tool_choice: Any) -> None:
    """InputError (naming the field) for ``tools`` or a ``tool_choice`` prorsa cannot serve."""
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise InputError("tools must be a list of objects", field="tools")
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise InputError(
            f"tool_choice {tool_choice!r} needs guided decoding, which prorsa does not do",
            field="tool_choice",
            hint=f"use one of {TOOL_CHOICES}",
        )


class ToolCallParser:
    """One of vLLM's tool-call parsers, by name, over the service's tokenizer.

    Raises:
        ConfigError: an unknown parser name (the error lists the known ones).
    """

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        known = ToolParserManager.list_registered()
        if name not in known:
            raise ConfigError(f"unknown tool-call parser {name!r}", hint=f"one of {known}")
        self.name = name
        self._parser_cls = ToolParserManager.get_tool_parser(name)
        self._tokenizer = tokenizer

    def request_for(self, body: dict[str, Any]) -> Any:
        """The chat request as vLLM's ``ChatCompletionRequest`` (what its parsers read),
        checked before anything is generated: InputError names the first bad field."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = ("messages", "tools", "tool_choice", "parallel_tool_calls")
        try:
            return ChatCompletionRequest.model_validate(
                {"model": "prorsa", **{k: body[k] for k in fields if body.get(k) is not None}}
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise InputError(f"{where}: {first['msg']}", field=str(first["loc"][0])) from None

    def assistant_message(self, text: str, request: Any) -> tuple[dict[str, Any], bool]:
        """The reply as an OpenAI assistant message, and whether it called a tool.

        ``request``: from :meth:`request_for`. With ``parallel_tool_calls`` false only
        the first call is kept, as vLLM does. A parser that fails on the text leaves it
        as plain content (logged), as vLLM's own parsers do.
        """
        try:
            parser = self._parser_cls(self._tokenizer, request.tools)
            info = parser.extract_tool_calls(text, request)
        except Exception:
            logger.exception("tool-call parser %s failed; the reply stays text", self.name)
            return {"role": "assistant", "content": text}, False
        if not info.tools_called:
            return {"role": "assistant", "content": text}, False
        calls = [call.model_dump(exclude_none=True) for call in info.tool_calls]
        if request.parallel_tool_calls is False:
            calls = calls[:1]
        return {"role": "assistant", "content": info.content, "tool_calls": calls}, True


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, as vLLM hands them over: an assistant
    turn's tool-call ``arguments`` as objects (OpenAI sends JSON text; a malformed one
    becomes ``{}``, so one bad turn in the history does not fail every later one), empty
    ``tool_calls`` dropped, and missing content empty."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                del message["tool_calls"]
            else:
                message["tool_calls"] = [_with_object_arguments(call) for call in calls]
        out.append(message)
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = {}
    elif arguments is None:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}

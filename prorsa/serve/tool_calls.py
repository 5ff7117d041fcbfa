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

from typing import Any

from prorsa.errors import ConfigError, InputError

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

    def assistant_message(self, text: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The reply as an OpenAI assistant message, and whether it called a tool.

        ``body``: the chat request (its ``messages``, ``tools``, ``tool_choice`` and
        ``parallel_tool_calls``, which some parsers read). With ``parallel_tool_calls``
        false only the first call is kept, as vLLM does.
        """
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = ("messages", "tools", "tool_choice", "parallel_tool_calls")
        try:
            request = ChatCompletionRequest.model_validate(
                {"model": "prorsa", **{k: body[k] for k in fields if body.get(k) is not None}}
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise InputError(f"{where}: {first['msg']}", field=str(first["loc"][0])) from None
        parser = self._parser_cls(self._tokenizer, request.tools)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return {"role": "assistant", "content": text}, False
        calls = [call.model_dump(exclude_none=True) for call in info.tool_calls]
        if body.get("parallel_tool_calls") is False:
            calls = calls[:1]
        return {"role": "assistant", "content": info.content, "tool_calls": calls}, True

"""What every agent tool is: an async ``call(args) -> ToolResult`` with a name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolResult:
    """A tool's observation text, whether it succeeded, and how long it really ran."""

    text: str
    ok: bool = True
    exec_s: float = 0.0


class Tool(Protocol):
    """A local tool the agent loop can call between turns."""

    name: str

    async def call(self, args: dict[str, object]) -> ToolResult: ...

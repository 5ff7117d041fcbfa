"""A Python expression evaluator that runs in a separate, resource-limited process.

Two layers keep it safe enough for generated arguments: the expression is parsed and
checked against a whitelist of syntax (arithmetic, comparisons, literals, comprehensions,
calls of a few pure built-ins and ``math`` functions; no attributes other than
``math.<name>``, no dunder names, no imports, no assignment), and then evaluated in a fresh
interpreter (``python -I -S``) with CPU-time, memory and output limits and a wall-clock
timeout, so a runaway expression (``9**9**9``) costs at most the timeout.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import math
import sys
import time

from prorsa.runtime.ray.tools.base import ToolResult

#: Names an expression may call or read.
SAFE_NAMES: frozenset[str] = frozenset(
    [
        "abs",
        "min",
        "max",
        "sum",
        "len",
        "range",
        "round",
        "pow",
        "sorted",
        "divmod",
        "all",
        "any",
        "int",
        "float",
        "bool",
        "str",
        "list",
        "tuple",
        "math",
        "True",
        "False",
        "None",
    ]
)
_SAFE_NODES: tuple[type, ...] = (
    ast.Expression,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.keyword,
    ast.List,
    ast.Tuple,
    ast.Set,
    ast.Dict,
    ast.Subscript,
    ast.Slice,
    ast.ListComp,
    ast.SetComp,
    ast.GeneratorExp,
    ast.DictComp,
    ast.comprehension,
    ast.Store,
    ast.Attribute,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
)

# Runs in the child: builtins stripped to SAFE_NAMES; the parent already checked the syntax.
_CHILD = r"""
import math, resource, sys
limit_mb, cpu_s = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
names = set(sys.argv[3].split(","))
import builtins
env = {n: getattr(builtins, n) for n in names if hasattr(builtins, n)}
env["math"] = math
try:
    value = eval(compile(sys.stdin.read(), "<tool>", "eval"), {"__builtins__": {}}, env)
    ok, text = 1, repr(value)
except BaseException as exc:
    ok, text = 0, f"{type(exc).__name__}: {exc}"
sys.stdout.write(f"{ok}{text[:4000]}")
"""


def check_expression(expression: str) -> str | None:
    """Why ``expression`` is refused, or None when it passes the whitelist."""
    if len(expression) > 2000:
        return "expression longer than 2000 characters"
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg}"
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension):
            bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):
        if not isinstance(node, _SAFE_NODES):
            return f"{type(node).__name__} is not allowed"
        if isinstance(node, ast.Name) and node.id not in SAFE_NAMES and node.id not in bound:
            return f"name {node.id!r} is not allowed"
        if isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name)
            and node.value.id == "math"
            and not node.attr.startswith("_")
            and hasattr(math, node.attr)
        ):
            return "only math.<function> attributes are allowed"
    return None


class PythonEvalTool:
    """Evaluate a restricted Python expression in a subprocess.

    Args:
        timeout_s: wall-clock limit per call (the child is killed after it).
        memory_mb: address-space limit of the child.
    """

    name = "python"

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    async def call(self, args: dict[str, object]) -> ToolResult:
        """Run ``args["expression"]``; the result or error text is the observation."""
        expression = str(args.get("expression", ""))
        started = time.perf_counter()
        refused = check_expression(expression)
        if refused is not None:
            return ToolResult(f"refused: {refused}", ok=False, exec_s=time.perf_counter() - started)
        # The CPU limit backs up the wall-clock timeout (which normally fires first).
        cpu_s = math.ceil(self.timeout_s) + 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            "-c",
            _CHILD,
            str(self.memory_mb),
            str(cpu_s),
            ",".join(sorted(SAFE_NAMES)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(expression.encode()), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()  # reap it: no zombie, no orphan
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return ToolResult(
                f"TimeoutError: no result within {self.timeout_s:g} s",
                ok=False,
                exec_s=time.perf_counter() - started,
            )
        text = out.decode(errors="replace")
        # First character is the child's verdict; no output at all means it was killed
        # (CPU or memory limit) before it could write.
        ok = proc.returncode == 0 and text[:1] == "1"
        text = text[1:] if text else f"killed (exit {proc.returncode}): a resource limit was hit"
        return ToolResult(text, ok=ok, exec_s=time.perf_counter() - started)

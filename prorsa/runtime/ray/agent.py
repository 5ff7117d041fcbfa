"""The agent loop: one trajectory's turns through the router, real tools in between.

Per turn: the whole context goes to :meth:`PDRouter.generate` (exactly the spec's output
tokens: ``max_tokens`` with ``ignore_eos``), the output is appended, then a real tool runs
and its observation, tokenised with the model's tokenizer and sized to the spec's next
``new_tokens``, is appended too. What is spec-driven rather than model-driven, and why:
a random tiny model writes gibberish, so the tool and its arguments are drawn from the
trajectory's seeded plan (:mod:`.tools.plan`) and lengths come from the spec; the engines,
the KV movement, the tools' execution and all timings are real. With ``pad_tool_latency``
each tool call lasts at least the spec's (time-scaled) tool latency, so the run keeps the
scenario's tool-time profile while the tool's own work happens inside that time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prorsa.runtime.ray.router import PDRouter, TurnRequest
from prorsa.runtime.ray.specs import TokenSource
from prorsa.runtime.ray.tools import Tool, ToolCall, plan_call, trajectory_rng
from prorsa.telemetry.schema import EventKind as K
from prorsa.workload.spec import TrajectorySpec

logger = logging.getLogger(__name__)


@dataclass
class TrajectoryOutcome:
    """What one trajectory did."""

    trajectory_id: str
    turns: int = 0
    output_tokens: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    tool_errors: int = 0
    retries: int = 0
    reroutes: int = 0
    final_context_tokens: int = 0
    #: ``complete``, ``failed`` (an error) or ``interrupted`` (cancelled: signal, stop).
    status: str = "complete"
    error: str | None = None


class AgentLoop:
    """Runs trajectories turn by turn.

    Args:
        router: serves each turn.
        tokens: builds prompts and observations with the model's tokenizer.
        tools: the tools available, by name.
        seed: seeds every trajectory's tool plan.
        pad_tool_latency: make each tool call last at least its spec latency.
        temperature: sampling temperature of every turn.
    """

    def __init__(
        self,
        router: PDRouter,
        tokens: TokenSource,
        tools: Mapping[str, Tool],
        *,
        seed: int = 0,
        pad_tool_latency: bool = True,
        temperature: float = 0.0,
        vocabulary: Sequence[str] = ("agent", "tool", "prefill", "decode"),
    ) -> None:
        self.router = router
        self.tokens = tokens
        self.tools = dict(tools)
        self.seed = seed
        self.pad_tool_latency = pad_tool_latency
        self.temperature = temperature
        self.vocabulary = list(vocabulary)
        self._prompts: dict[str, list[int]] = {}

    def group_prompt(self, spec: TrajectorySpec) -> list[int]:
        """The prompt every member of the spec's GRPO group shares."""
        key = spec.group_id or spec.trajectory_id
        length = int(spec.new_tokens[0])
        if key not in self._prompts or len(self._prompts[key]) != length:
            self._prompts[key] = self.tokens.prompt(key, spec.task, length)
        return self._prompts[key]

    async def run(self, spec: TrajectorySpec) -> TrajectoryOutcome:
        """Run every turn of ``spec``; events go to the router's telemetry."""
        outcome = TrajectoryOutcome(spec.trajectory_id)
        rng = trajectory_rng(self.seed, spec.trajectory_id)
        context = list(self.group_prompt(spec))
        where = {"group_id": spec.group_id, "task": spec.task}
        self.router.trajectory_event(
            K.TRAJ_START, spec.trajectory_id, 0, context_tokens=len(context), **where
        )
        turn = 0
        try:
            for turn in range(spec.num_turns):
                output = int(spec.output_tokens[turn])
                result = await self.router.generate(
                    TurnRequest(
                        spec.trajectory_id,
                        list(context),
                        output,
                        turn=turn,
                        temperature=self.temperature,
                        ignore_eos=True,
                        **where,
                    )
                )
                context += result.output_token_ids
                outcome.turns += 1
                outcome.output_tokens.append(len(result.output_token_ids))
                outcome.paths.append(result.path)
                outcome.retries += result.retries
                outcome.reroutes += result.reroutes
                if turn + 1 < spec.num_turns:
                    call = plan_call(
                        spec.task,
                        rng,
                        self.vocabulary,
                        float(spec.tool_latency_s[turn]),
                        sorted(self.tools),
                    )
                    observation = await self._tool(spec, turn, call, len(context), outcome)
                    context += observation
        except BaseException as exc:
            # Cancellation (Ctrl-C, SIGTERM, a stopped run) is a BaseException: it must
            # end the trajectory as interrupted, never as if its turns were all done.
            outcome.status = "failed" if isinstance(exc, Exception) else "interrupted"
            outcome.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise
        finally:
            outcome.final_context_tokens = len(context)
            end = {"turns": outcome.turns, "planned_turns": spec.num_turns}
            if outcome.status != "complete":
                end.update(status=outcome.status, error=outcome.error)
            self.router.trajectory_event(
                K.TRAJ_END,
                spec.trajectory_id,
                turn,
                context_tokens=len(context),
                **end,
                **where,
            )
        return outcome

    async def _tool(
        self,
        spec: TrajectorySpec,
        turn: int,
        call: ToolCall,
        context: int,
        outcome: TrajectoryOutcome,
    ) -> list[int]:
        where = {"group_id": spec.group_id, "task": spec.task}
        target_s = float(spec.tool_latency_s[turn])
        self.router.trajectory_event(
            K.TOOL_START,
            spec.trajectory_id,
            turn,
            context_tokens=context,
            tool=call.tool,
            target_s=round(target_s, 6),
            tool_time_scale=spec.meta.get("tool_time_scale"),
            **where,
        )
        started = time.perf_counter()
        result = await self.tools[call.tool].call(call.args)
        if self.pad_tool_latency:
            await asyncio.sleep(max(0.0, target_s - (time.perf_counter() - started)))
        size = int(spec.new_tokens[turn + 1])
        observation = self.tokens.observation(result.text, size)
        outcome.tools.append(call.tool)
        outcome.tool_errors += not result.ok
        self.router.trajectory_event(
            K.TOOL_END,
            spec.trajectory_id,
            turn,
            context_tokens=context,
            tool=call.tool,
            ok=result.ok,
            appended_tokens=size,
            exec_s=round(result.exec_s, 6),
            observation_tokens=len(self.tokens.encode(result.text)),
            **where,
        )
        return observation

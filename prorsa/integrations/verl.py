"""verl through prorsa: an ``agent_loop_manager_class`` whose LLM client is a prorsa server.

verl's agent loops call ``llm_client.generate(request_id, prompt_ids=..., sampling_params=
...) -> TokenOutput`` (``request_id`` is stable per trajectory: verl's sticky session).
:class:`ProrsaLLMClient` implements that call against ``prorsa serve``'s
``/inference/v1/generate``, with the request id as ``X-Session-ID``, so every turn goes
through prorsa's router and its prefill/decode engines. Under verl 0.9's default V1
trainer (``trainer.use_v1=true``, its ``sync`` mode) set::

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=prorsa.integrations.verl.ProrsaAgentLoopManagerTQ
    +actor_rollout_ref.rollout.custom.prorsa_url=http://HOST:PORT

and under its PPO trainer (``trainer.use_v1=false``) the same with
``prorsa.integrations.verl.ProrsaAgentLoopManager``. (``+``: neither key is in verl's
config files, only in its dataclasses, and Hydra refuses an override of a key it does
not have.)

``ProrsaAgentLoopManager`` is verl's own ``AgentLoopManager`` with the client swapped,
``ProrsaAgentLoopManagerTQ`` verl's ``AgentLoopManagerTQ`` likewise: its workers still
write every turn's output to TransferQueue, only the server they ask is prorsa (both
built on first use, so this module imports without verl). verl keeps its own weight sync:
its checkpoint engine updates the replicas it manages, in memory, and tells no manager.
What verl does write is its checkpoint: with ``trainer.save_freq=1`` and ``hf_model`` in
``actor_rollout_ref.actor.checkpoint.save_contents``, each step's weights land in
``{trainer.default_local_dir}/global_step_{N}/actor/huggingface`` (``actor/model/huggingface``
from Megatron) before the next step generates. The manager's :class:`CheckpointFollower`
loads the newest such folder into prorsa's engines (``POST /update_weights``, version N)
at the start of each ``generate_sequences``, which verl calls with the step in
``meta_info["global_steps"]`` (the V1 trainer: in the batch's ``global_steps``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorsa.errors import ConfigError

logger = logging.getLogger(__name__)

URL_ENV = "PRORSA_URL"
TOKEN_ENV = "PRORSA_ADMIN_TOKEN"
#: Where in ``global_step_{N}`` verl's checkpoint managers save the weights in Hugging Face
#: format: FSDP's (and veomni's), then Megatron's.
HF_WEIGHTS = (("actor", "huggingface"), ("actor", "model", "huggingface"))
#: verl sampling keys prorsa takes as they are.
_PASS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "ignore_eos",
    "stop_token_ids", "max_tokens", "min_tokens", "presence_penalty", "frequency_penalty",
)  # fmt: skip


@dataclass
class TokenOutputLike:
    """verl's ``TokenOutput`` fields, for use without verl installed."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


def verl_sampling(
    sampling_params: dict[str, Any], default_max_tokens: int, room: int | None = None
) -> dict[str, Any]:
    """verl's sampling dict as prorsa's: ``logprobs`` is a flag there, a count here.

    ``room``: the tokens left in the context after the prompt; ``max_tokens`` is kept
    within ``[1, room]`` as verl's own servers do."""
    out = {k: sampling_params[k] for k in _PASS if sampling_params.get(k) is not None}
    out.setdefault("max_tokens", sampling_params.get("max_new_tokens") or default_max_tokens)
    if room is not None:
        out["max_tokens"] = min(out["max_tokens"], room)
    out["max_tokens"] = max(1, out["max_tokens"])  # a spent budget still decodes one token
    if sampling_params.get("logprobs"):
        out["logprobs"] = 0
    unknown = set(sampling_params) - set(_PASS) - {"logprobs", "max_new_tokens", "extra_args"}
    if unknown:
        raise ConfigError(f"verl sampling keys prorsa does not take: {sorted(unknown)}")
    return out


class ProrsaLLMClient:
    """verl's ``LLMServerClient.generate`` over HTTP to a prorsa server (picklable).

    Args:
        url: the prorsa server.
        max_tokens: verl's ``rollout.response_length``: the most tokens of one turn.
        prompt_length: verl's ``rollout.prompt_length``; with it, a turn without its own
            limit stops where verl's servers stop it, at ``prompt_length +
            response_length - len(prompt)`` (a later turn of a trajectory gets less; the
            tokens past it verl would cut off anyway).
        max_model_len: the context length; a turn's limit never passes what is left of it.
    """

    def __init__(
        self,
        url: str,
        *,
        max_tokens: int = 512,
        prompt_length: int | None = None,
        max_model_len: int | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.max_tokens = max_tokens
        self.prompt_length = prompt_length
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self._clients: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_clients": {}}

    def _http(self) -> Any:
        import httpx

        loop_id = id(asyncio.get_running_loop())
        client = self._clients.get(loop_id)
        if client is None:
            client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s)
            self._clients[loop_id] = client
        return client

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        """One turn; returns verl's ``TokenOutput`` (or :class:`TokenOutputLike`)."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ConfigError("prorsa serves text models: no image, video or audio inputs")
        prompt = list(prompt_ids)
        limit = self.max_tokens
        if self.prompt_length is not None:
            limit = min(limit, self.prompt_length + self.max_tokens - len(prompt))
        room = None if self.max_model_len is None else self.max_model_len - len(prompt)
        body = {"token_ids": prompt, "sampling_params": verl_sampling(sampling_params, limit, room)}
        response = await self._http().post(
            "/inference/v1/generate", json=body, headers={"X-Session-ID": str(request_id)}
        )
        if response.status_code >= 400:
            raise RuntimeError(f"prorsa {response.status_code}: {response.text[:500]}")
        data = response.json()
        choice = data["choices"][0]
        content = (choice.get("logprobs") or {}).get("content")
        finish = choice.get("finish_reason")
        version = data.get("prorsa", {}).get("weight_version")
        # Spans carry the trainer's labels; the step count is the version's number.
        spanned = [
            span["version_number"]
            for span in choice.get("weight_versions") or []
            if span.get("version_number") is not None
        ]
        return _token_output(
            token_ids=choice["token_ids"],
            log_probs=[entry["logprob"] for entry in content] if content else None,
            stop_reason="aborted" if finish == "abort" else "completed",
            num_preempted=0,
            # verl's trainer reads the policy versions a turn was sampled under (its
            # staleness bookkeeping): prorsa's weight versions, as the trainer posted them.
            extra_fields={
                "weight_version": version,
                "global_steps": version if version is not None else max(spanned, default=0),
                "min_global_steps": min(spanned, default=version or 0),
                "max_global_steps": max(spanned, default=version or 0),
            },
        )

    async def finish(self, request_id: str) -> None:
        """End the trajectory's session (telemetry ``traj_end``); optional."""
        await self._http().post("/finish_session", params={"session_id": str(request_id)})


class CheckpointFollower:
    """Loads verl's newest saved Hugging Face weights into prorsa's engines.

    verl's replicas get each step's weights in memory; prorsa's engines only from disk.
    Before step ``S`` generates, the weights verl trains from are those its step ``S - 1``
    saved, in ``{checkpoint_dir}/global_step_{S-1}/actor/huggingface``. :meth:`sync` loads
    the newest complete such folder below ``S`` that prorsa does not serve yet, as weight
    version ``S - 1`` (the number verl's staleness checks read back from each turn).

    Args:
        url: the prorsa server.
        checkpoint_dir: verl's ``trainer.default_local_dir``.
        admin_token: the server's ``--admin-token``, if it has one.
        timeout_s: the most seconds one weight load may take.
    """

    def __init__(
        self,
        url: str,
        checkpoint_dir: str | os.PathLike[str],
        *,
        admin_token: str | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        # Absolute: the server resolves a relative folder against its own working
        # directory (verl's default checkpoint folder is relative).
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.admin_token = admin_token
        self.timeout_s = timeout_s
        #: The step whose weights prorsa serves (None: none loaded by this follower).
        self.loaded_step: int | None = None
        self._warned_none = False
        # sync runs in worker threads (the manager's coroutine hands it off); two at once,
        # a validation beside a generation, could both load and the older land last.
        self._lock = threading.Lock()

    def newest_below(self, step: int) -> tuple[int, Path] | None:
        """(step, folder) of the newest complete saved weights of a step before ``step``."""
        found = []
        for folder in self.checkpoint_dir.glob("global_step_*"):
            number = folder.name.removeprefix("global_step_")
            if not number.isdigit() or int(number) >= step:
                continue
            for parts in HF_WEIGHTS:
                if _complete(weights := folder.joinpath(*parts)):
                    found.append((int(number), weights))
                    break
        return max(found, default=None)

    def sync(self, step: int | None) -> dict[str, Any] | None:
        """Before verl's step ``step`` generates: load the weights it trains from, if
        prorsa does not serve them yet. Returns the server's update summary, or None when
        there was nothing newer to load (a warning says when the newest saved step lags
        the weights verl serves itself). One call at a time."""
        with self._lock:
            return self._sync(step)

    def _sync(self, step: int | None) -> dict[str, Any] | None:
        if step is None:
            return None
        newest = self.newest_below(int(step))
        if newest is None and int(step) > 1 and not self._warned_none:
            self._warned_none = True
            logger.warning(
                "verl step %d: no saved Hugging Face weights under %s (looked in %s of "
                "each global_step_N): prorsa serves the weights it started with",
                step, self.checkpoint_dir, " and ".join("/".join(p) for p in HF_WEIGHTS),
            )  # fmt: skip
        if newest is not None and newest[0] < int(step) - 1:
            logger.warning(
                "verl step %d generates from step %d's weights, but the newest saved are "
                "step %d's: prorsa serves older weights than verl's own replicas (set "
                "trainer.save_freq=1 and add hf_model to the checkpoint's save_contents)",
                step, int(step) - 1, newest[0],
            )  # fmt: skip
        if newest is None or (self.loaded_step is not None and newest[0] <= self.loaded_step):
            return None
        import httpx

        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            response = http.post(
                "/update_weights",
                json={"weight_dir": str(newest[1]), "version": newest[0]},
                headers=headers,
            )
        if response.status_code >= 400:
            raise RuntimeError(
                f"prorsa refused verl's step {newest[0]} weights ({newest[1]}): "
                f"{response.status_code} {response.text[:500]}"
            )
        self.loaded_step = newest[0]
        return response.json()


def _complete(folder: Path) -> bool:
    """A ``save_pretrained`` folder with its config and at least one weights file."""
    if not (folder / "config.json").is_file():
        return False
    from prorsa.runtime.ray.weights import WEIGHT_SUFFIXES  # what the server takes

    return any(f.suffix in WEIGHT_SUFFIXES and f.is_file() for f in folder.iterdir())


def checkpoint_follower(config: Any, url: str) -> CheckpointFollower | None:
    """The follower verl's config asks for (``rollout.custom.prorsa_follow_checkpoints``,
    default on), after checking that verl will save what it reads."""
    custom = config.actor_rollout_ref.rollout.get("custom") or {}
    if not custom.get("prorsa_follow_checkpoints", True):
        return None
    trainer = config.trainer
    contents = list(config.actor_rollout_ref.actor.checkpoint.get("save_contents") or [])
    if "hf_model" not in contents or trainer.get("save_freq") != 1:
        raise ConfigError(
            "prorsa's engines load verl's weights from its checkpoints, which this config "
            f"does not save every step (save_freq={trainer.get('save_freq')!r}, "
            f"save_contents={contents!r})",
            hint="set trainer.save_freq=1 and add hf_model to "
            "actor_rollout_ref.actor.checkpoint.save_contents, or set "
            "+actor_rollout_ref.rollout.custom.prorsa_follow_checkpoints=false and update "
            "prorsa's weights yourself (POST /update_weights)",
        )
    return CheckpointFollower(
        url,
        trainer.default_local_dir,
        admin_token=custom.get("prorsa_admin_token") or os.environ.get(TOKEN_ENV),
    )


def _token_output(**fields: Any) -> Any:
    try:
        from verl.workers.rollout.replica import TokenOutput
    except ImportError:
        return TokenOutputLike(**fields)
    return TokenOutput(**fields)


def prorsa_url(config: Any) -> str:
    """The server verl should use: ``rollout.custom.prorsa_url`` or ``$PRORSA_URL``."""
    custom = config.actor_rollout_ref.rollout.get("custom") or {}
    url = custom.get("prorsa_url") or os.environ.get(URL_ENV)
    if not url:
        raise ConfigError(
            "no prorsa server for verl",
            hint=f"set +actor_rollout_ref.rollout.custom.prorsa_url=http://HOST:PORT or ${URL_ENV}",
        )
    return url


def _check_trainer(config: Any, v1: bool) -> None:
    """The manager class must match verl's trainer: the PPO trainer's manager returns the
    batch, the V1 trainer's writes it to TransferQueue; the V1 trainer's async modes give
    their manager a client of their own (partial rollouts resumed across weight updates)
    that prorsa's would replace."""
    runs_v1 = bool(config.trainer.get("use_v1", False))
    if runs_v1 != v1:
        other = "ProrsaAgentLoopManagerTQ" if runs_v1 else "ProrsaAgentLoopManager"
        trainer = "V1 trainer (trainer.use_v1=true)" if runs_v1 else "PPO trainer (use_v1=false)"
        raise ConfigError(
            f"this config runs verl's {trainer}, whose agent loop manager is {other}",
            hint=f"set agent_loop_manager_class=prorsa.integrations.verl.{other}",
        )
    if not v1:
        return
    mode = (config.trainer.get("v1") or {}).get("trainer_mode", "sync")
    if mode != "sync":
        raise ConfigError(
            f"prorsa's verl V1 manager runs in trainer.v1.trainer_mode=sync, not {mode!r}: "
            "the async modes hand their manager a client that resumes partial rollouts "
            "across weight updates, which prorsa's client would replace",
            hint="set trainer.v1.trainer_mode=sync",
        )


class _ProrsaClientMixin:
    """What prorsa adds to both of verl's agent loop managers (kept apart so it is
    testable without verl): prorsa as the LLM client, and the follower that loads verl's
    saved weights into prorsa's engines (``prorsa_weights``)."""

    #: Whether this manager runs under verl's V1 trainer (TransferQueue).
    v1 = False

    def __init__(self, config: Any, llm_client: Any = None, *args: Any, **kwargs: Any):
        _check_trainer(config, self.v1)
        rollout = config.actor_rollout_ref.rollout
        if rollout.get("full_determinism", False):
            # verl then names every request det-{priority}, the same ids each step: one
            # step's trajectories would continue the last step's prorsa sessions.
            raise ConfigError(
                "prorsa keys its sessions by verl's request id, which "
                "rollout.full_determinism makes the same every step",
                hint="set actor_rollout_ref.rollout.full_determinism=false",
            )
        url = prorsa_url(config)
        client = ProrsaLLMClient(
            url,
            max_tokens=rollout.response_length,
            prompt_length=rollout.prompt_length,
            max_model_len=rollout.get("max_model_len"),
        )
        self.prorsa_weights = checkpoint_follower(config, url)
        super().__init__(config, client, *args, **kwargs)  # type: ignore[call-arg]


class ProrsaManagerMixin(_ProrsaClientMixin):
    """What prorsa adds to verl's ``AgentLoopManager``: the client, and before each step
    generates, the weights it generates from."""

    async def generate_sequences(self, prompts: Any) -> Any:
        """verl's ``generate_sequences`` (a coroutine, as verl's own is), after prorsa's
        engines load the weights this step generates from."""
        # verl updated its own replicas (and saved) since the last step: prorsa's engines
        # load the saved weights before any turn of this step. Validation runs after
        # step S saved and with global_steps = S: it scores step S's weights.
        if self.prorsa_weights is not None:
            meta = prompts.meta_info
            step = _generating_from(meta.get("global_steps"), meta.get("validate"))
            await asyncio.to_thread(self.prorsa_weights.sync, step)
        return await super().generate_sequences(prompts)  # type: ignore[misc]


def _generating_from(step: Any, validate: Any) -> int | None:
    """The step whose weights verl's step ``step`` generates from, plus one (what
    :meth:`CheckpointFollower.sync` takes). Validation runs after step S saved, with
    ``global_steps`` S: it scores step S's weights."""
    if step is None:
        return None
    return int(step) + 1 if validate else int(step)


class ProrsaManagerTQMixin(_ProrsaClientMixin):
    """What prorsa adds to verl's V1 ``AgentLoopManagerTQ``: the same client and weight
    loads. Its ``generate_sequences`` is plain (verl's V1 trainer calls it from plain code
    and ignores what it returns: the workers put each output into TransferQueue); the step
    and the validation flag come as the batch's non-tensor fields ``global_steps`` and
    ``validate``, read with verl's ``get_non_tensor_data``."""

    v1 = True
    #: verl's ``verl.utils.tensordict_utils.get_non_tensor_data`` (set by
    #: :func:`manager_class_tq`).
    _read_field: Any = None

    def generate_sequences(self, prompts: Any) -> Any:
        if self.prorsa_weights is not None:
            step = self._read_field(prompts, "global_steps", None)
            validate = self._read_field(prompts, "validate", False)
            self.prorsa_weights.sync(_generating_from(step, validate))
        return super().generate_sequences(prompts)  # type: ignore[misc]


def manager_class(base: type, auto_await: Any) -> type:
    """``base`` (verl's ``AgentLoopManager``) with :class:`ProrsaManagerMixin`, its
    ``generate_sequences`` wrapped in ``auto_await`` as verl wraps its own: awaited by the
    async trainers, run to completion by the synchronous PPO trainer."""

    class ProrsaAgentLoopManager(ProrsaManagerMixin, base):  # type: ignore[misc, valid-type]
        """verl's agent loop manager with prorsa as the LLM client."""

        generate_sequences = auto_await(ProrsaManagerMixin.generate_sequences)

    return ProrsaAgentLoopManager


def manager_class_tq(base: type, get_non_tensor_data: Any) -> type:
    """``base`` (verl's V1 ``AgentLoopManagerTQ``) with :class:`ProrsaManagerTQMixin`,
    reading the batch's fields with ``get_non_tensor_data`` (verl's, from
    ``verl.utils.tensordict_utils``). verl builds it through the inherited ``create``."""

    class ProrsaAgentLoopManagerTQ(ProrsaManagerTQMixin, base):  # type: ignore[misc, valid-type]
        """verl's V1 (TransferQueue) agent loop manager with prorsa as the LLM client."""

        _read_field = staticmethod(get_non_tensor_data)

    return ProrsaAgentLoopManagerTQ


@functools.cache
def _manager_class() -> type:
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.utils.ray_utils import auto_await

    return manager_class(AgentLoopManager, auto_await)


@functools.cache
def _manager_class_tq() -> type:
    # verl marks this path as moving once its V1 trainer is stable (agent_loop_tq.py).
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.utils.tensordict_utils import get_non_tensor_data

    return manager_class_tq(AgentLoopManagerTQ, get_non_tensor_data)


def __getattr__(name: str) -> Any:
    # verl loads the class by its dotted name; build it on first use so this module
    # imports without verl.
    if name == "ProrsaAgentLoopManager":
        return _manager_class()
    if name == "ProrsaAgentLoopManagerTQ":
        return _manager_class_tq()
    raise AttributeError(name)

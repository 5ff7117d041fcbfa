"""verl's saved checkpoints reach prorsa's engines: the follower its manager runs before
each step, over a real socket to a served app (fake engines), and its config checks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from prorsa.errors import ConfigError
from prorsa.integrations.verl import CheckpointFollower, checkpoint_follower
from tests.serve.helpers import fake_service, weights_folder

TOKEN = "s3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """The app over fake engines, served by uvicorn on a thread of its own."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.port = tmp_path, _free_port()
        self.ready, self.service, self.server = threading.Event(), None, None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        import uvicorn

        from prorsa.serve.app import create_app

        async with fake_service(self.tmp_path, admin_token=TOKEN) as (service, _fakes):
            self.service = service
            config = uvicorn.Config(
                create_app(service), host="127.0.0.1", port=self.port, log_level="warning"
            )
            self.server = uvicorn.Server(config)
            serving = asyncio.ensure_future(self.server.serve())
            while not self.server.started:
                await asyncio.sleep(0.01)
            self.ready.set()
            await serving

    def __enter__(self) -> Served:
        self.thread.start()
        assert self.ready.wait(30), "the app did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _save(root: Path, step: int) -> Path:
    """What verl's checkpoint manager leaves for a step saved with hf_model."""
    folder = root / f"global_step_{step}" / "actor"
    folder.mkdir(parents=True)
    return weights_folder(folder, "huggingface")


def test_each_step_loads_the_weights_verl_trains_from(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    root.mkdir()
    with Served(tmp_path) as served:
        url = f"http://127.0.0.1:{served.port}/v1"
        follower = CheckpointFollower(url, root, admin_token=TOKEN)
        assert follower.sync(1) is None  # the first step: nothing saved yet
        _save(root, 1)
        (root / "global_step_2" / "actor" / "huggingface").mkdir(parents=True)  # mid-save
        first = follower.sync(2)
        assert first["version"] == 1 and served.service.weight_version == 1
        assert follower.sync(2) is None and served.service.weight_version == 1
        with caplog.at_level(logging.WARNING, logger="prorsa.integrations.verl"):
            assert follower.sync(4) is None  # steps 2 and 3 were not saved
        assert "older weights" in caplog.text
        _save(root, 3)
        assert follower.sync(4)["version"] == 3 and served.service.weight_version == 3
        unauthorised = CheckpointFollower(url, root)
        _save(root, 4)
        with pytest.raises(RuntimeError, match="401"):
            unauthorised.sync(5)
        assert served.service.weight_version == 3


def _config(**overrides):
    trainer = {"save_freq": 1, "default_local_dir": "/ckpt", **overrides.pop("trainer", {})}
    contents = overrides.pop("save_contents", ["model", "optimizer", "extra", "hf_model"])
    custom = overrides.pop("custom", {})
    return SimpleNamespace(
        trainer=Node(trainer),
        actor_rollout_ref=SimpleNamespace(
            rollout=Node({"custom": custom}),
            actor=SimpleNamespace(checkpoint=Node({"save_contents": contents})),
        ),
    )


class Node(dict):
    """A dict read as attributes too, as verl's config nodes are."""

    __getattr__ = dict.__getitem__


def test_a_relative_checkpoint_folder_is_sent_absolute(tmp_path, monkeypatch):
    # Found by review: verl's default folder is relative; the server would resolve it
    # against its own working directory.
    monkeypatch.chdir(tmp_path)
    follower = CheckpointFollower("http://prorsa", "checkpoints/project/run")
    assert follower.checkpoint_dir == tmp_path / "checkpoints" / "project" / "run"


def test_the_manager_config_must_save_what_the_follower_reads(monkeypatch):
    monkeypatch.setenv("PRORSA_ADMIN_TOKEN", "from-env")
    follower = checkpoint_follower(_config(), "http://prorsa:8000")
    assert follower.checkpoint_dir == Path("/ckpt").resolve()
    assert follower.admin_token == "from-env"
    with pytest.raises(ConfigError, match="save_freq=2"):
        checkpoint_follower(_config(trainer={"save_freq": 2}), "http://prorsa")
    with pytest.raises(ConfigError, match=r"save_contents=\['model'\]"):
        checkpoint_follower(_config(save_contents=["model"]), "http://prorsa")
    off = _config(save_contents=["model"], custom={"prorsa_follow_checkpoints": False})
    assert checkpoint_follower(off, "http://prorsa") is None


def _auto_await(func):
    """What verl 0.9.1's ``auto_await`` (verl/utils/ray_utils.py) does: run the coroutine
    where no loop runs; hand it back to a coroutine that calls it; from plain code inside
    a running loop, run it to completion on a thread of its own."""

    def wrapper(*args, **kwargs):
        coro = func(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        caller = inspect.currentframe().f_back
        if caller is not None and caller.f_code.co_flags & inspect.CO_COROUTINE:
            return coro
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, coro).result()

    return wrapper


def _manager(tmp_path, monkeypatch, calls, **config_overrides):
    # verl's AgentLoopManager does not install here: the mixin over a stand-in base that
    # records what verl's would receive (its generate_sequences a coroutine, as verl's).
    from prorsa.integrations.verl import manager_class

    class VerlManager:  # the parts of verl's AgentLoopManager the mixin relies on
        def __init__(self, config, llm_client, *args, **kwargs):
            self.llm_client = llm_client

        @_auto_await
        async def generate_sequences(self, prompts):
            calls.append(("generate", prompts.meta_info["global_steps"]))
            return "batch"

    monkeypatch.setenv("PRORSA_URL", "http://prorsa:8000")
    trainer = {"default_local_dir": str(tmp_path), **config_overrides.pop("trainer", {})}
    config = _config(trainer=trainer, **config_overrides)
    config.actor_rollout_ref.rollout.update(response_length=64, prompt_length=32)
    manager = manager_class(VerlManager, _auto_await)(config)
    if manager.prorsa_weights is not None:
        monkeypatch.setattr(
            manager.prorsa_weights, "sync", lambda step: calls.append(("sync", step))
        )
    return manager


def test_the_manager_loads_the_weights_before_its_step_generates(tmp_path, monkeypatch):
    calls = []
    manager = _manager(tmp_path, monkeypatch, calls)
    batch = SimpleNamespace(meta_info={"global_steps": 3})
    # verl's PPO trainer calls it from plain code, the one-step-off trainer awaits it.
    assert manager.generate_sequences(batch) == "batch"

    async def awaited():
        return await manager.generate_sequences(batch)

    assert asyncio.run(awaited()) == "batch"

    async def called_from_plain_code_in_a_loop():
        return (lambda: manager.generate_sequences(batch))()

    assert asyncio.run(called_from_plain_code_in_a_loop()) == "batch"
    assert calls == [("sync", 3), ("generate", 3)] * 3  # the weights first, then the step
    assert manager.llm_client.url == "http://prorsa:8000" and manager.llm_client.max_tokens == 64


def test_validation_scores_the_step_just_saved(tmp_path, monkeypatch):
    # Found by review: verl validates after step S saved and updated its own replicas,
    # with global_steps = S; loading only below S scored step S - 1's weights.
    calls = []
    manager = _manager(tmp_path, monkeypatch, calls)
    manager.generate_sequences(SimpleNamespace(meta_info={"global_steps": 3, "validate": True}))
    assert calls == [("sync", 4), ("generate", 3)]


def test_repeated_request_ids_are_refused(tmp_path, monkeypatch):
    # full_determinism names requests det-{priority}: every step's ids collide.
    config = _config()
    config.actor_rollout_ref.rollout.update(full_determinism=True)
    from prorsa.integrations.verl import ProrsaManagerMixin

    with pytest.raises(ConfigError, match="full_determinism"):
        ProrsaManagerMixin(config)


def test_megatron_checkpoints_are_followed_and_a_missing_folder_is_named(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    folder = root / "global_step_2" / "actor" / "model"
    folder.mkdir(parents=True)
    weights_folder(folder, "huggingface")  # where verl's Megatron manager saves
    follower = CheckpointFollower("http://prorsa", root)
    assert follower.newest_below(3) == (2, folder / "huggingface")
    empty = CheckpointFollower("http://prorsa", tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="prorsa.integrations.verl"):
        assert empty.sync(3) is None
    assert "no saved Hugging Face weights" in caplog.text


class _NonTensor:
    """What a TensorDict holds for a non-tensor field (verl's ``NonTensorData``)."""

    def __init__(self, data):
        self.data = data


def _read_field(batch, key, default):
    """verl 0.9.1's ``get_non_tensor_data`` (verl/utils/tensordict_utils.py) on a dict."""
    return batch[key].data if key in batch else default


def _manager_tq(tmp_path, monkeypatch, calls, **config_overrides):
    # verl's V1 AgentLoopManagerTQ does not install here (TransferQueue and verl's pins):
    # a stand-in with the parts the V1 trainer uses, built as verl builds it, through the
    # inherited classmethod ``create`` with keywords (verl/trainer/main_ppo.py).
    from prorsa.integrations.verl import manager_class_tq

    class VerlManagerTQ:
        def __init__(
            self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None
        ):
            self.llm_client, self.teacher_client = llm_client, teacher_client
            self.reward_loop_worker_handles = reward_loop_worker_handles

        @classmethod
        def create(cls, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
            return cls(
                config=config,
                llm_client=llm_client,
                teacher_client=teacher_client,
                reward_loop_worker_handles=reward_loop_worker_handles,
            )

        def generate_sequences(self, prompts):  # workers write to TransferQueue: no return
            calls.append(("generate", _read_field(prompts, "global_steps", None)))

    monkeypatch.setenv("PRORSA_URL", "http://prorsa:8000")
    trainer = {"default_local_dir": str(tmp_path), "use_v1": True,
               **config_overrides.pop("trainer", {})}  # fmt: skip
    config = _config(trainer=trainer, **config_overrides)
    config.actor_rollout_ref.rollout.update(response_length=64, prompt_length=32)
    manager = manager_class_tq(VerlManagerTQ, _read_field).create(
        config=config, llm_client="verl's own client", teacher_client="teacher",
        reward_loop_worker_handles=["reward"],
    )  # fmt: skip
    monkeypatch.setattr(manager.prorsa_weights, "sync", lambda step: calls.append(("sync", step)))
    return manager


def test_the_v1_manager_loads_the_weights_before_its_step_generates(tmp_path, monkeypatch):
    calls = []
    manager = _manager_tq(tmp_path, monkeypatch, calls)
    assert manager.llm_client.url == "http://prorsa:8000" and manager.llm_client.max_tokens == 64
    assert manager.teacher_client == "teacher" and manager.reward_loop_worker_handles == ["reward"]
    assert manager.generate_sequences({"global_steps": _NonTensor(3)}) is None
    # validation after step 3 saved scores step 3's weights
    manager.generate_sequences({"global_steps": _NonTensor(3), "validate": _NonTensor(True)})
    assert calls == [("sync", 3), ("generate", 3), ("sync", 4), ("generate", 3)]


def test_each_manager_refuses_the_other_trainer_and_v1_async_modes(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"runs verl's PPO trainer"):
        _manager_tq(tmp_path, monkeypatch, [], trainer={"use_v1": False})
    with pytest.raises(ConfigError, match=r"runs verl's V1 trainer.*ProrsaAgentLoopManagerTQ"):
        _manager(tmp_path, monkeypatch, [], trainer={"use_v1": True})
    # the async modes hand their manager a client that resumes partial rollouts
    for mode in ("colocate_async", "separate_async"):
        with pytest.raises(ConfigError, match="trainer_mode=sync"):
            _manager_tq(tmp_path, monkeypatch, [], trainer={"v1": {"trainer_mode": mode}})
    _manager_tq(tmp_path, monkeypatch, [], trainer={"v1": {"trainer_mode": "sync"}})


def test_the_managers_are_built_on_first_use():
    import prorsa.integrations.verl as module

    with pytest.raises(ModuleNotFoundError, match="verl"):  # verl is not installed here
        module.ProrsaAgentLoopManagerTQ  # noqa: B018
    with pytest.raises(AttributeError):
        module.ProrsaAgentLoopManagerV2  # noqa: B018

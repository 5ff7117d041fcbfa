"""verl's saved checkpoints reach prorsa's engines: the follower its manager runs before
each step, over a real socket to a served app (fake engines), and its config checks."""

from __future__ import annotations

import asyncio
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


def test_the_manager_loads_the_weights_before_its_step_generates(tmp_path, monkeypatch):
    # verl's AgentLoopManager does not install here: the mixin over a stand-in base that
    # records what verl's would receive.
    from prorsa.integrations.verl import ProrsaManagerMixin

    class VerlManager:  # the parts of verl's AgentLoopManager the mixin relies on
        def __init__(self, config, llm_client, *args, **kwargs):
            self.llm_client = llm_client

        def generate_sequences(self, prompts):
            calls.append(("generate", prompts.meta_info["global_steps"]))
            return "batch"

    class Manager(ProrsaManagerMixin, VerlManager):
        pass

    monkeypatch.setenv("PRORSA_URL", "http://prorsa:8000")
    config = _config(trainer={"default_local_dir": str(tmp_path)})
    config.actor_rollout_ref.rollout.update(response_length=64, prompt_length=32)
    calls = []
    manager = Manager(config)
    monkeypatch.setattr(manager.prorsa_weights, "sync", lambda step: calls.append(("sync", step)))
    batch = SimpleNamespace(meta_info={"global_steps": 3})
    assert manager.generate_sequences(batch) == "batch"
    assert calls == [("sync", 3), ("generate", 3)]  # the weights first, then the step
    assert manager.llm_client.url == "http://prorsa:8000" and manager.llm_client.max_tokens == 64

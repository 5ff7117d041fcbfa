"""A started rollout service over fake engines, for tests that run in one event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prorsa.serve.config import ServeConfig
from prorsa.serve.service import RolloutService
from tests.serve.fakes import FakeFleet, WeightedFakeEngine


def model_folder(tmp_path: Path) -> Path:
    """A folder that passes for a model with weights (config.json + a weight file)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["Fake"], "vocab_size": 512}')
    (folder / "model.safetensors").write_bytes(b"fake")
    return folder


def weights_folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["Fake"], "vocab_size": 512}')
    (folder / "model.safetensors").write_bytes(name.encode())
    return folder


@contextlib.asynccontextmanager
async def fake_service(
    tmp_path: Path,
    engines: int = 3,
    *,
    step_s: float = 0.002,
    policy: str = "static",
    policy_params: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[tuple[RolloutService, list[WeightedFakeEngine]]]:
    """A service over ``engines`` fakes (static: one prefill engine, the rest decode)."""
    fakes = [WeightedFakeEngine(i, step_s=step_s) for i in range(engines)]
    fleet = FakeFleet(fakes, ["colocated"] * engines)
    params = {"prefill_gpus": 1} if policy == "static" and policy_params is None else {}
    settings = {"monitor_interval_s": 0.05, "session_idle_s": 60.0, **config}
    service = RolloutService(
        ServeConfig(
            model=str(model_folder(tmp_path)),
            engines=engines,
            policy=policy,
            policy_params=policy_params if policy_params is not None else params,
            **settings,
        ),
        fleet=fleet,
    )
    service.let_go_of_read_events = False  # tests read the whole log, however long they run
    await service.start()
    try:
        yield service, fakes
    finally:
        await service.shutdown()

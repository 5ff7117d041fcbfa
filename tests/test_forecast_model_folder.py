"""Damaged forecaster folders: every variant is one InputError naming file and field."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from prorsa.errors import InputError
from prorsa.forecast import load_forecaster
from prorsa.forecast.lgbm import BOOSTERS_FORMAT
from tests.conftest import REPO

MODELS = REPO / "models"


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder: Path, manifest: object) -> None:
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        manifest = _manifest(folder)
        change(manifest)
        _write_manifest(folder, manifest)

    return apply


def _boosters(folder: Path) -> Path:
    return folder / "boosters.json.gz"


def _rewrite_boosters(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        with gzip.open(_boosters(folder), "rt") as f:
            payload = json.load(f)
        if "models" not in payload:  # a file of the first format: as it is saved today
            digests = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in payload.items()}
            payload = {"format": BOOSTERS_FORMAT, "models": payload, "sha256": digests}
        _boosters(folder).write_bytes(gzip.compress(json.dumps(change(payload)).encode()))

    return apply


def _truncate(name: str, keep: float = 0.5) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])

    return apply


def _cut_model_string(payload: dict) -> dict:
    key = next(iter(payload["models"]))
    payload["models"][key] = payload["models"][key][:5000]
    del payload["sha256"]  # no digest to catch it: the structure check must
    payload["format"] = "old"
    return payload["models"]


def _flip_model_string(payload: dict) -> dict:
    key = next(iter(payload["models"]))
    text = payload["models"][key]
    payload["models"][key] = text[:3000] + ("7" if text[3000] != "7" else "8") + text[3001:]
    return payload


def _del(path: str) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        node = manifest
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        del node[leaf]

    return change


def _set(path: str, value: object) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        node = manifest
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value

    return change


# (id, damage, text the error must contain) — shared by every model kind.
COMMON = [
    ("folder-missing", lambda f: shutil.rmtree(f), "no such model folder"),
    ("folder-is-a-file", lambda f: (shutil.rmtree(f), f.write_text("x")), "not a file"),
    ("manifest-missing", lambda f: (f / "manifest.json").unlink(), "no manifest.json"),
    (
        "manifest-is-a-folder",
        lambda f: ((f / "manifest.json").unlink(), (f / "manifest.json").mkdir()),
        "no manifest.json",
    ),
    ("manifest-empty", lambda f: (f / "manifest.json").write_text(""), "empty"),
    ("manifest-truncated", _truncate("manifest.json", 0.4), "unreadable manifest"),
    ("manifest-not-utf8", lambda f: (f / "manifest.json").write_bytes(b"\xff\xfe{"), "cannot read"),
    ("manifest-a-list", lambda f: _write_manifest(f, [1, 2]), "(top level)"),
    ("format-wrong", _edit(_set("format", "prorsa-forecaster/9")), "format"),
    ("name-unknown", _edit(_set("name", "prophet")), "name"),
    ("name-not-string", _edit(_set("name", 7)), "name"),
    ("params-unknown-key", _edit(_set("params.colour", "red")), "params.colour"),
    ("params-wrong-type", _edit(_set("params.seed", "zero")), "params.seed"),
    ("fitted-missing", _edit(_del("fitted")), "fitted"),
    ("horizons-string", _edit(_set("fitted.horizons", "1,5")), "fitted.horizons"),
    ("horizons-negative", _edit(_set("fitted.horizons", [1, -5])), "fitted.horizons"),
    ("lags-empty", _edit(_set("fitted.lags", [])), "fitted.lags"),
    ("tasks-not-strings", _edit(_set("fitted.tasks", [1, 2])), "fitted.tasks"),
    ("tick-zero", _edit(_set("fitted.tick_s", 0)), "fitted.tick_s"),
    ("state-not-object", _edit(_set("state", [])), "state"),
]
LIGHTGBM = [
    ("boosters-entry-missing", _edit(_del("state.boosters")), "state.boosters"),
    ("boosters-path-escapes", _edit(_set("state.boosters", "../x.gz")), "state.boosters"),
    ("boosters-file-missing", lambda f: _boosters(f).unlink(), "model file missing"),
    ("boosters-truncated", _truncate("boosters.json.gz"), "truncated gzip"),
    ("boosters-garbage", lambda f: _boosters(f).write_bytes(b"not gzip at all"), "gzip"),
    ("boosters-not-json", lambda f: _boosters(f).write_bytes(gzip.compress(b"{oops")), "JSON"),
    ("boosters-a-list", _rewrite_boosters(lambda p: [1, 2]), "model strings"),
    ("model-string-cut", _rewrite_boosters(_cut_model_string), "truncated or damaged"),
    ("model-string-edited", _rewrite_boosters(_flip_model_string), "digest"),
    (
        "model-removed",
        _rewrite_boosters(lambda p: {**p, "models": dict(list(p["models"].items())[:-1])}),
        "missing",
    ),
]
TRAJECTORY = [
    ("spread-not-object", _edit(_set("state.spread", 3)), "state.spread"),
    ("spread-not-numbers", _edit(_set("state.spread.output", ["a"])), "state.spread.output"),
    ("default-key-missing", _edit(_del("state.default.output")), "state.default.output"),
    (
        "calibration-features-unknown",
        _edit(_set("state.calibration_features", ["x"])),
        "calibration_features",
    ),
]
GRU = [
    ("weights-entry-missing", _edit(_del("state.weights")), "state.weights"),
    ("weights-missing", lambda f: (f / "gru.npz").unlink(), "model file missing"),
    ("weights-truncated", _truncate("gru.npz"), "damaged or truncated"),
    ("weights-garbage", lambda f: (f / "gru.npz").write_bytes(b"PK\x03\x04junk"), "damaged"),
    ("weights-array-missing", lambda f: np.savez(f / "gru.npz", x_mean=np.zeros(3)), "missing"),
    ("hidden-changed", _edit(_set("params.hidden", 8)), "do not fit"),
]
# Fewer tasks change the width of the aggregate features (not of the per-turn rows).
WIDTH = [("tasks-changed", _edit(_set("fitted.tasks", ["only-one"])), "input features")]
CASES = (
    [("lightgbm-aggregate", *c) for c in COMMON + LIGHTGBM + WIDTH]
    + [("lightgbm-trajectory", *c) for c in COMMON + LIGHTGBM + TRAJECTORY]
    + [("gru", *c) for c in COMMON + GRU + WIDTH]
)


@pytest.mark.parametrize(
    ("model", "case", "damage", "expected"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES]
)
def test_damaged_folder_gives_one_input_error(tmp_path, model, case, damage, expected):
    folder = tmp_path / model
    shutil.copytree(MODELS / model, folder)
    # Without the file digests (as in folders saved before them), so that each reader's
    # own checks are what meets the damage (the digests are tested below).
    _edit(_del("files"))(folder)
    damage(folder)
    with pytest.raises(InputError) as err:
        load_forecaster(folder)
    message = str(err.value)
    assert expected in message, message
    assert str(tmp_path) in message  # names the folder or the file in it


def test_cli_reports_a_truncated_booster_file_in_one_line(tmp_path):
    from prorsa.cli.main import app

    folder = tmp_path / "lightgbm-aggregate"
    shutil.copytree(MODELS / "lightgbm-aggregate", folder)
    _truncate("boosters.json.gz")(folder)
    result = CliRunner().invoke(
        app, ["forecast", "backtest", "--model", str(folder), "--telemetry", str(folder)]
    )
    assert result.exit_code == 1, result.output
    assert "Aborted" not in result.output and "Traceback" not in result.output
    assert "boosters.json.gz" in result.output and "truncated" in result.output


@pytest.fixture(scope="module")
def small_model():
    """A freshly fitted lightgbm-aggregate (its folder lists its files' digests)."""
    from prorsa.forecast import build_dataset, make_forecaster
    from tests.sim_helpers import random_specs, run

    table = run(random_specs(40, seed=1, turns=(2, 4)), "static", slots=2).telemetry
    model = make_forecaster("lightgbm-aggregate", horizons=[5], n_estimators=5)
    return model.fit(build_dataset([table], horizons=[5]))


def test_save_lists_file_digests_and_keeps_other_files(tmp_path, small_model):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    small_model.save(folder, extra={"recipe": {"why": "test"}})
    manifest = _manifest(folder)
    digest = hashlib.sha256((folder / "boosters.json.gz").read_bytes()).hexdigest()
    assert manifest["files"] == {"boosters.json.gz": digest}
    assert manifest["recipe"] == {"why": "test"}
    assert (folder / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in folder.iterdir()) == [
        "boosters.json.gz",
        "manifest.json",
        "notes.txt",
    ]  # no staging folder left behind
    load_forecaster(folder)


def test_weights_from_another_save_are_named_not_loaded(tmp_path, small_model):
    """A save cut short after moving its weights in leaves the old manifest beside new
    weights (and copying files between model folders does the same): refused, named."""
    old = small_model.save(tmp_path / "old")
    shutil.copy(MODELS / "lightgbm-aggregate" / "boosters.json.gz", old / "boosters.json.gz")
    with pytest.raises(InputError) as err:
        load_forecaster(old)
    assert "files.boosters.json.gz" in str(err.value)
    assert "does not match" in str(err.value)


def test_a_save_cut_short_leaves_no_manifest_to_load(tmp_path, small_model, monkeypatch):
    import prorsa.forecast.base as base

    folder = small_model.save(tmp_path / "m")
    before = (folder / "manifest.json").read_bytes()

    def full_disk(path, text):
        raise OSError("no space left on device")

    monkeypatch.setattr(base, "atomic_write_text", full_disk)
    with pytest.raises(OSError):
        small_model.save(folder, metrics={"changed": 1.0})
    # no manifest is better than the old one beside weights it may not describe
    assert not (folder / "manifest.json").exists() and before
    with pytest.raises(InputError, match=r"no manifest\.json"):
        load_forecaster(folder)


@pytest.mark.parametrize(
    ("model", "file"),
    [("lightgbm-trajectory", "boosters.json.gz"), ("lightgbm-aggregate", "boosters.json.gz"),
     ("gru", "gru.npz")],
)  # fmt: skip
def test_shipped_models_list_their_files_and_any_damage_is_named(tmp_path, model, file):
    folder = tmp_path / model
    shutil.copytree(MODELS / model, folder)
    digest = hashlib.sha256((folder / file).read_bytes()).hexdigest()
    assert _manifest(folder)["files"][file] == digest
    load_forecaster(folder)
    _truncate(file)(folder)
    with pytest.raises(InputError) as err:
        load_forecaster(folder)
    assert f"files.{file}" in str(err.value) and "does not match" in str(err.value)

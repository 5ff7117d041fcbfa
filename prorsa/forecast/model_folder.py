"""Reading a saved forecaster folder defensively: every fault is one clear InputError.

A model folder is ``manifest.json`` plus the files its forecaster wrote. Folders get
copied, truncated, hand-edited and mixed between versions, so nothing read from one is
trusted: the manifest's structure and types are checked field by field here (the error
names the file and the field, e.g. ``fitted.horizons``), and the model files are opened
through helpers that turn truncation, garbage and missing pieces into the same kind of
error instead of whatever the decompressor or the model library happens to raise.
"""

from __future__ import annotations

import gzip
import json
import math
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from prorsa.errors import InputError
from prorsa.io import file_sha256

MANIFEST = "manifest.json"
FORMAT = "prorsa-forecaster/1"
_HINT = "regenerate it (`prorsa forecast ship` rebuilds the shipped models) or retrain it"


def read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the model folder ``path``."""
    if not path.exists():
        raise InputError("no such model folder", source=str(path))
    if not path.is_dir():
        raise InputError(
            "a model is a folder with a manifest.json, not a file",
            source=str(path),
            hint="give the folder that holds manifest.json",
        )
    file = path / MANIFEST
    if not file.is_file():
        raise InputError(
            f"no {MANIFEST} in {path}", source=str(path), hint="is this a saved model folder?"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the manifest: {exc}", source=str(file)) from None
    if not text.strip():
        raise InputError("the manifest is empty", source=str(file), hint=_HINT)
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"unreadable manifest: {exc}", source=str(file), hint=_HINT) from None
    src = str(file)
    _expect(manifest, dict, src, "(top level)", "a JSON object")
    if manifest.get("format") != FORMAT:
        raise InputError(
            f"unknown model format {manifest.get('format')!r} (expected {FORMAT!r})",
            source=src,
            field="format",
            hint=_HINT,
        )
    _expect(manifest.get("name"), str, src, "name", "a forecaster name")
    _expect(manifest.get("params", {}), dict, src, "params", "an object of parameters")
    fitted = manifest.get("fitted")
    _expect(fitted, dict, src, "fitted", "an object")
    for key in ("horizons", "lags"):
        values = fitted.get(key)
        _expect(values, list, src, f"fitted.{key}", "a list of seconds")
        if not values or not all(_positive_number(v) for v in values):
            raise InputError(
                f"must be a non-empty list of positive seconds, got {values!r}",
                source=src,
                field=f"fitted.{key}",
                hint=_HINT,
            )
    tasks = fitted.get("tasks")
    _expect(tasks, list, src, "fitted.tasks", "a list of task names")
    if not all(isinstance(t, str) for t in tasks):
        raise InputError("must hold task names (strings)", source=src, field="fitted.tasks")
    if not _positive_number(fitted.get("tick_s")):
        raise InputError(
            f"must be positive seconds, got {fitted.get('tick_s')!r}",
            source=src,
            field="fitted.tick_s",
            hint=_HINT,
        )
    ranges = fitted.get("feature_ranges", {})
    _expect(ranges, dict, src, "fitted.feature_ranges", "an object")
    for name, bounds in ranges.items():
        if (
            not isinstance(bounds, list)
            or len(bounds) != 2
            or not all(isinstance(b, int | float) and math.isfinite(b) for b in bounds)
        ):
            raise InputError(
                f"must be [low, high], got {bounds!r}",
                source=src,
                field=f"fitted.feature_ranges.{name}",
            )
    _expect(manifest.get("state", {}), dict, src, "state", "an object")
    _expect(manifest.get("metrics", {}), dict, src, "metrics", "an object")
    data_hash = manifest.get("data_hash")
    if data_hash is not None:
        _expect(data_hash, str, src, "data_hash", "a string")
    return manifest


def check_files(manifest: dict[str, Any], path: Path) -> None:
    """Each model file the manifest's ``files`` lists has the SHA-256 it states: a save cut
    short, or files copied in from another model, are named here instead of loading a
    model whose weights belong to another manifest. (Folders saved before ``files``
    existed have none to check.)"""
    files = manifest.get("files", {})
    src = str(path / MANIFEST)
    _expect(files, dict, src, "files", "an object of file name -> SHA-256")
    for name, digest in files.items():
        if isinstance(name, str) and Path(name).name == name and (path / name).is_dir():
            file = path / name  # a member's model folder: its manifest pins its own files
        else:
            file = model_file(path, name, field=f"files.{name}")
        if not isinstance(digest, str) or entry_sha256(file) != digest:
            raise InputError(
                f"{name} does not match the manifest's SHA-256: its save was cut short, or "
                "it comes from another model",
                source=str(file),
                field=f"files.{name}",
                hint=_HINT,
            )


def entry_sha256(entry: Path) -> str:
    """The SHA-256 a manifest records for one entry of a model folder: a file's own, or
    for a member's model folder its manifest's (which records its files' in turn)."""
    if entry.is_dir():
        manifest = entry / MANIFEST
        if not manifest.is_file():
            raise InputError(f"no {MANIFEST} in the member folder", source=str(entry), hint=_HINT)
        return file_sha256(manifest)
    return file_sha256(entry)


def state_field(state: dict, key: str, kind: type | tuple[type, ...], *, source: Path) -> Any:
    """``state[key]`` checked to be of ``kind`` (the error names ``state.<key>``)."""
    if key not in state:
        raise InputError("missing", source=str(source / MANIFEST), field=f"state.{key}")
    value = state[key]
    _expect(value, kind, str(source / MANIFEST), f"state.{key}", _describe(kind))
    return value


def positive_state_field(state: dict, key: str, *, source: Path) -> float:
    """``state[key]`` as a finite number > 0 (the error names ``state.<key>``)."""
    value = state_field(state, key, (int, float), source=source)
    if not _positive_number(value):
        raise InputError(
            f"must be a finite number > 0, got {value!r}",
            source=str(source / MANIFEST),
            field=f"state.{key}",
        )
    return float(value)


def model_file(path: Path, name: object, *, field: str) -> Path:
    """The model file ``name`` (from the manifest's ``field``) inside the folder ``path``."""
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise InputError(
            f"must be a file name inside the model folder, got {name!r}",
            source=str(path / MANIFEST),
            field=field,
        )
    file = path / name
    if not file.is_file():
        raise InputError("model file missing", source=str(file), hint=_HINT)
    return file


def read_gzip_json(file: Path) -> Any:
    """JSON from a gzip file; truncation and garbage become an InputError naming it."""
    try:
        with gzip.open(file, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as exc:
        raise InputError(
            f"damaged or truncated gzip file ({type(exc).__name__}: {exc})",
            source=str(file),
            hint=_HINT,
        ) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON inside: {exc}", source=str(file), hint=_HINT) from None


def read_npz(file: Path, required: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, loaded now (so damage shows here, named)."""
    try:
        with np.load(file, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as exc:
        raise InputError(
            f"damaged or truncated array file ({type(exc).__name__}: {exc})",
            source=str(file),
            hint=_HINT,
        ) from None
    missing = [k for k in required if k not in arrays]
    if missing:
        raise InputError(
            f"array(s) {', '.join(missing)} missing", source=str(file), field=missing[0], hint=_HINT
        )
    return arrays


def _expect(value: Any, kind: type | tuple[type, ...], source: str, field: str, what: str) -> None:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InputError(
            f"must be {what}, got {type(value).__name__} {_short(value)}",
            source=source,
            field=field,
            hint=_HINT,
        )


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _describe(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""Checks on a saved weight folder, before any engine is asked to load it.

A trainer hands the engines a folder written by ``save_pretrained``. Loading a folder that
is missing, empty or of another architecture would fail inside vLLM's worker with a long
traceback — or, worse, on some engines only, leaving the fleet with mixed weights — so the
folder is checked once, up front, with an error that names it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prorsa.errors import InputError

WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".pt")


def check_weight_dir(path: str, model_dir: str | None = None) -> Path:
    """The folder as a resolved path, once it holds weights the serving model can take.

    Args:
        path: folder from ``save_pretrained`` (config.json plus weight files).
        model_dir: the folder the engines started from; when given, both configs must
            name the same architectures, hidden size, layer count and vocabulary.

    Raises:
        InputError: the folder is missing, has no weight files, or does not match.
    """
    folder = Path(path).expanduser()
    where = {"source": str(folder), "field": "weight_dir"}
    if not folder.is_dir():
        raise InputError(
            "weight folder does not exist",
            hint="pass a folder written by save_pretrained, visible to every engine",
            **where,
        )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
        raise InputError(
            f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in the folder",
            hint="save the model with save_pretrained(dir) before updating",
            **where,
        )
    if model_dir is not None:
        _check_same_shape(folder, Path(model_dir))
    return folder.resolve()


_SHAPE_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")


def _check_same_shape(folder: Path, model_dir: Path) -> None:
    new, old = _config(folder), _config(model_dir)
    if new is None or old is None:
        return  # nothing to compare; vLLM's loader checks tensor shapes anyway
    for key in _SHAPE_KEYS:
        if key in old and new.get(key) != old[key]:
            raise InputError(
                f"config.json {key} is {new.get(key)!r}; the serving model has {old[key]!r}",
                source=str(folder),
                field=key,
                hint="weights must come from the model the engines serve",
            )


def _config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def clear_folder(folder: str | Path) -> int:
    """Delete everything inside ``folder`` (kept itself); returns entries removed.

    The ``example`` KV connector keeps prompt KV as files keyed by token hashes, with no
    notion of weights: after a weight update those files would be served as cache hits.
    """
    root = Path(folder)
    removed = 0
    if not root.is_dir():
        return 0
    for entry in root.iterdir():
        try:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed += 1
        except FileNotFoundError:  # another engine cleared it first
            continue
    return removed

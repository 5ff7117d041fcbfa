"""Parameters checked where they enter: policy parameters, control intervals, counts and
storage URLs.

Every check raises :class:`~prorsa.errors.ConfigError` naming the parameter, the value and
what would be accepted, so a typo fails at once instead of being ignored (an unknown
policy parameter), running forever (``--interval-s 1e-9``) or quietly changing the result
(``--interval-s nan``).

Policy parameters are checked against the policy's ``__init__`` signature: a policy
declares its parameters there, with types, as scikit-learn estimators do, so no second
list can drift from the code.
"""

from __future__ import annotations

import difflib
import inspect
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from prorsa.errors import ConfigError

#: Shortest accepted control interval (seconds). The fastest decode step in the shipped
#: profiles is ~4.3 ms (Qwen2.5-7B, batch 1, 2k context, on one H200: the reference table
#: in shared/data/README.md); a tick shorter than about two steps cannot see the batch
#: change, and real planners decide every few seconds (Dynamo's loop: 5 s). 10 ms keeps a
#: mistyped value from making a simulation take a billion ticks.
MIN_INTERVAL_S = 0.01

#: SQLAlchemy dialects Optuna can store studies in (``dialect[+driver]://...``).
STUDY_STORAGE_SCHEMES = frozenset({"sqlite", "postgresql", "mysql", "oracle", "mssql"})
#: MLflow tracking URI schemes (a plain path is a local file store).
TRACKING_SCHEMES = frozenset(
    {"file", "http", "https", "databricks", "sqlite", "postgresql", "mysql", "mssql"}
)


# ------------------------------------------------------------------ policy parameters
def policy_parameters(name: str) -> dict[str, Any]:
    """The parameters policy ``name`` declares, each with its (resolved) type annotation."""
    cls = _policy_class(name)
    hints = typing.get_type_hints(cls.__init__)
    params = {}
    for param in inspect.signature(cls.__init__).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        params[param.name] = hints.get(param.name, Any)
    return params


def check_policy_params(name: str, params: Mapping[str, object]) -> dict[str, object]:
    """Check ``params`` for policy ``name``; return them with ints widened to floats
    where the parameter is a float.

    Raises:
        ConfigError: an unknown policy, an unknown parameter (with the closest name and
            the full list) or a value of the wrong type (naming the type expected).
    """
    declared = policy_parameters(name)
    checked: dict[str, object] = {}
    for key, value in params.items():
        if key not in declared:
            raise ConfigError(
                f"policy '{name}' has no parameter '{key}'",
                hint=(
                    _did_you_mean(key, declared) + f"its parameters: {', '.join(declared)}"
                    if declared
                    else f"'{name}' takes no parameters"
                ),
            )
        checked[key] = _coerce(f"{name}.{key}", value, declared[key])
    return checked


def check_policy_param_groups(
    groups: Mapping[str, Mapping[str, object]], *, policies: Iterable[str] | None = None
) -> dict[str, dict[str, object]]:
    """Check ``{policy: {key: value}}`` (from ``--param policy.key=value``).

    A policy name that is not registered, or (when ``policies`` is given) not among the
    policies being run, is an error: otherwise a typo such as ``statc.prefill_gpus=4``
    would be silently ignored.
    """
    from prorsa.policy import POLICIES

    running = list(policies) if policies is not None else None
    checked = {}
    for name, params in groups.items():
        if name not in POLICIES:
            raise ConfigError(
                f"--param names policy '{name}', which does not exist",
                hint=_did_you_mean(name, POLICIES.names())
                + f"policies: {', '.join(POLICIES.names())}",
            )
        if running is not None and name not in running:
            raise ConfigError(
                f"--param names policy '{name}', which is not among the policies run "
                f"({', '.join(running)})",
                hint="add it to the policies or drop the parameter",
            )
        checked[name] = check_policy_params(name, params)
    return checked


# -------------------------------------------------------------------- plain numbers
def check_interval_s(
    value: object, name: str = "interval_s", *, minimum: float = MIN_INTERVAL_S
) -> float:
    """A finite interval in seconds, at least ``minimum`` (see :data:`MIN_INTERVAL_S`)."""
    number = _finite(name, value)
    if number < minimum:
        raise ConfigError(
            f"{name} must be at least {minimum:g} s, got {value!r}",
            hint=f"control intervals below {minimum:g} s see no new state and only add ticks",
        )
    return number


def check_positive(value: object, name: str, *, allow_zero: bool = False) -> float:
    """A finite number > 0 (or >= 0 with ``allow_zero``)."""
    number = _finite(name, value)
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return number


def check_count(value: object, name: str, *, minimum: int = 1) -> int:
    """An integer of at least ``minimum`` (worker counts, trials, seeds per cell)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


# --------------------------------------------------------------------- storage URLs
def check_storage_url(url: str, name: str = "storage") -> str:
    """An Optuna study storage URL (``sqlite:///path.db``, ``postgresql://...``).

    For SQLite the database's folder must exist (SQLite does not create folders, and the
    error it gives names neither the folder nor the option).
    """
    scheme = _scheme(url)
    if scheme not in STUDY_STORAGE_SCHEMES:
        raise ConfigError(
            f"{name} URL {url!r} has scheme {scheme or '(none)'!r}, not a database",
            hint="use sqlite:///path/to/study.db (or postgresql://, mysql://)",
        )
    if scheme == "sqlite":
        database = url.split(":///", 1)[1] if ":///" in url else ""
        if not database or database == ":memory:":
            raise ConfigError(
                f"{name} URL {url!r} names no database file",
                hint="use sqlite:///path/to/study.db so the study can be resumed",
            )
        folder = Path(database).expanduser().parent
        if not folder.is_dir():
            raise ConfigError(
                f"{name} URL {url!r}: folder {folder} does not exist",
                hint="create the folder first or choose another path",
            )
    return url


def check_tracking_uri(uri: str, name: str = "tracking URI") -> str:
    """An MLflow tracking URI: a known scheme, or a plain local path."""
    scheme = _scheme(uri)
    if scheme and len(scheme) > 1 and scheme not in TRACKING_SCHEMES:  # "C:" is a path
        raise ConfigError(
            f"{name} {uri!r} has unknown scheme {scheme!r}",
            hint=f"use a folder path or one of: {', '.join(sorted(TRACKING_SCHEMES))}",
        )
    return uri


# ------------------------------------------------------------------------ internals
def _policy_class(name: str) -> type:
    from prorsa.policy import POLICIES

    return POLICIES.get(name)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return number


def _scheme(url: str) -> str:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"expected a URL, got {url!r}")
    return urlsplit(url).scheme.split("+", 1)[0].lower()


def _coerce(name: str, value: object, annotation: Any) -> object:
    """``value`` if it fits ``annotation`` (an int where a float is declared becomes a
    float); a :class:`ConfigError` naming the expected type otherwise."""
    ok, converted = _fits(value, annotation)
    if not ok:
        raise ConfigError(
            f"{name} must be {_type_name(annotation)}, got {value!r}",
            hint="values are read as JSON: numbers as 3 or 0.5, text as is, null for none",
        )
    return converted


def _fits(value: object, annotation: Any) -> tuple[bool, object]:
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True, value
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in get_args(annotation):
            ok, converted = _fits(value, option)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return value in get_args(annotation), value
    if annotation is type(None):
        return value is None, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return math.isfinite(value), float(value)
    if annotation is str:
        return isinstance(value, str), value
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return isinstance(value, str), value
    if origin is not None:  # containers (list[int], dict[...]): the shape is the policy's
        return isinstance(value, origin), value
    return isinstance(value, annotation) if isinstance(annotation, type) else True, value


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if annotation is type(None):
        return "null"
    if annotation is float:
        return "a finite number"
    if annotation is int:
        return "an integer"
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return "text"
    return getattr(annotation, "__name__", str(annotation))

"""CLI options generated from config dataclasses: one place for names, defaults and help.

:func:`config_command` turns a command function that takes config objects into a Typer
command whose options are the configs' fields. A field's ``help`` metadata is the option's
help; ``cli`` metadata renames the option (``num_slots`` -> ``--engines``); ``dict`` fields
take repeatable ``key=value`` items (values parsed as JSON when they can be) laid over the
field's default dict. Defaults are
the dataclasses' own, so a default changed in a config changes every command at once.

    @config_command(work=WorkloadConfig, cluster=ClusterConfig)
    def simulate_cmd(work, cluster, out: Path = typer.Option(...)): ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any

import typer

from prorsa.errors import ConfigError


def parse_params(items: list[str], *, what: str = "parameter") -> dict[str, object]:
    """``key=value`` pairs; values parsed as JSON when they can be (numbers, bools, lists)."""
    params: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{what} '{item}' is not key=value")
        key, value = item.split("=", 1)
        if not key:
            raise ConfigError(f"{what} '{item}' has an empty key")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def option_name(field: dataclasses.Field) -> str:
    """The CLI name of a config field (without dashes)."""
    return field.metadata.get("cli", field.name.replace("_", "-"))


def _field_type(field: dataclasses.Field, owner: type) -> Any:
    hints = typing.get_type_hints(owner)
    return hints[field.name]


def _is_dict(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_dict(a) for a in typing.get_args(tp) if a is not type(None))
    return tp is dict or origin is dict


def _cli_type(tp: Any) -> Any:
    """What Typer should parse for a field of type ``tp``."""
    if _is_dict(tp):
        return list[str]
    return tp


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
        return [] if isinstance(value, dict) else value
    return ...


def config_command(
    *, exclude: tuple[str, ...] = (), **configs: type
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command taking config objects (by keyword) so the CLI shows their fields.

    ``exclude`` names fields (``config.field`` or a bare field name) left to their
    defaults. The command's own parameters keep their Typer options; on a name clash the
    command's own parameter wins and the config field is not offered.
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command)
        hints = typing.get_type_hints(command)  # resolve postponed annotations
        own_params = [
            p.replace(annotation=hints.get(name, p.annotation))
            for name, p in own.parameters.items()
            if name not in configs
        ]
        taken = {p.name for p in own_params}
        generated: list[inspect.Parameter] = []
        owners: dict[str, tuple[str, dataclasses.Field, bool]] = {}
        for key, cls in configs.items():
            for f in dataclasses.fields(cls):
                if f.name in exclude or f"{key}.{f.name}" in exclude:
                    continue
                param = option_name(f).replace("-", "_")
                if param in taken or param in owners:
                    continue
                tp = _field_type(f, cls)
                is_dict = _is_dict(tp)
                default = _default(f)
                flag = f"--{option_name(f)}"
                if tp is bool:
                    flag = f"{flag}/--no-{option_name(f)}"
                option = typer.Option(default, flag, help=f.metadata.get("help", ""))
                generated.append(
                    inspect.Parameter(
                        param,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=option,
                        annotation=_cli_type(tp),
                    )
                )
                owners[param] = (key, f, is_dict)

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values: dict[str, dict[str, Any]] = {key: {} for key in configs}
            for param, (key, f, is_dict) in owners.items():
                value = kwargs.pop(param)
                if is_dict:
                    base = f.default_factory() if callable(f.default_factory) else {}
                    value = {**base, **parse_params(value, what=option_name(f))}
                values[key][f.name] = value
            built = {key: cls(**values[key]) for key, cls in configs.items()}
            return command(**kwargs, **built)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own_params]
        wrapper.__signature__ = inspect.Signature(params + generated)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params + generated}
        return wrapper

    return decorate

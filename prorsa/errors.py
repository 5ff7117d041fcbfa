"""Exceptions shared across prorsa. The CLI turns these into one-line messages."""

from __future__ import annotations


class ProrsaError(Exception):
    """Base class for errors a user can act on (bad input, bad configuration)."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(ProrsaError):
    """A configuration value is missing, inconsistent or out of range."""


class CapacityError(ConfigError):
    """A trajectory's context can never fit an engine's KV memory: a property of this
    workload draw on this layout, not of the request alone (a larger layout may fit it)."""


class InputError(ProrsaError):
    """An input record is malformed. Names the source, the record and the field."""

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        record: int | str | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.source = source
        self.record = record
        self.field = field
        self.reason = message
        where = []
        if source is not None:
            where.append(str(source))
        if record is not None:
            where.append(f"record {record}")
        if field is not None:
            where.append(f"field '{field}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message, hint=hint)


class NotFittedError(ProrsaError, ValueError):
    """A model was used before ``fit``."""


class OutputError(ProrsaError):
    """An output path cannot be used (wrong kind, not writable, one of the inputs)."""

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}", hint=hint)


class RecorderError(ProrsaError):
    """The telemetry recorder could not keep an event (writer failed, buffer stayed full)."""


class PartialRunError(InputError):
    """Telemetry of a run that did not complete, given where a complete run is required."""


class StateConflict(InputError):
    """A well-formed request the service's state refuses now (HTTP 409): e.g. a pause
    while a trainer's weight update window is open."""

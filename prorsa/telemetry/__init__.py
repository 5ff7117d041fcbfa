"""Lifecycle telemetry: schema, validation, recorder, readers, views and importers."""

from prorsa.telemetry.reader import RecoveryReport, load_events, read_telemetry, write_parquet
from prorsa.telemetry.recorder import Recorder
from prorsa.telemetry.schema import (
    ARROW_SCHEMA,
    FIELDS,
    EventKind,
    LifecycleEvent,
    events_to_table,
    rows_to_table,
)
from prorsa.telemetry.validation import EventValidator, find_violations, validate_table

__all__ = [
    "ARROW_SCHEMA",
    "FIELDS",
    "EventKind",
    "EventValidator",
    "LifecycleEvent",
    "Recorder",
    "RecoveryReport",
    "events_to_table",
    "find_violations",
    "load_events",
    "read_telemetry",
    "rows_to_table",
    "validate_table",
    "write_parquet",
]

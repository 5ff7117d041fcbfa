"""Bad input gets a clear InputError / ConfigError naming what is wrong."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from prorsa.errors import ConfigError, InputError, NotFittedError
from prorsa.forecast import ForecastDataset, build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.oracle import require_simulated
from prorsa.telemetry import events_to_table
from prorsa.telemetry.schema import ARROW_SCHEMA
from tests.conftest import make_two_turn_events


@pytest.fixture(scope="module")
def hand_data():
    events = make_two_turn_events("a") + make_two_turn_events("b", t0=3.0)
    return build_dataset(events_to_table(events), horizons=[1, 5])


def test_dataset_from_bad_telemetry():
    with pytest.raises(InputError, match="empty"):
        build_dataset(ARROW_SCHEMA.empty_table())
    table = events_to_table(make_two_turn_events()).drop_columns(["output_tokens"])
    with pytest.raises(InputError, match="output_tokens"):
        build_dataset(table)
    with pytest.raises(ConfigError, match="positive"):
        build_dataset(events_to_table(make_two_turn_events()), horizons=[-1])
    with pytest.raises(ConfigError, match="tick_s"):
        build_dataset(events_to_table(make_two_turn_events()), tick_s=0)
    with pytest.raises(InputError, match="no telemetry"):
        build_dataset([])
    twice = [events_to_table(make_two_turn_events())] * 2
    with pytest.raises(InputError, match=r"is also in telemetry\[0\]"):
        build_dataset(twice)


def test_forecaster_bad_input(hand_data):
    with pytest.raises(ConfigError, match="positive"):
        make_forecaster("ewma", horizons=[0, 1]).fit(None)
    with pytest.raises(ConfigError, match="numbers"):
        make_forecaster("ewma", horizons="soon").fit(None)
    with pytest.raises(InputError, match="needs a dataset"):
        make_forecaster("lightgbm-aggregate").fit(None)
    with pytest.raises(InputError, match="ForecastDataset"):
        make_forecaster("lightgbm-aggregate").fit(events_to_table(make_two_turn_events()))
    with pytest.raises(ConfigError, match="not in the dataset"):
        make_forecaster("lightgbm-aggregate", horizons=[2]).fit(hand_data)
    with pytest.raises(ConfigError, match="unknown forecaster 'nope'"):
        make_forecaster("nope")
    model = make_forecaster("ewma", horizons=[1, 5]).fit(None)
    with pytest.raises(InputError, match="no tick yet"):
        model.predict()
    with pytest.raises(InputError, match="finite"):
        model.update([], float("nan"))
    with pytest.raises(NotFittedError, match="fit"):
        make_forecaster("gru").save("/tmp/never")


def test_loading_bad_model_folders(tmp_path):
    with pytest.raises(InputError, match=r"manifest\.json"):
        load_forecaster(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(InputError, match="unreadable"):
        load_forecaster(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(InputError, match="format"):
        load_forecaster(tmp_path)


def test_loading_bad_datasets(tmp_path, hand_data):
    with pytest.raises(InputError, match="no such dataset"):
        ForecastDataset.load(tmp_path / "missing.parquet")
    events = tmp_path / "events.parquet"
    import pyarrow.parquet as pq

    pq.write_table(events_to_table(make_two_turn_events()), events)
    with pytest.raises(InputError, match="not a forecast dataset"):
        ForecastDataset.load(events)
    path = hand_data.save(tmp_path / "d.parquet")
    earlier = (tmp_path / "d.turns.parquet").read_bytes()
    (tmp_path / "d.turns.parquet").unlink()
    with pytest.raises(InputError, match=r"d\.turns\.parquet"):
        ForecastDataset.load(path)
    # A save over an earlier one that stopped between files leaves mixed files.
    hand_data.save(path)
    (tmp_path / "d.turns.parquet").write_bytes(earlier)
    with pytest.raises(InputError, match="another save"):
        ForecastDataset.load(path)
    # Metadata without what training reads, or unreadable: named (found by review).
    import pyarrow.parquet as pq_

    hand_data.save(path)
    table = pq_.read_table(path)
    meta = dict(table.schema.metadata)
    for raw, field in ((b'{"horizons": [1]}', "meta.tasks"), (b"{not json", "forecast_dataset")):
        meta[b"prorsa.forecast_dataset"] = raw
        pq_.write_table(table.replace_schema_metadata(meta), path)
        with pytest.raises(InputError, match=field):
            ForecastDataset.load(path)
    hand_data.save(path)
    # A cut-short sibling: named, with the hint to rebuild (found by review).
    (tmp_path / "d.snapshots.parquet").write_bytes(b"PAR1 cut short")
    with pytest.raises(InputError, match=r"cannot read d\.snapshots\.parquet") as err:
        ForecastDataset.load(path)
    assert "forecast dataset" in (err.value.hint or "")


def test_oracle_refuses_telemetry_not_from_the_simulator(hand_data):
    table = events_to_table(make_two_turn_events())
    with pytest.raises(InputError, match=r"prorsa\.source"):
        require_simulated(table)
    oracle = make_forecaster("oracle", horizons=[1, 5]).fit(None)
    with pytest.raises(InputError, match="simulator telemetry only"):
        oracle.attach(table)
    marked = table.replace_schema_metadata({b"prorsa.source": b"simulator"})
    oracle.attach(marked)
    # A dataset replayed from real traces is refused too.
    with pytest.raises(InputError, match="simulated runs only"):
        make_forecaster("oracle", horizons=[1, 5]).fit(hand_data)
    unattached = make_forecaster("oracle", horizons=[1]).fit(None)
    unattached.update([], 1.0)
    with pytest.raises(ConfigError, match="not been shown the future"):
        unattached.predict()
    assert isinstance(marked, pa.Table)


@pytest.mark.parametrize(("name", "key"), [("ewma", "halflife_s"), ("kalman", "obs_noise")])
@pytest.mark.parametrize("value", [0, -1.0, "x"])
def test_a_baseline_state_that_cannot_run_is_refused_by_field(tmp_path, name, key, value):
    # Found by review: halflife_s 0 loaded, then divided by zero at the first update.
    folder = tmp_path / name
    make_forecaster(name, horizons=[1, 5]).fit(None).save(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["state"][key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=f"state.{key}"):
        load_forecaster(folder)


def test_a_gru_whose_horizons_do_not_match_its_outputs_is_refused(tmp_path):
    # Found by review: it loaded, then failed to reshape at its first forecast.
    import shutil

    from prorsa.runtime.sim.version import models_dir

    folder = tmp_path / "gru"
    shutil.copytree(models_dir() / "gru", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["fitted"]["horizons"] = manifest["fitted"]["horizons"][:-1]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="fitted horizons"):
        load_forecaster(folder)

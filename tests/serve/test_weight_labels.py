"""Weight versions named by the trainer (vLLM's opaque labels) over prorsa's numbers."""

from __future__ import annotations

import asyncio

import pytest

from prorsa.errors import InputError
from prorsa.serve.weight_labels import WeightLabels
from tests.serve.helpers import weights_folder
from tests.serve.test_http_fake import ADMIN, PROMPT, client


def test_numbers_labels_and_the_next_version():
    labels = WeightLabels()
    assert labels.resolve(None, 0) == (1, "1")
    assert labels.resolve(4, 0) == (4, "4")
    assert labels.resolve("4", 0) == (4, "4")  # a string of digits is the number
    assert labels.resolve("step-12", 3) == (4, "step-12")
    labels.stamp(4, "step-12")
    assert labels.label(4) == "step-12" and labels.label("4") == "step-12"
    assert labels.label(7) == "7" and labels.label("default") == "default"


@pytest.mark.parametrize(
    ("requested", "message"),
    [
        (2, "not above the current 3"),
        ("3", "not above the current 3"),
        (True, "an integer or a label"),
        (1.5, "an integer or a label"),
        ("", "printable characters"),
        ("x" * 129, "printable characters"),
        ("a\nb", "printable characters"),
        (" 3", "without surrounding spaces"),
        ("step-1", "already names version 1"),
    ],
)
def test_a_version_that_would_go_back_or_is_not_a_name_is_refused(requested, message):
    labels = WeightLabels()
    labels.stamp(1, "step-1")
    with pytest.raises(InputError, match=message) as caught:
        labels.resolve(requested, 3)
    assert caught.value.field == "version"


def test_only_ascii_digits_make_a_number():
    # "²".isdigit() is True but int("²") fails; "١٢" would have become 12.
    labels = WeightLabels()
    assert labels.resolve("²", 0) == (1, "²")
    assert labels.resolve("١٢", 0) == (1, "١٢")
    assert labels.label("²") == "²"


def test_relabel_keeps_the_old_name_and_refuses_another_versions_number():
    labels = WeightLabels()
    labels.relabel(0, "base")
    assert labels.label(0) == "base"
    with pytest.raises(InputError, match="already names version 0"):
        labels.resolve("base", 0)  # the next weights cannot take it
    labels.relabel(0, "base-again")
    with pytest.raises(InputError, match="already names version 0"):
        labels.resolve("base", 0)  # an earlier name stays taken
    with pytest.raises(InputError, match="is a version number"):
        labels.relabel(0, "5")
    labels.relabel(0, "0")  # its own number is fine


def test_labelled_updates_over_http_stamp_turns_and_spans(tmp_path):
    # vLLM's routes: /finish_weight_update {"weight_version": label}, /weight_info,
    # /update_weight_version {"new_version"}; prime-rl's /update_weights with a label.
    async def go():
        async with client(tmp_path) as (http, (svc, _fakes)):
            assert (await http.post("/start_weight_update", headers=ADMIN)).status_code == 200
            done = await http.post(
                "/finish_weight_update", json={"weight_version": "step-1"}, headers=ADMIN
            )
            info = (await http.get("/weight_info", headers=ADMIN)).json()
            turn = (
                await http.post(
                    "/inference/v1/generate",
                    json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
                )
            ).json()
            reused = await http.post(
                "/update_weights",
                json={"weight_dir": str(weights_folder(tmp_path, "w2")), "version": "step-1"},
                headers=ADMIN,
            )
            relabel = await http.post(
                "/update_weight_version", json={"new_version": "step-1b"}, headers=ADMIN
            )
            bad = await http.post("/update_weight_version", json={"new_version": 3},
                                  headers=ADMIN)  # fmt: skip
            empty = await http.post("/update_weight_version", json={"new_version": ""},
                                    headers=ADMIN)  # fmt: skip
            after = (await http.get("/weight_info", headers=ADMIN)).json()
            await http.post("/start_weight_update", headers=ADMIN)
            in_window = await http.post("/update_weight_version", json={"new_version": "x"},
                                        headers=ADMIN)  # fmt: skip
            backwards = await http.post("/finish_weight_update", json={"weight_version": "1"},
                                        headers=ADMIN)  # fmt: skip
            await http.post("/finish_weight_update", json={"weight_version": "step-2"},
                            headers=ADMIN)  # fmt: skip
            checks["empty"], checks["in_window"], checks["backwards"] = empty, in_window, backwards
            return done, info, turn, reused, relabel, bad, after, svc.status()

    checks: dict = {}
    done, info, turn, reused, relabel, bad, after, status = asyncio.run(go())
    assert done.status_code == 200 and done.json()["label"] == "step-1"
    assert info == {"weight_version": "step-1", "weight_version_number": 1}
    assert turn["prorsa"]["weight_version"] == 1
    assert turn["prorsa"]["weight_version_label"] == "step-1"
    assert {span["version"] for span in turn["choices"][0]["weight_versions"]} == {"step-1"}
    # the same label for other weights: refused, nothing changed
    assert reused.status_code == 400 and "already names version 1" in reused.text
    assert relabel.status_code == 200 and after["weight_version"] == "step-1b"
    assert bad.status_code == 400 and "version number" in bad.text
    assert bad.json()["error"]["param"] == "new_version"
    assert checks["empty"].status_code == 400
    assert checks["empty"].json()["error"]["param"] == "new_version"
    # a relabel while an update is under way would race the update's own label
    assert checks["in_window"].status_code == 409
    assert checks["backwards"].status_code == 400
    assert checks["backwards"].json()["error"]["param"] == "weight_version"
    assert status["weight_version"] == 2 and status["weight_version_label"] == "step-2"


def test_a_label_of_thousands_of_digits_is_a_400_not_a_500():
    # int() refuses 4,300 digits and more; such a "number" is a label, and too long.
    labels = WeightLabels()
    with pytest.raises(InputError, match="printable characters"):
        labels.resolve("1" * 5000, 0)
    with pytest.raises(InputError, match="printable characters"):
        labels.relabel(0, "1" * 5000)


def test_a_cancelled_finish_still_stamps_the_service_with_the_engines_version(tmp_path):
    # Found by review: the engines' version stamp was awaited unshielded, so a trainer
    # call cancelled meanwhile left engines on v1 and the service on v0 (the next update
    # would have reused v1 for other weights).
    async def go():
        async with client(tmp_path) as (http, (svc, fakes)):
            await http.post("/start_weight_update", headers=ADMIN)
            slow = fakes[0].set_weight_version

            async def stamp_slowly(version):
                await asyncio.sleep(0.2)
                await slow(version)

            fakes[0].set_weight_version = stamp_slowly
            finish = asyncio.ensure_future(svc.finish_weight_update("step-1"))
            await asyncio.sleep(0.05)
            finish.cancel()
            with pytest.raises(asyncio.CancelledError):
                await finish
            return svc.weight_version, svc.weight_labels.label(1), svc.weight_update_open

    assert asyncio.run(go()) == (1, "step-1", False)

"""Control-plane routes of SkyRL, prime-rl, AReaL and vLLM, on one rollout service.

Every route here requires ``Authorization: Bearer <admin token>`` when the server was
started with one (401 otherwise). One call acts on every engine, whatever its role: a
trainer that fans control calls out to a list of servers can list this one server.

* pause / resume: ``POST /pause?mode=keep|wait|abort``, ``POST /resume``, ``GET /is_paused``
  (vLLM, SkyRL, prime-rl); AReaL's ``/areal_pause_generation`` (abort) and
  ``/areal_continue_generation``.
* sleep: ``POST /sleep?level=&mode=``, ``POST /wake_up?tags=``, ``GET /is_sleeping``.
* weights from a folder: ``POST /update_weights {"weight_dir"[, "version"]}`` (prime-rl),
  ``POST /areal_update_weights {"model_path"}`` (AReaL), ``POST /prorsa/update_weights
  {"path", "version"}`` — each runs the cross-role weight-sync protocol.
* weights pushed by the trainer (vLLM's weight-transfer API, as SkyRL uses it):
  ``/start_weight_update``, ``/update_weights {"update_info"}``, ``/finish_weight_update``,
  ``/init_weight_transfer_engine``, ``/collective_rpc``, ``GET /get_world_size``,
  ``GET /weight_info``, ``POST /update_weight_version {"new_version"}``. A version may be
  a number or a label (:mod:`prorsa.serve.weight_labels`).
* ``POST /reset_prefix_cache``; prorsa's ``POST /prorsa/switch_role``, ``GET /prorsa/status``,
  and ``POST /prorsa/workload`` (the coming rollouts' expected shape, as
  :class:`~prorsa.policy.types.WorkloadShape` fields; ``DELETE`` forgets it).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from fastapi import APIRouter, Depends, Request

from prorsa.errors import ConfigError
from prorsa.policy.types import WorkloadShape
from prorsa.serve.http_errors import HTTPError, json_object

#: Stripped around an admin token on both sides: what surrounds one read from a file or an
#: environment variable. Not str.strip()'s Unicode spaces: a header arrives decoded as
#: latin-1, where the last byte of a UTF-8 character can look like one (0xA0, 0x85).
TOKEN_BLANKS = " \t\r\n"
_UPDATE_WINDOW_HINT = "call /start_weight_update first (and /finish_weight_update after)"


def require_admin(request: Request) -> None:
    """401 unless the request carries the admin bearer token (when one is configured)."""
    token = request.app.state.admin_token
    if token is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII str, and headers arrive as latin-1.
    sent = value.strip(TOKEN_BLANKS).encode("latin-1")
    if scheme.lower() != "bearer" or not secrets.compare_digest(sent, token):
        raise HTTPError(401, "admin route: send 'Authorization: Bearer <admin token>'")


router = APIRouter(dependencies=[Depends(require_admin)])


def _service(request: Request) -> Any:
    return request.app.state.service


def _query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise HTTPError(400, f"{name} must be an integer, got {raw!r}", param=name) from None


def _seconds_or_none(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or value < 0
    ):
        raise HTTPError(400, f"{name} must be a number of seconds >= 0", param=name)
    return value


# ---------------------------------------------------------------------- pause / resume
@router.post("/pause")
async def pause(request: Request) -> dict[str, Any]:
    mode = request.query_params.get("mode", "abort")
    await _service(request).pause(mode)
    return {"status": "paused", "mode": mode}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await _service(request).resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": _service(request).engines_paused_by_trainer}


@router.post("/areal_pause_generation")
async def areal_pause(request: Request) -> dict[str, Any]:
    # AReaL aborts in-flight work here; prorsa serves each aborted turn again on resume.
    await _service(request).pause("abort")
    return {"success": True, "message": "Generation paused; in-flight turns resume later"}


@router.post("/areal_continue_generation")
async def areal_continue(request: Request) -> dict[str, Any]:
    await _service(request).resume()
    return {"success": True, "message": "Generation continued"}


# ---------------------------------------------------------------------- sleep
@router.post("/sleep")
async def sleep(request: Request) -> dict[str, Any]:
    level = _query_int(request, "level", 1)
    mode = request.query_params.get("mode", "abort")
    engines = await _service(request).sleep(level, mode)
    return {"status": "sleeping", "level": level, "engines": engines}


@router.post("/prorsa/cancel_weight_update")
async def cancel_weight_update(request: Request) -> dict[str, Any]:
    """Close a window from /start_weight_update without a new version (the trainer's
    push failed, or it died): serving resumes on the weights the engines hold."""
    service = _service(request)
    if not service.weight_update_open:
        raise HTTPError(409, "no weight update is open")
    await service.cancel_weight_update()
    return {"status": "cancelled", "weight_version": service.weight_version}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    """vLLM's route: ``tags`` in the query (``?tags=weights``), or in a JSON body as
    SkyRL's HTTP client sends them (``{"tags": ["weights"]}``)."""
    tags = request.query_params.getlist("tags") or None
    if tags is None and await request.body():
        body = await json_object(request)
        tags = body.get("tags")
        if tags is not None and (
            not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
        ):
            raise HTTPError(400, "tags must be a list of strings", param="tags")
        tags = tags or None
    awake = await _service(request).wake_up(tags)
    return {"status": "awake" if awake else "sleeping", "tags": tags, "fully_awake": awake}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return {"is_sleeping": _service(request).sleeping}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    result = await _service(request).reset_prefix_cache()
    return {"status": "ok", "engines": result}


# ---------------------------------------------------------------------- weights
@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    service = _service(request)
    if "update_info" in body:  # vLLM's weight-transfer API, inside a start/finish window
        if not service.weight_update_open:
            raise HTTPError(409, f"update_info outside a weight update: {_UPDATE_WINDOW_HINT}")
        await service.collective_rpc("update_weights", kwargs={"update_info": body["update_info"]})
        return {"message": "Weights updated"}
    folder = body.get("weight_dir")
    if not isinstance(folder, str) or not folder:
        raise HTTPError(
            400, "update_weights needs 'weight_dir' (a save_pretrained folder)", param="weight_dir"
        )
    summary = await service.update_weights_from_path(folder, body.get("version"))
    return {"status": "ok", **summary}


@router.post("/areal_update_weights")
async def areal_update_weights(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    folder = body.get("model_path")
    if not isinstance(folder, str) or not folder:
        raise HTTPError(400, "areal_update_weights needs 'model_path'", param="model_path")
    summary = await _service(request).update_weights_from_path(folder, body.get("version"))
    return {
        "success": True,
        "message": f"weights v{summary['version']} on engines {summary['engines']}",
    }


@router.post("/prorsa/update_weights")
async def prorsa_update_weights(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    folder = body.get("path")
    if not isinstance(folder, str) or not folder:
        raise HTTPError(400, "needs 'path' (a save_pretrained folder)", param="path")
    drain = _seconds_or_none(body, "drain_timeout_s")
    return await _service(request).update_weights_from_path(
        folder, body.get("version"), drain_timeout_s=drain
    )


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, Any]:
    await _service(request).begin_weight_update_with("start_weight_update")
    return {"message": "Weight update started"}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    version = body.get("weight_version")  # a number or a label (vLLM's is a label)
    _, summary = await _service(request).finish_weight_update_with("finish_weight_update", version)
    return {"message": "Weight update finished", **summary}


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    init_info = body.get("init_info")
    if not isinstance(init_info, dict):
        raise HTTPError(400, "needs 'init_info' (an object)", param="init_info")
    await _service(request).init_weight_transfer(init_info)
    return {"message": "Weight transfer initialized"}


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise HTTPError(400, "collective_rpc needs 'method'", param="method")
    args = body.get("args") or []
    kwargs = body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise HTTPError(400, "'args' must be a list and 'kwargs' an object", param="args")
    timeout = _seconds_or_none(body, "timeout")
    results = await _service(request).collective_rpc(method, args, kwargs, timeout)
    return {"results": {str(eid): _plain(r) for eid, r in results.items()}}


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict[str, Any]:
    service = _service(request)
    return {"world_size": len(service.live_engines()) * service.tensor_parallel_size}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict[str, Any]:
    service = _service(request)
    return {
        "weight_version": service.weight_labels.label(service.weight_version),
        "weight_version_number": service.weight_version,
    }


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> dict[str, Any]:
    """vLLM's relabel: name the weights served now, without changing them."""
    body = await json_object(request)
    label = body.get("new_version")
    if isinstance(label, int) and not isinstance(label, bool):
        label = str(label)
    if not isinstance(label, str):
        raise HTTPError(
            400, "update_weight_version needs 'new_version' (a label)", param="new_version"
        )
    _service(request).relabel_weights(label)
    return {"success": True, "new_version": label}


# ---------------------------------------------------------------------- prorsa
@router.post("/prorsa/switch_role")
async def switch_role(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    engine_id, role = body.get("engine_id"), body.get("role")
    if isinstance(engine_id, bool) or not isinstance(engine_id, int) or not isinstance(role, str):
        raise HTTPError(400, "needs 'engine_id' (int) and 'role' (str)", param="engine_id")
    drain = _seconds_or_none(body, "drain_timeout_s")
    return await _service(request).switch_role(engine_id, role, drain)


@router.post("/prorsa/workload")
async def set_workload(request: Request) -> dict[str, Any]:
    body = await json_object(request)
    names = [f.name for f in dataclasses.fields(WorkloadShape)]
    unknown = sorted(set(body) - set(names))
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r}; fields: {names}", param=unknown[0])
    for name in names:
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HTTPError(400, f"'{name}' must be a number >= 0, got {value!r}", param=name)
    try:
        shape = WorkloadShape(**{name: float(body[name]) for name in names})
    except ConfigError as exc:
        raise HTTPError(400, str(exc)) from None
    _service(request).set_workload(shape)
    return {"workload": dataclasses.asdict(shape)}


@router.delete("/prorsa/workload")
async def forget_workload(request: Request) -> dict[str, Any]:
    _service(request).set_workload(None)
    return {"workload": None}


@router.get("/prorsa/status")
async def status(request: Request) -> dict[str, Any]:
    return _service(request).status()


def _plain(value: Any) -> Any:
    """A JSON-safe rendering of a worker's RPC result."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)

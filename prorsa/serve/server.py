"""Run a rollout service over HTTP until SIGINT/SIGTERM, then stop engines and Ray cleanly.

uvicorn's own signal handling re-raises the signal once the server has stopped, which
would end the process before the engines are shut down; :class:`_Server` records the
signal instead, so :func:`serve` can stop the service (engines, Ray, telemetry flush)
and return. A second Ctrl-C forces the HTTP server down at once; the cleanup still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator
from typing import Any

from prorsa.errors import ConfigError
from prorsa.runtime.gc_heap import startup_heap_frozen
from prorsa.serve.config import ServeConfig

logger = logging.getLogger(__name__)


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the engines start.

    Engines take minutes to start, and Ray and vLLM open ports of their own meanwhile;
    holding the socket from the start means a taken port fails at once and no other
    process can take the port while the engines load (vLLM's API server does the same).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}", hint="choose another --port"
        ) from None
    sock.set_inheritable(False)
    return sock


def serve(
    config: ServeConfig,
    *,
    on_ready: Callable[[Any], None] | None = None,
    on_stopping: Callable[[], None] | None = None,
    fleet: Any = None,
) -> int:
    """Start the service and its HTTP server; block until a signal; clean up.

    Args:
        config: the service to run.
        on_ready: called with the started service once the HTTP server listens.
        on_stopping: called once the HTTP server has stopped, as the engines, Ray and
            telemetry are being shut down (signals then no longer interrupt).
        fleet: an already started engine fleet to adopt (left running).

    Returns:
        The signal number that stopped the server (0 if it stopped on its own).
    """
    config.validate()
    with (
        listen_socket(config.host, config.port) as sock,
        asyncio.Runner(loop_factory=event_loop_factory()) as runner,
    ):
        return runner.run(_serve(config, on_ready, on_stopping, fleet, sock))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when installed (a faster loop for the HTTP and Ray plumbing)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(
    config: ServeConfig,
    on_ready: Callable[[Any], None] | None,
    on_stopping: Callable[[], None] | None,
    fleet: Any,
    sock: socket.socket,
) -> int:
    from prorsa.serve.app import create_app
    from prorsa.serve.service import RolloutService

    service = RolloutService(config, fleet=fleet)
    server: _Server | None = None
    loop = asyncio.get_running_loop()
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        # Until uvicorn takes over, SIGTERM stops start-up like Ctrl-C (then cleans up).
        loop.add_signal_handler(signal.SIGTERM, lambda: signal.raise_signal(signal.SIGINT))
    try:
        try:
            await service.start()
            server = _Server(uvicorn_config(config, create_app(service)))
        finally:
            if in_main:
                loop.remove_signal_handler(signal.SIGTERM)
        if on_ready is not None:
            asyncio.get_running_loop().create_task(_when_started(server, on_ready, service))
        with startup_heap_frozen(config.freeze_startup_heap):
            await server.serve(sock)  # uvicorn holds SIGINT and SIGTERM from its first step
    finally:
        logger.info("shutting down the rollout service")
        if in_main:
            # A second Ctrl-C or a supervisor's repeated SIGTERM must not cut the clean-up
            # short: engines and Ray processes would outlive the server.
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, _ignored_during_shutdown, sig)
        try:
            await shut_down(service, on_stopping)
        finally:
            if in_main:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
    return server.signal_number if server is not None else 0


async def shut_down(service: Any, on_stopping: Callable[[], None] | None = None) -> None:
    """Tell ``on_stopping``, then stop ``service`` whatever that callback does (a CLI
    printing to a pipe whose reader died with the same Ctrl-C raises)."""
    if on_stopping is not None:
        try:
            on_stopping()
        except Exception:
            logger.exception("on_stopping failed; shutting down regardless")
    await service.shutdown()


def _ignored_during_shutdown(sig: int) -> None:
    logger.warning(
        "%s while shutting down: the engines and Ray are being stopped, please wait "
        "(SIGKILL stops the server at once and leaves them running)",
        signal.Signals(sig).name,
    )


def uvicorn_config(config: ServeConfig, app: Any) -> Any:
    """The HTTP server's settings, for ``prorsa serve`` and :class:`BackgroundServer`:
    quiet logs (the service logs what matters), no lifespan events (the service starts
    before the server and stops after it), no proxy-header rewriting (nothing reads the
    client address), in-flight requests given 30 s to finish."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        proxy_headers=False,
        timeout_graceful_shutdown=30,
    )


async def _when_started(server: Any, on_ready: Callable[[Any], None], service: Any) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    on_ready(service)


class _Server:
    """A uvicorn server that records SIGINT/SIGTERM instead of re-raising them."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                signals = (signal.SIGINT, signal.SIGTERM)
                previous = {sig: signal.signal(sig, outer._on_signal) for sig in signals}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        self.server = Server(config)
        self.signal_number = 0

    def _on_signal(self, sig: int, frame: Any) -> None:
        if self.server.should_exit and sig == signal.SIGINT:
            self.server.force_exit = True
        self.signal_number = sig
        self.server.should_exit = True

    @property
    def started(self) -> bool:
        return self.server.started

    async def serve(self, sock: socket.socket) -> None:
        await self.server.serve(sockets=[sock])


class BackgroundServer:
    """``prorsa serve`` on a thread of this process: for tests, examples and benchmarks.

    The thread runs its own event loop with the service and a uvicorn server (signals stay
    with the main thread). :meth:`stop` ends the server and shuts the service down.

    Args:
        config: the service to run (its host and port are where it listens).
        fleet: an engine fleet to adopt (left running), as :class:`RolloutService` takes.
    """

    def __init__(self, config: ServeConfig, *, fleet: Any = None) -> None:
        self.config = config
        self.fleet = fleet
        self.service: Any = None
        self.error: BaseException | None = None
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout_s: float = 900.0) -> BackgroundServer:
        """Start and wait until the server listens (raises what start-up raised)."""
        import time

        self._socket = listen_socket(self.config.host, self.config.port)
        self._thread = threading.Thread(target=self._main, name="prorsa-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not (self._server is not None and self._server.started):
            if self.error is not None or not self._thread.is_alive():
                self.stop()
                raise self.error or RuntimeError("prorsa serve stopped while starting")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prorsa serve did not start within {timeout_s:g} s")
            time.sleep(0.05)
        return self

    def call(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run a coroutine (e.g. ``service.switch_role(...)``) on the server's loop."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 120.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                runner.run(self._run())
        except BaseException as exc:  # reported to start(); the thread ends
            self.error = exc

    async def _run(self) -> None:
        import uvicorn

        from prorsa.serve.app import create_app
        from prorsa.serve.service import RolloutService

        self._loop = asyncio.get_running_loop()
        service = RolloutService(self.config, fleet=self.fleet)
        try:
            await service.start()
            self.service = service
            self._server = uvicorn.Server(uvicorn_config(self.config, create_app(service)))
            with startup_heap_frozen(self.config.freeze_startup_heap):
                await self._server.serve(sockets=[self._socket])
        finally:
            await service.shutdown()

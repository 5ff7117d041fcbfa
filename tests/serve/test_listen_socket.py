"""The server holds its port from before the engines start."""

from __future__ import annotations

import socket

import pytest

from prorsa.errors import ConfigError
from prorsa.serve.server import listen_socket


def test_the_port_is_held_while_engines_would_start():
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        # Another process (Ray, vLLM) cannot take the port meanwhile ...
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen_socket("127.0.0.1", port)
        # ... and clients can already connect (they queue until the server accepts).
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        sock.close()
    listen_socket("127.0.0.1", port).close()  # released on close

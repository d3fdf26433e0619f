"""A uvicorn server for the serve tests and the serving benchmark: the app of
:func:`mila_py.serve.create_app` on a free port of 127.0.0.1, in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def running_server(model: Any, name: str) -> Iterator[str]:
    """Serve ``model`` as ``name`` while the block runs; yields the base URL
    (``http://127.0.0.1:PORT``)."""
    import uvicorn

    from mila_py.serve import create_app

    config = uvicorn.Config(create_app(model, name), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound before the server starts: no race for the port
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

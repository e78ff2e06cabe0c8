"""Running the app under uvicorn, with a graceful shutdown: on SIGTERM (or Ctrl-C) new requests get 503
while everything already accepted — queued or generating — finishes; then the server stops. A second
signal stops at once. `running_server` starts one in a background thread (tests, load generators).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from specula.errors import SpeculaError

STARTUP_TIMEOUT_S = 60.0
BACKLOG = 2048  # uvicorn's default


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the app (``app.state.specula``) before stopping."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.state = app.state.specula

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:  # a second signal: stop now, in-flight requests or not
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True  # new requests: 503; on_tick stops the server once the engine is idle
        engine = self.state.engine
        waiting = (engine.queue_length + engine.batch_size) if engine is not None else 0
        logging.getLogger("uvicorn.error").info(
            "Draining: %d request(s) in flight finish first, new ones get 503 (signal again to stop now)", waiting)

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and self.state.idle:
            self.should_exit = True  # uvicorn then waits for open responses to finish sending
        return await super().on_tick(counter)

    @property
    def port(self) -> int:
        """The port actually bound (useful with port 0)."""
        return self.servers[0].sockets[0].getsockname()[1]


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                            lifespan="on")
    return DrainingServer(config, app)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` and listening, or a SpeculaError saying why not (e.g. the port is in use).

    `specula serve` binds before it loads the model, so a busy port is one error line in a second, not uvicorn's
    log line after minutes of loading.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise SpeculaError(f"cannot listen on {host}:{port}: the host name cannot be resolved ({err})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        raise SpeculaError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM/SIGINT (blocking; call from the main thread so the signals reach it), on ``sock`` if
    given (`bind_socket`), else on a socket uvicorn binds to ``host``:``port``."""
    make_server(app, host, port, log_level).run(sockets=None if sock is None else [sock])


@contextlib.contextmanager
def running_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                   log_level: str = "warning") -> Iterator[DrainingServer]:
    """Serve ``app`` in a background thread on a free port of ``host``; yields the started server, stops it after."""
    server = make_server(app, host, port, log_level)
    thread = threading.Thread(target=server.run, name="specula-serve", daemon=True)
    thread.start()
    for _ in range(int(STARTUP_TIMEOUT_S / 0.05)):  # bounded: a server that never starts is an error
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        thread.join(5)
        raise RuntimeError("the server did not start")
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(STARTUP_TIMEOUT_S)

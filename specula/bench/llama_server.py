"""llama.cpp's ``llama-server`` as a child process: found, started on a free local port, asked, always stopped.

`find_llama_server` locates the binary (``--llama-server PATH``, else ``$SPECULA_LLAMA_SERVER``,
else ``$LLAMA_SERVER``, else ``llama-server`` on PATH). `LlamaServer` is a context manager:
entering starts the process on 127.0.0.1 and a port the kernel just handed out, waits until
``GET /health`` answers 200, and leaving stops it (SIGTERM, then SIGKILL after a grace period),
on errors and Ctrl-C too. The child runs in its own session, so a Ctrl-C in the terminal
reaches only us and we stop it in order; on Linux it also gets SIGTERM should this process die
without cleaning up (``PR_SET_PDEATHSIG``). Its output goes to a log file whose tail is quoted
when it fails to start. `LlamaServer.post` sends one JSON request and returns the JSON answer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from specula.errors import SpeculaError
from specula.openmp import foreign_environment

ENV_VARS = ("SPECULA_LLAMA_SERVER", "LLAMA_SERVER")
HOST = "127.0.0.1"
MISSING = ("llama.cpp's llama-server was not found: pass --llama-server PATH (or llama_server in the config's "
           "[bench]), or set SPECULA_LLAMA_SERVER=/path/to/llama-server")


def _how_it_ended(status: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    if -status in (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS):
        # seen on an Intel VM: a -DGGML_NATIVE=ON build used AMX tile instructions the kernel does not allow
        return (f"was killed by {name} (a build for instructions this CPU or its kernel does not allow? the "
                f"README's llama.cpp section says how to build without them)")
    return f"was killed by {name}"


class LlamaServerNotInstalled(SpeculaError):
    """No llama-server was named (flag, config or environment) and none is on PATH."""


def find_llama_server(explicit: str | Path | None = None) -> Path:
    """The llama-server binary to run, or a SpeculaError saying how to name one: `LlamaServerNotInstalled`
    when none was named and none is on PATH, a plain SpeculaError when the one named is not there."""
    candidates = [(str(explicit), "--llama-server")] if explicit else []
    candidates += [(os.environ[name], f"${name}") for name in ENV_VARS if os.environ.get(name)]
    for value, source in candidates[:1]:  # the first one given is what the user meant: no silent fallback
        path = Path(value).expanduser()
        if path.is_dir():
            path = path / "llama-server"
        if not path.is_file() or not os.access(path, os.X_OK):
            raise SpeculaError(f"{source} {value}: no executable llama-server there")
        return path.resolve()
    found = shutil.which("llama-server")
    if found is None:
        raise LlamaServerNotInstalled(MISSING)
    return Path(found).resolve()


def server_version(binary: Path) -> str:
    """The build line ``llama-server --version`` prints (e.g. 'version: 0.6.0-dev (build 0, commit unknown)')."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SpeculaError(f"cannot run {binary} --version: {err}") from err
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class LlamaServer:
    """``llama-server -m MODEL ARGS --host 127.0.0.1 --port P`` for the duration of a ``with`` block."""

    def __init__(self, binary: str | Path, args: list[str], startup_timeout: float = 300.0,
                 request_timeout: float = 3600.0, attempts: int = 3):
        self.binary = Path(binary)
        self.args = [str(a) for a in args]
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.attempts = attempts
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._log_dir: tempfile.TemporaryDirectory | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> LlamaServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the process and wait until it serves; retries on another port if the chosen one was taken."""
        self._log_dir = tempfile.TemporaryDirectory(prefix="specula-llama-server-")
        self.log_path = Path(self._log_dir.name) / "server.log"
        for attempt in range(1, self.attempts + 1):
            self.port = free_port()
            command = [str(self.binary), *self.args, "--host", HOST, "--port", str(self.port)]
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env=foreign_environment(),  # llama.cpp waits as its user would have it, not as we do
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
            if self._wait_ready():
                return
            tail, ended = self.log_tail(), _how_it_ended(self.process.poll())
            self._stop()
            if "bind" not in tail.lower() or attempt == self.attempts:  # only a lost port race is worth a retry
                raise SpeculaError(f"llama-server did not start ({' '.join(command)}): it {ended}; its last output: "
                                   f"{tail}")

    def _wait_ready(self) -> bool:
        """True once /health answers 200; False if the process ended; SpeculaError after the timeout."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.1)
        raise SpeculaError(f"llama-server did not become ready within {self.startup_timeout:g} s; its last output: "
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines the server printed, joined into one line for an error message."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "(nothing)"

    def post(self, path: str, body: dict) -> dict:
        """POST ``body`` as JSON to ``path`` and return the JSON answer; a server error becomes a SpeculaError."""
        if self.process is None or self.process.poll() is not None:
            raise SpeculaError(f"llama-server is not running; its last output: {self.log_tail()}")
        return post_json(f"{self.url}{path}", body, self.request_timeout)

    def _stop(self, grace: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        """Stop the server (idempotent) and remove its log."""
        self._stop()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None


def post_json(url: str, body: dict, timeout: float) -> dict:
    """One JSON POST; HTTP errors carry the server's own message into the SpeculaError."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise SpeculaError(f"llama-server answered {err.code} to {url}: {detail}") from err
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as err:
        raise SpeculaError(f"llama-server request to {url} failed: {err}") from err

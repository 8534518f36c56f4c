"""`ninfer-serve` as a child process on a free loopback port, for demos, load tests and tests.

    with ServerProcess(["--max-model-len", "4096"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        ...
    print(server.exit_status)   # 0 after the orderly SIGTERM stop
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx


class ServerProcess:
    def __init__(self, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
                 log_file: Path | None = None, startup_timeout: float = 900.0):
        """Args:
            args: ninfer-serve arguments (not --host / --port: the server binds 127.0.0.1 on a free port).
            env: the child's environment (default: this process's).
            log_file: where the server's output goes (default: this process's stdout and stderr).
            startup_timeout: seconds to wait for /health/ready (weights, and compiles unless --no-warmup).
        """
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "ninfer_jax.server", *args, "--host", "127.0.0.1",
                        "--port", str(self.port)]
        self._env = {**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"}
        self._log_file = log_file
        self._log: IO[str] | None = None
        self._startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.exit_status: int | None = None

    def __enter__(self) -> ServerProcess:
        self._log = open(self._log_file, "w") if self._log_file else None  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(self.command, env=self._env, stdout=self._log,
                                        stderr=subprocess.STDOUT if self._log else None)
        try:
            self._wait_for_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (the orderly stop) and wait; returns the exit status. Kills it after `timeout`."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.exit_status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_status = self.process.wait()
        if self._log is not None:
            self._log.close()
        return self.exit_status

    def _wait_for_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ninfer-serve exited during startup (status {self.process.returncode})")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"ninfer-serve was not ready within {self._startup_timeout:.0f} s")


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

"""``vllm-pamer serve`` in a child process: the one launcher the demo, the
end-to-end tests and the benchmarks share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(base_url: str) -> bool:
    """``GET /health`` answers 200."""
    import httpx

    try:
        return httpx.get(base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def first_traceback(log_path: Path, lines: int = 40) -> str:
    """The log's first traceback, ``lines`` from its start ("" if none): a
    child that died (an API process under ``--api-server-count``) says why
    there, often well above the shutdown lines a tail shows."""
    log = Path(log_path).read_text(errors="replace").splitlines(True)
    start = next((i for i, line in enumerate(log) if "Traceback (most recent call last)" in line), None)
    return "" if start is None else "".join(log[start : start + lines])


class ServerProcess:
    """``vllm-pamer serve`` in a child process (its own process group)."""

    def __init__(self, args: list[str], port: int | None, log_path: Path, env: dict[str, str] | None = None) -> None:
        port = port or free_port()
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the child writes it until stop()
        cmd = [sys.executable, "-m", "vllm_pamer.cli", "serve", *args, "--port", str(port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )

    def wait_ready(self, timeout: float = 900.0, progress: bool = True) -> None:
        from tqdm import tqdm

        deadline = time.monotonic() + timeout
        with tqdm(total=None, desc="starting vllm-pamer serve", unit="s", disable=not progress) as bar:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode}; see {self.log_path}; its first traceback:\n"
                        f"{self.first_traceback()}\nits log ends:\n{self.tail()}"
                    )
                if healthy(self.base_url):
                    return
                time.sleep(1)
                bar.update(1)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; see {self.log_path}")

    def tail(self, lines: int = 30) -> str:
        return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-lines:])

    def first_traceback(self, lines: int = 40) -> str:
        return first_traceback(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL the whole server (API server, engine, workers): a crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class RouterProcess:
    """vLLM's router (PyPI ``vllm-router``) in front of ``worker_urls``,
    hashing each session to a replica (``X-Session-ID``), with a health check
    every second so a dead replica's sessions move within seconds."""

    def __init__(self, worker_urls: list[str], log_path: Path, port: int | None = None) -> None:
        executable = Path(sys.executable).with_name("vllm-router")
        if not executable.exists():
            raise FileNotFoundError(f"{executable}: pip install 'vllm-pamer[router]'")
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the child writes it until stop()
        cmd = [
            str(executable),
            *("--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls),
            *("--policy", "consistent_hash", "--prometheus-port", str(free_port())),
            *("--health-check-interval-secs", "1", "--health-failure-threshold", "1"),
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if healthy(self.base_url):
                return
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the router did not start; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

"""Running Sid's HTTP server for tests: in this process (a uvicorn thread) or as `sid serve`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families


class ServerThread:
    """uvicorn serving ``app`` from a background thread on a free port of 127.0.0.1."""

    def __init__(self, app: FastAPI) -> None:
        self.config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(self.config)
        self.sock = self.config.bind_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServeProcess:
    """`python -m sid serve ... --port 0`, its URL read from the line it prints once bound."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sid", "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.url = self._wait_for_url()
        self._reader = threading.Thread(target=self._drain_output, daemon=True)
        self._reader.start()
        wait_healthy(self.url)

    def _wait_for_url(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.search(r"serving .* on (http://\S+)", line)
            if match:
                return match.group(1)
        raise AssertionError("sid serve exited before binding:\n" + "".join(self.lines))

    def _drain_output(self) -> None:
        assert self.proc.stdout is not None
        self.lines.extend(self.proc.stdout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy")


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name plus labels, e.g. ``sid_requests_total{finish_reason="abort"}``."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def poll_metrics(url: str, condition: Callable[[dict[str, float]], bool], timeout: float = 20.0) -> dict[str, float]:
    """Scrape until ``condition(samples)`` holds; fail with the last samples otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never satisfied the condition: {samples}"
        time.sleep(0.1)


def with_chat_template(model: Path, dest: Path, template: str) -> Path:
    """A copy of ``model`` whose tokenizer has ``template`` as its chat template."""
    import json
    import shutil

    shutil.copytree(model, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return dest

"""Helpers of the tracking tests: a real MLflow server on loopback."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """A real ``mlflow server`` on a free loopback port (its own SQLite store and artifact folder); its URL."""
    import urllib.request

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    folder.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
                               "--artifacts-destination", (folder / "artifacts").as_uri()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=folder)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, f"mlflow server exited with {server.returncode}"
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 180 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()

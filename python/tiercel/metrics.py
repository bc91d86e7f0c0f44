"""What a Store has done per tier, for people and for Prometheus.

    store.metrics()                          # {"disk": {"steps_written": 12, "lag_steps": 3, ...}, ...}
    store.metrics().timings                  # {"deepspeed_stall": {"count": 40, "seconds": 1.2, ...}, ...}
    tiercel.metrics.prometheus_text(store)   # the same as Prometheus text: tiercel_* samples
    server = tiercel.metrics.serve(store, 9400)   # GET /metrics, for scraping (and `tiercel stats`)

The counters live in the core and count this process's work (one Store per rank): every
sample carries a `tier` (or `timing`) and a `rank` label. Their fields are listed once, in
the core (tiercel-core's store/metrics.rs); this module iterates that list, so a new metric
needs no edit here. The framework adapters add the times training waits on them
(`record`).
"""

from __future__ import annotations

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from . import _core

if TYPE_CHECKING:
    from .store import Store

__all__ = ["FIELDS", "TIMINGS", "TIMING_FIELDS", "Metrics", "MetricsServer", "parse_prometheus", "prometheus_text",
           "record", "serve"]

#: Each field of a tier's `Store.metrics()`: (name, Prometheus type, help). Counters get `_total`.
FIELDS: list[tuple[str, str, str]] = list(_core.TIER_FIELDS)
#: Each field of a timing in `Store.metrics().timings`, as `FIELDS`; samples `tiercel_timing_<name>`.
TIMING_FIELDS: list[tuple[str, str, str]] = list(_core.TIMING_FIELDS)
#: The timings the framework adapters record: name -> what is timed.
TIMINGS: dict[str, str] = dict(_core.TIMINGS)


class Metrics(dict[str, dict[str, Any]]):
    """`Store.metrics()`: per tier, the fields of `FIELDS`; `timings`: per timing of
    `TIMINGS` (taken or not), the fields of `TIMING_FIELDS`."""

    def __init__(self, tiers: list[dict[str, Any]], timings: list[dict[str, Any]]) -> None:
        super().__init__((m.pop("tier"), m) for m in tiers)
        self.timings: dict[str, dict[str, Any]] = {t.pop("timing"): t for t in timings}


def record(store: Store, timing: str, seconds: float) -> None:
    """An adapter measured `seconds` of the timing `timing` (one of `TIMINGS`): counted in
    `store.metrics().timings` and the Prometheus text."""
    store._core.timed(timing, seconds)


def _sample_name(field: str, kind: str) -> str:
    return f"tiercel_{field}" + ("_total" if kind == "counter" else "")


def prometheus_text(store: Store) -> str:
    """The store's metrics in Prometheus' text format (version 0.0.4). A value not known yet
    (no lag before the tier was handed a save) is left out; a tier handed saves it never
    finished writing has its lag, growing, so an alert on lag fires for a hung tier."""
    metrics = store.metrics()
    lines: list[str] = []
    families = [(FIELDS, "", "tier", metrics), (TIMING_FIELDS, "timing_", "timing", metrics.timings)]
    for fields, prefix, label, samples in families:
        for field, kind, help_text in fields:
            name = _sample_name(prefix + field, kind)
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for key, m in samples.items():
                if m[field] is not None:
                    lines.append(f'{name}{{{label}="{key}",rank="{store.rank}"}} {float(m[field])!r}')
    return "\n".join(lines) + "\n"


_SAMPLE = re.compile(r'^tiercel_(\w+?)(?:_total)?\{tier="([^"]*)",rank="(\d+)"\} (\S+)$')


def parse_prometheus(text: str) -> dict[tuple[str, int], dict[str, float]]:
    """The tiercel samples of a Prometheus text, by (tier, rank): what `prometheus_text`
    wrote (possibly of several ranks, concatenated)."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            field, tier, rank, value = m.groups()
            out.setdefault((tier, int(rank)), {})[field] = float(value)
    return out


class MetricsServer(ThreadingHTTPServer):
    """Serves `GET /metrics` from a daemon thread until `close()`."""

    daemon_threads = True

    def __init__(self, store: Store, host: str, port: int):
        self.store = store
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="tiercel-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        if self.path.split("?")[0] not in ("/", "/metrics"):
            self.send_error(404, "only /metrics is served here")
            return
        body = prometheus_text(self.server.store).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # scrapes are not worth a line each
        pass


def serve(store: Store, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serves the store's metrics at http://host:port/metrics (port 0: a free one, see
    `.port`) for Prometheus or `tiercel stats --url`. Use host="0.0.0.0" to be scraped
    from other machines."""
    return MetricsServer(store, host, port)


def fmt_number(v: float | None) -> str:
    """A metric for a table: integers as such, others to 3 significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return str(int(v)) if float(v).is_integer() else f"{v:.3g}"

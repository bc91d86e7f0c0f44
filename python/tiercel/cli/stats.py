"""`tiercel stats --url URL`: a running job's metrics (what `tiercel.metrics.serve` serves),
per tier and rank: written, rate, last step, lag, what is at risk (the newest committed step,
how long ago it was saved, bytes not on the tier yet), queue, skips, failures, bytes read, and
an object store's requests (all kinds) and slow-down answers."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from ..metrics import fmt_number, parse_prometheus
from .context import EXIT_OK, CommandError, Ctx
from .output import fmt_bytes, json_out, table


def _url(u: str) -> str:
    if "://" not in u:
        u = "http://" + u
    return u if u.rstrip("/").endswith("/metrics") else u.rstrip("/") + "/metrics"


def cmd_stats(ctx: Ctx) -> int:
    urls = [_url(u) for u in ctx.args.url]
    rows: list[dict[str, Any]] = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise CommandError(f"cannot read metrics from {url}: {getattr(e, 'reason', e)} (is the job serving them? "
                               "tiercel.metrics.serve(store, port))") from None
        for (tier, rank), m in parse_prometheus(text).items():
            rows.append({"url": url, "tier": tier, "rank": rank, **m})
    if not rows:
        raise CommandError(f"no tiercel metrics at {', '.join(urls)}")
    if ctx.args.json:
        json_out({"tiers": rows})
        return EXIT_OK

    def b(v: float | None) -> str:
        return fmt_bytes(int(v)) if v is not None else "-"

    def requests(r: dict[str, Any]) -> str:
        counts = [v for k, v in r.items() if k.startswith("requests_") and k != "requests_throttled"]
        return fmt_number(sum(counts)) if counts else "-"

    lines = table(
        ["TIER", "RANK", "STEPS", "WRITTEN", "RATE", "LAST", "LAG", "LAG S", "COMMITTED", "AGE S", "UNWRITTEN", "QUEUE",
         "SKIPS", "FAILS", "READ", "REQUESTS", "SLOWDOWNS"],
        [[r["tier"], r["rank"], fmt_number(r.get("steps_written")), b(r.get("bytes_written")),
          b(r.get("write_bytes_per_second")) + "/s" if r.get("write_bytes_per_second") is not None else "-",
          fmt_number(r.get("last_step")), fmt_number(r.get("lag_steps")), fmt_number(r.get("lag_seconds")),
          fmt_number(r.get("committed_step")), fmt_number(r.get("committed_age_seconds")), b(r.get("unwritten_bytes")),
          fmt_number(r.get("queue_depth")), fmt_number(r.get("skips")), fmt_number(r.get("failures")),
          b(r.get("bytes_read")), requests(r), fmt_number(r.get("requests_throttled"))] for r in rows],
        right=set(range(1, 17)),
    )
    print("\n".join(lines))
    return EXIT_OK

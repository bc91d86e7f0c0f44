"""A TCP proxy that injects faults between tiercel and an object-store server.

Every new client connection gets one fate, drawn from a seeded RNG (so a run can be
repeated), while the fault budget lasts:

- "reset":  forward normally, then after a random number of bytes (either direction) close
            both sides with RST (SO_LINGER 0): a connection reset in the middle of a request
            or response body.
- "503":    read the first request (head and Content-Length body) and answer
            `503 Service Unavailable` with an S3 `SlowDown` error, then close.
- "stall":  forward, then after a random number of bytes stop forwarding for `stall_s`
            seconds (longer than the client's timeout), then close.
- "ok":     forward untouched.

`hold = True` stops forwarding on every connection, open or new, without closing any (a
server that hangs) until set back.

`down = True` resets every open connection and refuses every new one (RST) until set back:
a server that went away. Counters tell the test what was assigned (`injected`) and what
really happened on the wire (`fired`: a reset or stall only fires once its connection has
moved its random number of bytes; one that ends earlier fired nothing).
"""

from __future__ import annotations

import random
import re
import select
import socket
import struct
import threading
from collections import Counter

SLOWDOWN = (
    b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate (injected by faultproxy).</Message></Error>"
)


def _rst(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


RANGE_HEADER = re.compile(rb"\r\nrange: *bytes=", re.IGNORECASE)
#: A request line of the methods an object store is read with (the requests a test counts).
READ_REQUEST = re.compile(rb"(GET|HEAD) (/[^ \r\n]*) HTTP/1\.1\r\n")
#: A request line of any method (`requests` counts them by kind).
ANY_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (/[^ \r\n]*) HTTP/1\.1\r\n")


def request_kind(method: str, target: str) -> str:
    """What an S3 request line does: LIST (a bucket listing, objects or multipart uploads),
    DELETE (one object, or a multi-object delete), or its method."""
    path, _, query = target.partition("?")
    if method == "GET" and ("/" not in path.strip("/") or "list-type" in query or query.startswith("uploads")):
        return "LIST"
    if method == "POST" and query.startswith("delete"):
        return "DELETE"
    return method


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        faults: dict[str, float] | None = None,
        budget: int = 10,
        stall_s: float = 4.0,
        max_offset: int = 3 << 20,
    ):
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.rng = random.Random(seed)
        # Weights of each fate per connection; "ok" takes the rest.
        self.faults = faults or {"reset": 0.2, "503": 0.2, "stall": 0.1}
        self.budget = budget
        self.stall_s = stall_s
        self.max_offset = max_offset
        self.down = False
        self.hold = False
        self.injected: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()
        self.connections = 0
        #: Bytes the server sent to clients (response heads and bodies): what a bucket served.
        self.downloaded = 0
        #: Ranged GETs clients sent (a `Range: bytes=` header in a request head): how many
        #: requests a read of parts of objects took.
        self.ranged_gets = 0
        #: GET and HEAD requests clients sent, by "METHOD /path" (the query left off).
        self.reads: Counter[str] = Counter()
        #: Every request clients sent, by kind (`request_kind`: LIST, GET, HEAD, PUT, POST, DELETE).
        self.requests: Counter[str] = Counter()
        #: Each of them as "KIND target", in order (for messages).
        self.request_log: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True)
        t.start()
        self._threads.append(t)

    # -- control -----------------------------------------------------------------------------

    def _fate(self) -> str:
        with self._lock:
            self.connections += 1
            if self.down:
                self.injected["refused"] += 1
                return "refused"
            if self.budget <= 0:
                return "ok"
            r = self.rng.random()
            for name, w in self.faults.items():
                if r < w:
                    self.budget -= 1
                    self.injected[name] += 1
                    return name
                r -= w
            return "ok"

    def _fire(self, fate: str) -> None:
        with self._lock:
            self.fired[fate] += 1

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=self.stall_s + 2)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the proxy ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            fate = self._fate()
            if fate == "refused":
                _rst(client)
                continue
            t = threading.Thread(target=self._serve, args=(client, fate), name=f"faultproxy-{fate}", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, client: socket.socket, fate: str) -> None:
        try:
            if fate == "503":
                self._answer_503(client)
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _rst(client)
                return
            at = self.rng.randrange(0, self.max_offset) if fate in ("reset", "stall") else None
            self._pump(client, server, fate, at)
        except OSError:
            _rst(client)

    def _answer_503(self, client: socket.socket) -> None:
        client.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                client.close()
                return
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v.strip())
        while len(body) < length:
            chunk = client.recv(min(1 << 20, length - len(body)))
            if not chunk:
                break
            body += chunk
        self._fire("503")
        client.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            + f"Content-Length: {len(SLOWDOWN)}\r\n\r\n".encode()
            + SLOWDOWN
        )
        client.close()

    def _pump(self, client: socket.socket, server: socket.socket, fate: str, at: int | None) -> None:
        moved = 0
        tail = b""  # the end of what the client sent before: a request line may span two reads
        socks = [client, server]
        for s in socks:
            s.setblocking(True)
        try:
            while not self._stop.is_set():
                if self.down:  # the server went away: open connections break too
                    _rst(client)
                    _rst(server)
                    return
                if self.hold:  # a hung server: nothing moves, nothing closes
                    self._stop.wait(0.05)
                    continue
                readable, _, _ = select.select(socks, [], [], 0.1)
                for s in readable:
                    data = s.recv(1 << 16)
                    with self._lock:
                        if s is server:
                            self.downloaded += len(data)
                        else:
                            self.ranged_gets += len(RANGE_HEADER.findall(data))
                            seen = tail + data
                            for m in READ_REQUEST.finditer(seen):
                                if m.end() > len(tail):
                                    self.reads[f"{m[1].decode()} {m[2].decode().split('?')[0]}"] += 1
                            for m in ANY_REQUEST.finditer(seen):
                                if m.end() > len(tail):
                                    kind = request_kind(m[1].decode(), m[2].decode())
                                    self.requests[kind] += 1
                                    self.request_log.append(f"{kind} {m[2].decode()}")
                            tail = seen[-2048:]
                    if not data:
                        client.close()
                        server.close()
                        return
                    if at is not None and moved + len(data) > at:
                        cut = max(0, at - moved)
                        (server if s is client else client).sendall(data[:cut])
                        self._fire(fate)
                        if fate == "stall":
                            self._stop.wait(self.stall_s)
                            client.close()
                            server.close()
                        else:
                            _rst(client)
                            _rst(server)
                        return
                    (server if s is client else client).sendall(data)
                    moved += len(data)
        except OSError:
            _rst(client)
            _rst(server)
        finally:
            for s in socks:
                try:
                    s.close()
                except OSError:
                    pass

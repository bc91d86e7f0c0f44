"""A counting TCP proxy on the peer link, for the worker processes of tests/test_traffic.py and
tests/test_peer_dedup.py: rank 0 learns rank 1's peer address through it (the members round of
the store's open, `tiercel.members.learn`, is spliced on rank 0), so the bytes rank 0's peer
tier sends to rank 1's host are counted at a real socket."""

from __future__ import annotations

import socket
import threading
from typing import Any

import tiercel


class CountingProxy:
    """Forwards connections to `target` ("host:port"), counting the bytes that go towards it."""

    def __init__(self, target: str):
        self.target, self.sent, self.lock = target, 0, threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            c, _ = self.sock.accept()
            h, p = self.target.rsplit(":", 1)
            s = socket.create_connection((h, int(p)))
            threading.Thread(target=self._pipe, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, False), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, count: bool) -> None:
        try:
            while True:
                d = a.recv(1 << 16)
                if not d:
                    break
                if count:
                    with self.lock:
                        self.sent += len(d)
                b.sendall(d)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Splicing:
    """`Splicing.install()` before the Store opens; `Splicing.proxy` then counts what rank 0
    sends to rank 1's peer server (None on other ranks)."""

    proxy: CountingProxy | None = None
    learn = staticmethod(tiercel.members.learn)

    @staticmethod
    def spliced(coordinator: Any, rank: int, value: Any, neighbours: Any) -> Any:
        part = Splicing.learn(coordinator, rank, value, neighbours)
        if rank != 0:
            return part
        members = []
        for index, name, ranks in part.members:
            for i, (r, addr) in enumerate(ranks):
                if r == 1:
                    Splicing.proxy = CountingProxy(addr)
                    ranks = [*ranks[:i], (r, Splicing.proxy.addr), *ranks[i + 1:]]
            members.append((index, name, ranks))
        return part._replace(members=members)

    @staticmethod
    def install() -> None:
        tiercel.members.learn = Splicing.spliced

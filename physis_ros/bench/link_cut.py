"""A TCP proxy whose link can be cut and restored: a link blip between a robot's client and
physis-serve, made on purpose (benchmarks/blip.py, test/serve/test_resume.py).

While cut, every connection through it is dropped (both ends closed, as a network that went
away and a peer that noticed) and new ones are reset at once; ``restore`` lets them through
again. Standard library only.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

CHUNK_BYTES = 1 << 16


class LinkCutProxy:
    """Listens on ``host``:ephemeral (``address``) and forwards each connection to ``target``
    ("host:port") until ``cut``."""

    def __init__(self, target: str, *, host: str = "127.0.0.1") -> None:
        target_host, _, target_port = target.rpartition(":")
        self._target = (target_host, int(target_port))
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self.connections = 0
        """Connections forwarded so far."""
        self._thread = threading.Thread(target=self._accept, name="link-cut-accept", daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Drops every connection now and refuses new ones until ``restore``."""
        with self._lock:
            self._cut = True
            dropped, self._open = self._open, set()
        for sock in dropped:
            _drop(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self.cut()
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=2.0)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refuse = self._cut or self._closed
            if refuse:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5.0)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._cut or self._closed:
                    _reset(client)
                    _reset(upstream)
                    continue
                self._open |= {client, upstream}
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst), name="link-cut-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK_BYTES):
                dst.sendall(data)
        except OSError:
            pass  # cut, or a peer went away
        for sock in (src, dst):
            with self._lock:
                self._open.discard(sock)
            _drop(sock)


def _drop(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _reset(sock: socket.socket) -> None:
    """Closes ``sock`` with a reset (no orderly close): a refused connection."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()

"""An authenticated key/value rendezvous over TCP.

Ranks of a communicator (threads of one process, or processes on one or more
hosts) exchange small descriptors through it while the communicator is being
created.  One rank runs a :class:`StoreServer`; every rank talks to it through
a :class:`StoreClient`.

Wire protocol (version 1).  Every frame is a 4-byte big-endian length followed
by that many bytes.  At connect the server sends ``b"DFSH" + version +
server_nonce``; the client answers ``b"DFSC" + version + client_nonce +
HMAC(secret, "client" label + server_nonce + client_nonce)``; the server
replies ``b"DFSA" + HMAC(secret, "server" label + ...)`` (so the client also
checks the server) or ``b"DFSR" + reason`` and drops the connection.  Both
sides then derive a per-connection session key from the secret and the two
nonces.  Each later frame is ``tag + body`` where ``tag`` is
HMAC-SHA256(session_key, direction + sequence number + body); the implicit
per-direction sequence number rejects replayed, reordered or reflected frames,
and the fresh nonces reject frames replayed from another connection.  A body is
a 4-byte header length, a JSON header and raw value bytes.  Nothing is ever
unpickled.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import math
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable

from dfccl.errors import BackendError, ClosedError, CollectiveTimeoutError, InvalidArgumentError
from dfccl.termination import block_async_signals

__all__ = ["StoreServer", "StoreClient", "StoreUnreachableError", "MAX_FRAME_SIZE", "MAX_KEY_LENGTH", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 1
#: Largest frame either side accepts (tag + header + value).
MAX_FRAME_SIZE = 16 * 1024 * 1024
#: Longest key, in UTF-8 bytes.
MAX_KEY_LENGTH = 4096

_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
_NONCE_LEN = 32
_TAG_LEN = 32
# Handshake frames are tiny; capping them keeps an unauthenticated peer from
# making the server allocate anything sizeable.
_MAX_HANDSHAKE_FRAME = 128
_HELLO = b"DFSH"
_AUTH = b"DFSC"
_ACCEPT = b"DFSA"
_REJECT = b"DFSR"
_REJECT_SECRET = 1
_REJECT_VERSION = 2
_LABEL_CLIENT = b"dfccl-store/v1/client-proof"
_LABEL_SERVER = b"dfccl-store/v1/server-proof"
_LABEL_SESSION = b"dfccl-store/v1/session-key"
_DIR_TO_SERVER = b"C"
_DIR_TO_CLIENT = b"S"

# A peer that connects but never finishes the handshake must not hold a server
# thread forever.
_HANDSHAKE_TIMEOUT = 10.0
# Blocking waits re-check the peer's socket this often so that a client that
# vanished mid-wait releases its server thread early.
_WAIT_SLICE = 0.5
# Upper bound on any server-side wait, whatever a client asks for.
_MAX_WAIT = 7 * 24 * 3600.0
# Extra time a client allows beyond a server-side wait for the reply to arrive.
_RESPONSE_GRACE = 30.0
_MAX_WAIT_KEYS = 65536
_MIN_SECRET_LEN = 16


class StoreUnreachableError(BackendError):
    """The store could not be reached before the connect timeout (refused,
    unreachable, never answered): retrying later may succeed, unlike a
    rejected secret."""


class _ProtocolError(Exception):
    """The peer broke the protocol, closed the connection or failed a tag check."""


class _AuthRejected(Exception):
    """The handshake failed for a reason that retrying cannot fix."""


class _WaitTimedOut(Exception):
    """The server answered a blocking request with a timeout."""

    def __init__(self, missing: list) -> None:
        super().__init__("store wait timed out")
        self.missing = [str(k) for k in missing]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise _ProtocolError("connection closed by peer")
        got += k
    return bytes(buf)


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_frame(sock: socket.socket, limit: int) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    # Checked before allocating, so a hostile length costs nothing.
    if n > limit:
        raise _ProtocolError(f"frame of {n} bytes exceeds the {limit}-byte limit")
    return _recv_exact(sock, n)


def _proof(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


class _Channel:
    """Authenticated framing over an established connection."""

    def __init__(self, sock: socket.socket, key: bytes, send_dir: bytes, recv_dir: bytes) -> None:
        self.sock = sock
        self._key = key
        self._send_dir = send_dir
        self._recv_dir = recv_dir
        self._send_seq = 0
        self._recv_seq = 0

    def _tag(self, direction: bytes, seq: int, body: bytes | memoryview) -> bytes:
        h = hmac.new(self._key, direction + _SEQ.pack(seq), hashlib.sha256)
        h.update(body)
        return h.digest()

    def send(self, body: bytes) -> None:
        tag = self._tag(self._send_dir, self._send_seq, body)
        self._send_seq += 1
        _send_frame(self.sock, tag + body)

    def recv(self) -> bytes:
        frame = _recv_frame(self.sock, MAX_FRAME_SIZE)
        if len(frame) < _TAG_LEN:
            raise _ProtocolError("frame too short to carry an authentication tag")
        view = memoryview(frame)
        expected = self._tag(self._recv_dir, self._recv_seq, view[_TAG_LEN:])
        if not hmac.compare_digest(expected, frame[:_TAG_LEN]):
            raise _ProtocolError("frame failed authentication")
        self._recv_seq += 1
        return frame[_TAG_LEN:]


def _pack_msg(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return _LEN.pack(len(h)) + h + payload


def _unpack_msg(body: bytes) -> tuple[dict, bytes]:
    if len(body) < _LEN.size:
        raise _ProtocolError("message too short")
    (hlen,) = _LEN.unpack_from(body)
    if hlen > len(body) - _LEN.size:
        raise _ProtocolError("message header length out of range")
    try:
        header = json.loads(body[_LEN.size : _LEN.size + hlen].decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise _ProtocolError(f"malformed message header: {e}") from None
    if not isinstance(header, dict):
        raise _ProtocolError("message header is not an object")
    return header, body[_LEN.size + hlen :]


def _key_error(key: object) -> str | None:
    """Why ``key`` is not a valid store key, or None when it is."""
    if not isinstance(key, str):
        return f"store keys must be str, not {type(key).__name__}"
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "store key is not encodable as UTF-8"
    if n == 0:
        return "store keys must not be empty"
    if n > MAX_KEY_LENGTH:
        return f"store key is {n} bytes long; the limit is {MAX_KEY_LENGTH}"
    return None


def _check_key(key: object) -> str:
    why = _key_error(key)
    if why is not None:
        raise InvalidArgumentError(why)
    return key  # type: ignore[return-value]


def _check_timeout(timeout: object, name: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number of seconds, not {type(timeout).__name__}")
    t = float(timeout)
    if not math.isfinite(t) or t < 0:
        raise InvalidArgumentError(f"{name} must be finite and >= 0, got {timeout!r}")
    return t


def _check_amount(amount: object) -> int:
    # Bounded so that a counter can never grow into an unparseable number.
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise InvalidArgumentError(f"amount must be an int, not {type(amount).__name__}")
    if not -(2**63) <= amount < 2**63:
        raise InvalidArgumentError(f"amount must fit in a signed 64-bit integer, got {amount}")
    return amount


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"store secret must be bytes, not {type(secret).__name__}")
    secret = bytes(secret)
    if len(secret) < _MIN_SECRET_LEN:
        raise InvalidArgumentError(f"store secret must be at least {_MIN_SECRET_LEN} bytes long")
    return secret


def _check_port(port: object, *, allow_zero: bool) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise InvalidArgumentError(f"port must be an int, not {type(port).__name__}")
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise InvalidArgumentError(f"port must be in [{low}, 65535], got {port}")
    return port


def _format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    if host in ("", "0.0.0.0"):
        return socket.create_server(("", port), family=socket.AF_INET, backlog=1024)
    if host == "::":
        dual = socket.has_dualstack_ipv6()
        return socket.create_server(("::", port), family=socket.AF_INET6, backlog=1024, dualstack_ipv6=dual)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def _peer_gone(sock: socket.socket) -> bool:
    """True when a client in the middle of a blocking request has hung up.

    The protocol is strictly request/response, so any readable byte while a
    request is pending is either EOF or a protocol violation: both end it.
    """
    try:
        sock.settimeout(0.0)
        try:
            sock.recv(1, socket.MSG_PEEK)
        finally:
            sock.settimeout(None)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return True


class StoreServer:
    """Serves a key/value store to authenticated :class:`StoreClient` s.

    ``host`` is the address to bind (default ``"127.0.0.1"``, loopback only;
    give a routable address, or ``""``/``"0.0.0.0"`` for every interface, when
    clients on other hosts must reach it).  ``secret`` is the shared secret
    every client must prove it knows (at least 16 bytes).  ``port=0`` picks an
    ephemeral port; read it back from :attr:`port`.

    An accept thread and one thread per connection run as daemon threads.
    :meth:`close` is idempotent; the server is also a context manager.
    """

    def __init__(self, host: str | None = "127.0.0.1", secret: bytes | None = None, port: int = 0) -> None:
        if secret is None:
            raise InvalidArgumentError("StoreServer needs a shared secret")
        self._secret = _check_secret(secret)
        if host is None:
            host = "127.0.0.1"
        if not isinstance(host, str):
            raise InvalidArgumentError(f"host must be a str, not {type(host).__name__}")
        port = _check_port(port, allow_zero=True)

        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._conns_lock = threading.Lock()
        # A forked child inherits the sockets but not the threads; its close()
        # must not shut down or wake anything the parent still uses.
        self._pid = os.getpid()

        try:
            self._listener = _listen(host, port)
        except OSError as e:
            raise BackendError(f"could not start the store server on {_format_addr(host, port)}: {e}") from e
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._listener.setblocking(False)
        # Wakes the accept loop on close(); closing a socket another thread is
        # blocked on does not reliably wake it.
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"dfccl-store-accept-{self._port}", daemon=True
        )
        self._accept_thread.start()

    @property
    def host(self) -> str:
        """The address the server is bound to."""
        return self._host

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return self._port

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<StoreServer {_format_addr(self._host, self._port)} {state}>"

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, drop every connection and wake blocked waits."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if os.getpid() != self._pid:
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()
            return
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._accept_thread is not threading.current_thread():
            self._accept_thread.join(timeout=5.0)
        with self._conns_lock:
            for conn in self._conns:
                # Shutdown (not close) wakes a handler blocked in recv; the
                # handler closes its own socket, so no descriptor is reused
                # under it.
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        me = threading.current_thread()
        deadline = time.monotonic() + 5.0
        for t in threads:
            if t is not me:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        for s in (self._listener, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    # -- accepting ----------------------------------------------------------

    def _accept_loop(self) -> None:
        block_async_signals()
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r or self._closed:
                        return
                    self._accept_one()
        except OSError:
            # The listener failed (or was closed under us); nothing more to accept.
            pass
        finally:
            sel.close()

    def _accept_one(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:
            if self._closed:
                return
            # Out of descriptors and the like: back off instead of spinning,
            # and keep serving the clients already connected.
            time.sleep(0.1 if e.errno in (errno.EMFILE, errno.ENFILE) else 0.01)
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Lets the kernel notice a client host that vanished without a reset.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError:
            pass
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        t = threading.Thread(target=self._serve_conn, args=(conn,), name=f"dfccl-store-conn-{self._port}", daemon=True)
        with self._conns_lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
            self._threads.add(t)
        t.start()

    # -- one connection -----------------------------------------------------

    def _serve_conn(self, conn: socket.socket) -> None:
        block_async_signals()
        try:
            channel = self._handshake(conn)
            if channel is None:
                return
            conn.settimeout(None)
            while not self._closed:
                header, payload = _unpack_msg(channel.recv())
                reply = self._dispatch(header, payload, conn)
                if reply is None:
                    return
                channel.send(_pack_msg(*reply))
        except (OSError, _ProtocolError):
            # Abrupt disconnects, tampered frames and oversized frames all end
            # the connection; the client sees it as a lost connection.
            pass
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            try:
                conn.close()
            except OSError:
                pass

    def _handshake(self, conn: socket.socket) -> _Channel | None:
        server_nonce = secrets.token_bytes(_NONCE_LEN)
        _send_frame(conn, _HELLO + bytes([PROTOCOL_VERSION]) + server_nonce)
        msg = _recv_frame(conn, _MAX_HANDSHAKE_FRAME)
        if len(msg) < 5 or msg[:4] != _AUTH:
            return None
        if msg[4] != PROTOCOL_VERSION:
            _send_frame(conn, _REJECT + bytes([_REJECT_VERSION, PROTOCOL_VERSION]))
            return None
        if len(msg) != 5 + _NONCE_LEN + _TAG_LEN:
            return None
        client_nonce = msg[5 : 5 + _NONCE_LEN]
        proof = msg[5 + _NONCE_LEN :]
        expected = _proof(self._secret, _LABEL_CLIENT, server_nonce, client_nonce)
        # A client echoing our own nonce back could be reflecting a handshake.
        if client_nonce == server_nonce or not hmac.compare_digest(proof, expected):
            _send_frame(conn, _REJECT + bytes([_REJECT_SECRET, PROTOCOL_VERSION]))
            return None
        _send_frame(conn, _ACCEPT + _proof(self._secret, _LABEL_SERVER, server_nonce, client_nonce))
        key = _proof(self._secret, _LABEL_SESSION, server_nonce, client_nonce)
        return _Channel(conn, key, send_dir=_DIR_TO_CLIENT, recv_dir=_DIR_TO_SERVER)

    def _dispatch(self, header: dict, payload: bytes, conn: socket.socket) -> tuple[dict, bytes] | None:
        """Runs one request; returns the reply, or None to drop the connection."""
        op = header.get("op")
        try:
            if op == "set":
                key = self._req_key(header)
                with self._cond:
                    self._data[key] = payload
                    self._cond.notify_all()
                return {"ok": True}, b""
            if op == "get":
                key = self._req_key(header)
                status, values = self._wait_for([key], self._req_timeout(header), conn)
                if status == "ok":
                    return {"ok": True}, values[0]
                if status == "timeout":
                    return {"ok": False, "error": "timeout", "missing": [key]}, b""
                return None
            if op == "wait":
                keys = header.get("keys")
                if not isinstance(keys, list) or len(keys) > _MAX_WAIT_KEYS:
                    raise InvalidArgumentError(f"'keys' must be a list of at most {_MAX_WAIT_KEYS} keys")
                for k in keys:
                    _check_key(k)
                status, values = self._wait_for(keys, self._req_timeout(header), conn)
                if status == "ok":
                    return {"ok": True}, b""
                if status == "timeout":
                    with self._cond:
                        missing = [k for k in keys if k not in self._data]
                    return {"ok": False, "error": "timeout", "missing": missing[:16]}, b""
                return None
            if op == "add":
                key = self._req_key(header)
                amount = header.get("amount")
                _check_amount(amount)
                with self._cond:
                    old = self._data.get(key, b"0")
                    try:
                        value = int(old.decode("ascii")) + amount
                    except ValueError:
                        raise InvalidArgumentError(f"store key {key!r} does not hold an integer counter") from None
                    self._data[key] = str(value).encode("ascii")
                    self._cond.notify_all()
                return {"ok": True, "value": value}, b""
            if op == "delete":
                key = self._req_key(header)
                with self._cond:
                    existed = self._data.pop(key, None) is not None
                return {"ok": True, "existed": existed}, b""
            raise InvalidArgumentError(f"unknown store operation {op!r}")
        except InvalidArgumentError as e:
            return {"ok": False, "error": "invalid", "message": str(e)}, b""

    @staticmethod
    def _req_key(header: dict) -> str:
        return _check_key(header.get("key"))

    @staticmethod
    def _req_timeout(header: dict) -> float:
        return min(_check_timeout(header.get("timeout")), _MAX_WAIT)

    def _wait_for(self, keys: list[str], timeout: float, conn: socket.socket) -> tuple[str, list[bytes]]:
        """Waits until every key exists: ("ok", values), ("timeout", []) or
        ("abandon", []) when the server closes or the client hangs up."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return "abandon", []
                if all(k in self._data for k in keys):
                    return "ok", [self._data[k] for k in keys]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout", []
                self._cond.wait(min(remaining, _WAIT_SLICE))
                if _peer_gone(conn):
                    return "abandon", []


class StoreClient:
    """A connection to a :class:`StoreServer`.

    Connecting retries with backoff for up to ``timeout`` seconds while the
    server is not yet listening, then raises :class:`BackendError`.  A wrong
    secret raises :class:`BackendError` at once.  ``timeout`` is also the
    default for :meth:`get` and :meth:`wait`.

    Use one client from one thread at a time: requests are serialized by an
    internal lock, so a blocking :meth:`get` would stall every other thread's
    request on the same client.  Give each thread its own client instead.
    After an I/O failure the client is unusable; make a new one.
    """

    def __init__(self, host: str, port: int, secret: bytes, *, timeout: float = 300.0) -> None:
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError("store host must be a non-empty str")
        self._host = host
        self._port = _check_port(port, allow_zero=False)
        self._secret = _check_secret(secret)
        self._timeout = _check_timeout(timeout)
        self._addr = _format_addr(host, self._port)
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._channel = self._connect()

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def timeout(self) -> float:
        return self._timeout

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"<StoreClient {self._addr} {state}>"

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connecting ---------------------------------------------------------

    def _connect(self) -> _Channel:
        deadline = time.monotonic() + self._timeout
        delay = 0.02
        while True:
            remaining = deadline - time.monotonic()
            sock = None
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(remaining, 0.05))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(max(min(deadline - time.monotonic(), _HANDSHAKE_TIMEOUT), 1.0))
                return self._handshake(sock)
            except _AuthRejected as e:
                sock.close()  # type: ignore[union-attr]
                raise BackendError(f"store authentication failed for {self._addr}: {e}") from None
            except (OSError, _ProtocolError) as e:
                # Refused (server not up yet), reset, unreachable, DNS not
                # ready: all may clear up, so retry until the deadline.
                if sock is not None:
                    sock.close()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreUnreachableError(
                        f"could not connect to the store at {self._addr} within {self._timeout:g} s: {e}"
                    ) from e
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    def _handshake(self, sock: socket.socket) -> _Channel:
        hello = _recv_frame(sock, _MAX_HANDSHAKE_FRAME)
        if len(hello) != 5 + _NONCE_LEN or hello[:4] != _HELLO:
            raise _AuthRejected("the peer is not a dfccl store server")
        if hello[4] != PROTOCOL_VERSION:
            raise _AuthRejected(f"server speaks store protocol {hello[4]}, this client speaks {PROTOCOL_VERSION}")
        server_nonce = hello[5:]
        client_nonce = secrets.token_bytes(_NONCE_LEN)
        proof = _proof(self._secret, _LABEL_CLIENT, server_nonce, client_nonce)
        _send_frame(sock, _AUTH + bytes([PROTOCOL_VERSION]) + client_nonce + proof)
        reply = _recv_frame(sock, _MAX_HANDSHAKE_FRAME)
        if reply[:4] == _REJECT:
            if len(reply) >= 5 and reply[4] == _REJECT_VERSION:
                raise _AuthRejected("the server rejected this client's protocol version")
            raise _AuthRejected("the server rejected the shared secret")
        expected = _proof(self._secret, _LABEL_SERVER, server_nonce, client_nonce)
        if len(reply) != 4 + _TAG_LEN or reply[:4] != _ACCEPT or not hmac.compare_digest(reply[4:], expected):
            raise _AuthRejected("the server did not prove knowledge of the shared secret")
        key = _proof(self._secret, _LABEL_SESSION, server_nonce, client_nonce)
        return _Channel(sock, key, send_dir=_DIR_TO_SERVER, recv_dir=_DIR_TO_CLIENT)

    # -- requests -----------------------------------------------------------

    def _request(self, header: dict, payload: bytes = b"", *, io_timeout: float) -> tuple[dict, bytes]:
        body = _pack_msg(header, payload)
        if len(body) + _TAG_LEN > MAX_FRAME_SIZE:
            raise InvalidArgumentError(
                f"store {header['op']} request of {len(body) + _TAG_LEN} bytes exceeds "
                f"the {MAX_FRAME_SIZE}-byte frame limit"
            )
        with self._lock:
            if self._closed:
                raise ClosedError(f"store client for {self._addr} is closed")
            if self._broken is not None:
                raise BackendError(
                    f"store connection to {self._addr} is unusable after an earlier failure: {self._broken}"
                )
            sock = self._channel.sock
            try:
                sock.settimeout(io_timeout)
                self._channel.send(body)
                reply, value = _unpack_msg(self._channel.recv())
            except (OSError, _ProtocolError) as e:
                if self._closed:
                    raise ClosedError(f"store client for {self._addr} was closed during {header['op']}") from None
                self._broken = str(e) or type(e).__name__
                try:
                    sock.close()
                except OSError:
                    pass
                raise BackendError(f"store {header['op']} at {self._addr} failed: {self._broken}") from e
        if reply.get("ok") is True:
            return reply, value
        error = reply.get("error")
        if error == "invalid":
            raise InvalidArgumentError(f"store at {self._addr} rejected the request: {reply.get('message')}")
        if error == "timeout":
            # The caller turns this into a message naming the key.
            raise _WaitTimedOut(reply.get("missing") or [])
        raise BackendError(f"store at {self._addr} answered {header['op']} with an unexpected reply")

    def _wait_timeout(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else _check_timeout(timeout)

    def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key``, replacing any earlier value."""
        _check_key(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"store values must be bytes, not {type(value).__name__}")
        self._request({"op": "set", "key": key}, bytes(value), io_timeout=self._io_timeout())

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Returns the value of ``key``, waiting up to ``timeout`` seconds
        (default: the client's timeout) for another rank to set it.

        Raises :class:`CollectiveTimeoutError` when the key does not appear in time.
        """
        _check_key(key)
        t = self._wait_timeout(timeout)
        try:
            _, value = self._request({"op": "get", "key": key, "timeout": t}, io_timeout=t + _RESPONSE_GRACE)
        except _WaitTimedOut:
            raise CollectiveTimeoutError(
                f"timed out after {t:g} s waiting for key {key!r} in the store at {self._addr}"
            ) from None
        return value

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Waits until every key in ``keys`` exists.

        Raises :class:`CollectiveTimeoutError` naming the missing keys when
        ``timeout`` (default: the client's timeout) passes first.
        """
        if isinstance(keys, str):
            raise InvalidArgumentError("wait() takes a list of keys, not a single str")
        keys = [_check_key(k) for k in keys]
        if len(keys) > _MAX_WAIT_KEYS:
            raise InvalidArgumentError(f"wait() takes at most {_MAX_WAIT_KEYS} keys")
        t = self._wait_timeout(timeout)
        if not keys:
            return
        try:
            self._request({"op": "wait", "keys": keys, "timeout": t}, io_timeout=t + _RESPONSE_GRACE)
        except _WaitTimedOut as e:
            missing = ", ".join(repr(k) for k in e.missing) or "?"
            raise CollectiveTimeoutError(
                f"timed out after {t:g} s waiting for keys in the store at {self._addr}; missing: {missing}"
            ) from None

    def add(self, key: str, amount: int) -> int:
        """Atomically adds ``amount`` (a signed 64-bit int) to the integer
        counter ``key`` (missing counts as 0) and returns the new value.  The counter is stored as
        ASCII decimal, so :meth:`get` returns e.g. ``b"3"``."""
        _check_key(key)
        _check_amount(amount)
        reply, _ = self._request({"op": "add", "key": key, "amount": amount}, io_timeout=self._io_timeout())
        value = reply.get("value")
        if isinstance(value, bool) or not isinstance(value, int):
            raise BackendError(f"store at {self._addr} answered add with a malformed reply")
        return value

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it existed."""
        _check_key(key)
        reply, _ = self._request({"op": "delete", "key": key}, io_timeout=self._io_timeout())
        return bool(reply.get("existed"))

    def _io_timeout(self) -> float:
        # Non-blocking requests still must not hang forever on a dead server.
        return max(self._timeout, 1.0)

    def close(self) -> None:
        """Closes the connection.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        sock = self._channel.sock
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass


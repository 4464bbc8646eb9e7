"""Tests for the TCP rendezvous store and UniqueId (loopback only)."""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import pickle
import secrets
import socket
import struct
import sys
import threading
import time
import types

import pytest

def _import_modules():
    """Imports dfccl.store and dfccl.unique_id from the installed dfccl (any
    kind of install), falling back to a bare package over the installed
    sources when the package ``__init__`` cannot be imported here (no
    compiled extensions): these modules are pure Python."""
    names = ("dfccl.errors", "dfccl.store", "dfccl.unique_id")
    try:
        return [importlib.import_module(n) for n in names]
    except Exception:
        spec = importlib.util.find_spec("dfccl")   # locates the package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            raise
        for name in list(sys.modules):
            if name == "dfccl" or name.startswith("dfccl."):
                del sys.modules[name]
        pkg = types.ModuleType("dfccl")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["dfccl"] = pkg
        return [importlib.import_module(n) for n in names]


errors, store, unique_id = _import_modules()
StoreServer = store.StoreServer
StoreClient = store.StoreClient
UniqueId = unique_id.UniqueId
BackendError = errors.BackendError
ClosedError = errors.ClosedError
CollectiveTimeoutError = errors.CollectiveTimeoutError
InvalidArgumentError = errors.InvalidArgumentError

HOST = "127.0.0.1"


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def server(secret):
    with StoreServer(HOST, secret) as srv:
        yield srv


def _client(server, secret, timeout=5.0):
    return StoreClient(server.host, server.port, secret, timeout=timeout)


def _assert_closed_by_peer(sock: socket.socket, within: float = 3.0) -> None:
    """The peer must close ``sock`` without sending anything more."""
    sock.settimeout(within)
    try:
        data = sock.recv(4096)
    except ConnectionResetError:
        return
    except socket.timeout:
        pytest.fail("server kept the connection open")
    assert data == b""


def _raw_frame(channel, body: bytes, seq: int) -> bytes:
    tag = channel._tag(store._DIR_TO_SERVER, seq, body)
    return struct.pack("!I", len(tag) + len(body)) + tag + body


# -- store basics -------------------------------------------------------------


def test_set_get_across_threads(server, secret):
    got = {}

    def writer():
        with _client(server, secret) as c:
            c.set("a", b"alpha")
            c.set("b", bytes(range(256)))

    def reader():
        with _client(server, secret) as c:
            got["a"] = c.get("a", timeout=5)
            got["b"] = c.get("b", timeout=5)

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {"a": b"alpha", "b": bytes(range(256))}


def test_get_blocks_until_set(server, secret):
    def late_writer():
        time.sleep(0.3)
        with _client(server, secret) as c:
            c.set("late", b"here")

    t = threading.Thread(target=late_writer)
    with _client(server, secret) as c:
        start = time.monotonic()
        t.start()
        assert c.get("late", timeout=10) == b"here"
        elapsed = time.monotonic() - start
    t.join(5)
    assert 0.25 <= elapsed < 5


def test_get_timeout(server, secret):
    with _client(server, secret) as c:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            c.get("never", timeout=0.2)
        elapsed = time.monotonic() - start
        assert 0.15 <= elapsed < 2
        msg = str(info.value)
        assert "'never'" in msg and f"{HOST}:{server.port}" in msg
        # The connection stays usable after a timeout.
        c.set("k", b"v")
        assert c.get("k", timeout=1) == b"v"


def test_wait_add_delete(server, secret):
    with _client(server, secret) as c:
        c.set("x", b"1")
        c.set("y", b"")
        c.wait(["x", "y"], timeout=1)
        with pytest.raises(CollectiveTimeoutError, match="'z'"):
            c.wait(["x", "z"], timeout=0.2)
        assert c.add("n", 5) == 5
        assert c.add("n", -2) == 3
        with pytest.raises(InvalidArgumentError):
            c.add("n", 2**63)
        with pytest.raises(InvalidArgumentError):
            c.add("n", True)
        assert c.get("n") == b"3"
        with pytest.raises(InvalidArgumentError):
            c.add("y", 1)  # b"" is not an integer counter
        assert c.delete("x") is True
        assert c.delete("x") is False
        with pytest.raises(CollectiveTimeoutError):
            c.get("x", timeout=0.05)
        with pytest.raises(InvalidArgumentError):
            c.set("", b"v")
        with pytest.raises(InvalidArgumentError):
            c.set("k", "not bytes")
        with pytest.raises(InvalidArgumentError):
            c.get("k", timeout=-1)


def test_add_is_atomic(server, secret):
    def worker():
        with _client(server, secret) as c:
            for _ in range(100):
                c.add("counter", 1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    with _client(server, secret) as c:
        assert c.get("counter") == b"800"
        assert c.add("counter", 0) == 800


# -- authentication and framing ----------------------------------------------


def test_wrong_secret_rejected(server, secret):
    start = time.monotonic()
    with pytest.raises(BackendError, match="store authentication failed") as info:
        StoreClient(HOST, server.port, secrets.token_bytes(32), timeout=5)
    # Rejected at once, not after connect retries.
    assert time.monotonic() - start < 2
    assert secret.hex() not in str(info.value)
    with _client(server, secret) as c:
        c.set("still", b"works")
        assert c.get("still") == b"works"


def test_client_rejects_impostor_server(secret):
    # A server that accepts every client but cannot prove it knows the secret.
    with socket.create_server((HOST, 0)) as listener:
        port = listener.getsockname()[1]

        def impostor():
            conn, _ = listener.accept()
            with conn:
                hello = b"DFSH" + bytes([store.PROTOCOL_VERSION]) + secrets.token_bytes(32)
                conn.sendall(struct.pack("!I", len(hello)) + hello)
                (n,) = struct.unpack("!I", conn.recv(4))
                conn.recv(n)
                accept = b"DFSA" + secrets.token_bytes(32)
                conn.sendall(struct.pack("!I", len(accept)) + accept)
                conn.recv(1)

        t = threading.Thread(target=impostor)
        t.start()
        with pytest.raises(BackendError, match="did not prove knowledge"):
            StoreClient(HOST, port, secret, timeout=2)
        t.join(5)


def test_oversized_frame_rejected_before_auth(server):
    with socket.create_connection((HOST, server.port), timeout=3) as sock:
        (n,) = struct.unpack("!I", sock.recv(4))
        assert n < 128
        sock.recv(n)
        sock.sendall(struct.pack("!I", 1 << 20))
        _assert_closed_by_peer(sock)


def test_oversized_frame_rejected_after_auth(server, secret):
    with _client(server, secret) as c:
        with pytest.raises(InvalidArgumentError, match="frame limit"):
            c.set("big", bytes(store.MAX_FRAME_SIZE))
        c.set("small", b"ok")  # checked before sending: still usable
        c._channel.sock.sendall(struct.pack("!I", store.MAX_FRAME_SIZE + 1))
        _assert_closed_by_peer(c._channel.sock)
    with _client(server, secret) as c:
        assert c.get("small") == b"ok"
        with pytest.raises(CollectiveTimeoutError):
            c.get("big", timeout=0.05)


def test_replayed_frame_rejected(server, secret):
    with _client(server, secret) as c:
        ch = c._channel
        body = store._pack_msg({"op": "add", "key": "replay", "amount": 1})
        frame = _raw_frame(ch, body, ch._send_seq)
        ch._send_seq += 1
        ch.sock.sendall(frame)
        reply, _ = store._unpack_msg(ch.recv())
        assert reply == {"ok": True, "value": 1}
        ch.sock.sendall(frame)  # same bytes again: stale sequence number
        _assert_closed_by_peer(ch.sock)
    with _client(server, secret) as c:
        assert c.get("replay") == b"1"


def test_tampered_frame_rejected(server, secret):
    with _client(server, secret) as c:
        ch = c._channel
        body = store._pack_msg({"op": "set", "key": "t"}, b"good")
        frame = bytearray(_raw_frame(ch, body, ch._send_seq))
        frame[-1] ^= 1
        ch.sock.sendall(bytes(frame))
        _assert_closed_by_peer(ch.sock)
    with _client(server, secret) as c:
        with pytest.raises(CollectiveTimeoutError):
            c.get("t", timeout=0.05)


# -- connection lifecycle -----------------------------------------------------


def test_connect_refused_times_out(secret):
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(BackendError, match=f"{HOST}:{port}"):
        StoreClient(HOST, port, secret, timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 3


def test_connect_retries_until_server_starts(secret):
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    result = {}

    def connect():
        try:
            with StoreClient(HOST, port, secret, timeout=5) as c:
                result["value"] = c.get("k", timeout=5)
        except Exception as e:  # reported below
            result["error"] = e

    t = threading.Thread(target=connect)
    t.start()
    time.sleep(0.3)
    with StoreServer(HOST, secret, port) as srv:
        with _client(srv, secret) as c:
            c.set("k", b"v")
        t.join(10)
    assert result == {"value": b"v"}


def test_abrupt_disconnect_releases_server_thread(server, secret):
    c = _client(server, secret)
    outcome = {}

    def blocked_get():
        try:
            c.get("missing", timeout=8)
        except Exception as e:
            outcome["error"] = e

    t = threading.Thread(target=blocked_get)
    t.start()
    time.sleep(0.2)
    c.close()
    t.join(5)
    assert isinstance(outcome.get("error"), ClosedError)
    deadline = time.monotonic() + 3
    while server._threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server._threads
    with _client(server, secret) as c2:
        c2.set("alive", b"1")


def test_server_close_wakes_blocked_get(secret):
    srv = StoreServer(HOST, secret)
    c = _client(srv, secret)
    outcome = {}

    def blocked_get():
        try:
            c.get("missing", timeout=8)
        except Exception as e:
            outcome["error"] = e

    t = threading.Thread(target=blocked_get)
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    srv.close()
    t.join(5)
    assert time.monotonic() - start < 3
    assert isinstance(outcome.get("error"), BackendError)
    with pytest.raises(BackendError, match="unusable"):
        c.set("k", b"v")
    c.close()


def test_close_idempotent(secret):
    srv = StoreServer(HOST, secret)
    c = _client(srv, secret)
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.get("k", timeout=0.1)
    srv.close()
    srv.close()
    assert srv.closed

    uid = UniqueId.create()
    assert uid.owns_server
    uid.close()
    uid.close()
    assert not uid.owns_server
    with pytest.raises(BackendError):
        uid.connect(timeout=0.2)


def test_server_rejects_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        StoreServer(HOST)
    with pytest.raises(InvalidArgumentError):
        StoreServer(HOST, b"short")
    with pytest.raises(InvalidArgumentError):
        StoreServer(HOST, secrets.token_bytes(32), port=70000)


# -- UniqueId -----------------------------------------------------------------


def test_unique_id_round_trips():
    uid = UniqueId.create()
    try:
        assert uid.host == HOST and 0 < uid.port < 65536
        assert len(uid.secret) == 32 and len(uid.uid) == 16
        b = uid.to_bytes()
        assert b.startswith(b"DFID")
        assert UniqueId.from_bytes(b) == uid
        s = uid.to_string()
        assert str(uid) == s and "=" not in s
        assert UniqueId.from_string(s) == uid
        copy = pickle.loads(pickle.dumps(uid))
        assert copy == uid and hash(copy) == hash(uid)
        assert copy.secret == uid.secret and copy.uid == uid.uid
        r = repr(uid)
        assert uid.secret.hex() not in r and s not in r and uid.uid.hex() in r
        assert uid.comm_key() == copy.comm_key()
        assert 0 < uid.comm_key() < 2**63

        other = UniqueId.create()
        try:
            assert other != uid and other.comm_key() != uid.comm_key()
        finally:
            other.close()

        with uid.connect(timeout=5) as a, copy.connect(timeout=5) as b2:
            a.set("k", b"v")
            assert b2.get("k", timeout=2) == b"v"
    finally:
        uid.close()


def test_unique_id_malformed():
    good = UniqueId("127.0.0.1", 1234, bytes(32), bytes(16)).to_bytes()
    bad_inputs = [
        b"",
        good[:10],
        good[:-1],
        good + b"x",
        b"XXID" + good[4:],
        good[:4] + bytes([99]) + good[5:],
        good[:-9] + b"\xff" * 9,  # host not UTF-8
    ]
    # Port 0 and an empty host are not valid either.
    head = struct.Struct("!4sB16s32sHB")
    bad_inputs.append(head.pack(b"DFID", 1, bytes(16), bytes(32), 0, 1) + b"h")
    bad_inputs.append(head.pack(b"DFID", 1, bytes(16), bytes(32), 80, 0))
    for data in bad_inputs:
        with pytest.raises(InvalidArgumentError):
            UniqueId.from_bytes(data)
    for s in ["", "!!!", "a", "ab cd", UniqueId.from_bytes(good).to_string()[:-3] + "$$$"]:
        with pytest.raises(InvalidArgumentError):
            UniqueId.from_string(s)
    with pytest.raises(InvalidArgumentError):
        UniqueId.from_bytes("not bytes")
    with pytest.raises(InvalidArgumentError):
        UniqueId("127.0.0.1", 1234, bytes(31), bytes(16))
    assert UniqueId.from_bytes(good).to_bytes() == good


def test_unique_id_honors_bootstrap_host_env(monkeypatch):
    monkeypatch.setenv(unique_id.BOOTSTRAP_HOST_ENV, "127.0.0.1")
    uid = UniqueId.create()
    try:
        assert uid.host == "127.0.0.1"
    finally:
        uid.close()


def _child_main(uid, key: str) -> None:
    with uid.connect(timeout=20) as c:
        c.set(key, b"from child, owns_server=%d" % uid.owns_server)


def test_unique_id_in_spawned_child():
    uid = UniqueId.create()
    try:
        mp_context = multiprocessing.get_context("spawn")
        p = mp_context.Process(target=_child_main, args=(uid, "child-key"))
        p.start()
        try:
            with uid.connect(timeout=5) as c:
                assert c.get("child-key", timeout=30) == b"from child, owns_server=0"
        finally:
            p.join(30)
        assert p.exitcode == 0
    finally:
        uid.close()

"""``dfccl.UniqueId``: the token ranks share to create one communicator.

One rank calls :meth:`UniqueId.create`, which starts a :class:`StoreServer`
in its process, and hands the id to the other ranks (pickled through
multiprocessing, or as a string in an environment variable).  Every rank then
calls :meth:`UniqueId.connect` to reach the store.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import os
import re
import secrets
import socket
import struct
import threading

from dfccl.errors import InvalidArgumentError
from dfccl.store import StoreClient, StoreServer

__all__ = ["UniqueId", "BOOTSTRAP_HOST_ENV"]

#: Environment variable naming the address :meth:`UniqueId.create` binds and
#: advertises when no ``host`` is given.
BOOTSTRAP_HOST_ENV = "DFCCL_BOOTSTRAP_HOST"

_MAGIC = b"DFID"
_VERSION = 1
_UID_LEN = 16
_SECRET_LEN = 32
_MAX_HOST_LEN = 255
# magic, version, uid, secret, port, host length; the host bytes follow.
_HEAD = struct.Struct(f"!4sB{_UID_LEN}s{_SECRET_LEN}sHB")
_B64_RE = re.compile(r"[A-Za-z0-9_-]+")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")

# Servers started by UniqueId.create() in this process, keyed by the id's
# encoding.  Holding them here keeps them alive whatever happens to the
# UniqueId objects, until close() or interpreter exit.
_servers: dict[bytes, StoreServer] = {}
_servers_lock = threading.Lock()


def _close_all_servers() -> None:
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.close()


def _forget_servers_in_child() -> None:
    # A forked child does not own its parent's servers; the lock is replaced
    # because another thread may have held it at the fork.
    global _servers_lock
    _servers_lock = threading.Lock()
    _servers.clear()


atexit.register(_close_all_servers)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_servers_in_child)


def _check_host(host: object) -> str:
    if not isinstance(host, str):
        raise InvalidArgumentError(f"UniqueId host must be a str, not {type(host).__name__}")
    try:
        n = len(host.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgumentError("UniqueId host is not encodable as UTF-8") from None
    if n == 0 or n > _MAX_HOST_LEN:
        raise InvalidArgumentError(f"UniqueId host must be 1 to {_MAX_HOST_LEN} bytes long, got {n}")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise InvalidArgumentError(f"UniqueId host {host!r} contains whitespace or control characters")
    return host


def _from_bytes(data: bytes) -> UniqueId:
    return UniqueId.from_bytes(data)


class UniqueId:
    """Address, shared secret and communicator uid of one rendezvous store.

    Attributes: ``host`` and ``port`` (where the store listens), ``secret``
    (32 bytes; anyone holding it can join, so treat the id as a credential),
    ``uid`` (16 random bytes naming the communicator).

    Ids compare and hash by their encoding.  Pickling carries the id only: a
    receiving process can connect but does not own the server.
    """

    __slots__ = ("_host", "_port", "_secret", "_uid", "_encoded")

    def __init__(self, host: str, port: int, secret: bytes, uid: bytes) -> None:
        self._host = _check_host(host)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgumentError(f"UniqueId port must be an int in [1, 65535], got {port!r}")
        self._port = port
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != _SECRET_LEN:
            raise InvalidArgumentError(f"UniqueId secret must be {_SECRET_LEN} bytes")
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != _UID_LEN:
            raise InvalidArgumentError(f"UniqueId uid must be {_UID_LEN} bytes")
        self._secret = bytes(secret)
        self._uid = bytes(uid)
        host_bytes = self._host.encode("utf-8")
        self._encoded = (
            _HEAD.pack(_MAGIC, _VERSION, self._uid, self._secret, self._port, len(host_bytes)) + host_bytes
        )

    @classmethod
    def create(cls, *, host: str | None = None, port: int = 0) -> UniqueId:
        """Starts a store server in this process and returns its id.

        ``host`` is the address to bind and advertise; without it the
        ``DFCCL_BOOTSTRAP_HOST`` environment variable is used, else
        ``"127.0.0.1"``, which only ranks on this host can reach.  For ranks on
        other hosts give an address they can route to.  A wildcard
        (``"0.0.0.0"``, ``"::"``) binds every interface and advertises this
        machine's host name.

        The server keeps running until :meth:`close` or interpreter exit.
        """
        if host is None:
            host = os.environ.get(BOOTSTRAP_HOST_ENV, "").strip() or "127.0.0.1"
        if not isinstance(host, str):
            raise InvalidArgumentError(f"host must be a str, not {type(host).__name__}")
        secret = secrets.token_bytes(_SECRET_LEN)
        uid = secrets.token_bytes(_UID_LEN)
        server = StoreServer(host, secret, port)
        try:
            advertised = socket.gethostname() if host in _WILDCARD_HOSTS else host
            ident = cls(advertised, server.port, secret, uid)
        except BaseException:
            server.close()
            raise
        with _servers_lock:
            _servers[ident._encoded] = server
        return ident

    # -- attributes ---------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def uid(self) -> bytes:
        return self._uid

    @property
    def owns_server(self) -> bool:
        """Whether this process runs the store server of this id."""
        with _servers_lock:
            return self._encoded in _servers

    # -- encodings ----------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Compact versioned binary encoding (includes the secret)."""
        return self._encoded

    @classmethod
    def from_bytes(cls, data: bytes) -> UniqueId:
        """Decodes :meth:`to_bytes`; raises :class:`InvalidArgumentError` on malformed input."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"UniqueId.from_bytes needs bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEAD.size:
            raise InvalidArgumentError(f"UniqueId encoding too short ({len(data)} bytes)")
        magic, version, uid, secret, port, host_len = _HEAD.unpack_from(data)
        if magic != _MAGIC:
            raise InvalidArgumentError("not a dfccl UniqueId (bad magic)")
        if version != _VERSION:
            raise InvalidArgumentError(f"unsupported UniqueId version {version} (this build reads {_VERSION})")
        if len(data) != _HEAD.size + host_len:
            raise InvalidArgumentError(
                f"UniqueId encoding is {len(data)} bytes; its header says {_HEAD.size + host_len}"
            )
        try:
            host = data[_HEAD.size :].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgumentError("UniqueId host is not valid UTF-8") from None
        return cls(host, port, secret, uid)

    def to_string(self) -> str:
        """URL-safe base64 of :meth:`to_bytes`, unpadded; fit for environment variables."""
        return base64.urlsafe_b64encode(self._encoded).rstrip(b"=").decode("ascii")

    @classmethod
    def from_string(cls, s: str) -> UniqueId:
        """Decodes :meth:`to_string`; raises :class:`InvalidArgumentError` on malformed input."""
        if not isinstance(s, str):
            raise InvalidArgumentError(f"UniqueId.from_string needs a str, not {type(s).__name__}")
        s = s.strip()
        if not _B64_RE.fullmatch(s) or len(s) % 4 == 1:
            raise InvalidArgumentError("UniqueId string is not unpadded URL-safe base64")
        try:
            data = base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
        except ValueError:
            raise InvalidArgumentError("UniqueId string is not unpadded URL-safe base64") from None
        return cls.from_bytes(data)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        # The secret is a credential: never shown.
        return f"UniqueId(host={self._host!r}, port={self._port}, uid={self._uid.hex()})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UniqueId):
            return NotImplemented
        return self._encoded == other._encoded

    def __hash__(self) -> int:
        return hash(self._encoded)

    def __reduce__(self) -> tuple:
        return (_from_bytes, (self._encoded,))

    # -- use ----------------------------------------------------------------

    def connect(self, *, timeout: float = 300.0) -> StoreClient:
        """Opens a client to this id's store (retrying up to ``timeout`` s)."""
        return StoreClient(self._host, self._port, self._secret, timeout=timeout)

    def comm_key(self) -> int:
        """A stable key in ``[1, 2**63)`` derived from :attr:`uid`, for keying
        communicator state; fits both signed and unsigned 64-bit integers."""
        digest = hashlib.blake2b(self._uid, digest_size=8, person=b"dfccl-comm-key").digest()
        return (int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF) or 1

    def close(self) -> None:
        """Stops the store server if this process started it (any equal id
        may do so); otherwise does nothing.  Idempotent."""
        with _servers_lock:
            server = _servers.pop(self._encoded, None)
        if server is not None:
            server.close()

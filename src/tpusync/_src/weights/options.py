"""The options of weight sync, grouped as the cluster's ``BlockServerOptions`` are: the
publisher's pool (:class:`WeightsPoolOptions`), where it serves (:class:`WeightsServerOptions`),
a subscriber's connections and deadlines (:class:`WeightsClientOptions`), and TLS on either side
(:class:`TlsOptions`). Each is a frozen dataclass checked when it is made, so a wrong value
fails where it is written; ``Publisher`` and ``Subscriber`` take them as ``pool=``,
``server=``, ``client=`` and ``tls=``, each defaulting to the class's defaults.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any, TypeVar

from tpusync._src.cluster.registry import Registry
from tpusync._src.cluster.tcp_server import BlockServerOptions
from tpusync.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "TlsOptions",
    "WeightsClientOptions",
    "WeightsPoolOptions",
    "WeightsServerOptions",
    "options_or_default",
]

DEFAULT_CHUNK_BYTES = 4 << 20


def _seconds(value: Any, argument: str, most: float | None = None) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not value > 0
        or (most is not None and value > most)
    ):
        bound = f"(0, {most:g}] s" if most is not None else "seconds > 0"
        raise InvalidArgumentError(f"{argument}: expected {bound}, got {value!r}")


@dataclass(frozen=True)
class TlsOptions:
    """How a weights connection is secured, on either side.

    Args:
      context: an ``ssl.SSLContext`` that encrypts every connection: the publisher's is a
        server context with its certificate, a subscriber's a client context that trusts it.
        None: no TLS, which only loopback allows unless ``insecure``.
      insecure: allow traffic off loopback in the clear (the handshake still proves both
        peers hold the secret, but hides nothing).
    """

    context: ssl.SSLContext | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.context is not None and not isinstance(self.context, ssl.SSLContext):
            raise InvalidArgumentError(
                f"context: expected an ssl.SSLContext or None, got {type(self.context).__name__}"
            )
        if not isinstance(self.insecure, bool):
            raise InvalidArgumentError(f"insecure: expected True or False, got {self.insecure!r}")


@dataclass(frozen=True)
class WeightsPoolOptions:
    """The publisher's pool of versions, ``<shm_dir>/tpusync-weights-<name>.pool``.

    Args:
      keep: versions kept (at least 1); a late joiner may pull any of them.
      capacity_bytes: the pool's size; None (the default): ``keep + 2`` versions of the first
        one published. The pool does not grow: a version that does not fit beside the versions
        kept (and those subscribers hold) is refused by ``publish`` before any byte is
        copied, saying what it needs; give ``capacity_bytes`` for a tree that grows (a small
        warm-up version first, an adapter added later).
      chunk_bytes: the verified unit, a multiple of 4096 (default 4 MiB).
      shm_dir: where the pool file lives (default ``/dev/shm``).
    """

    keep: int = 2
    capacity_bytes: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shm_dir: str = "/dev/shm"

    def __post_init__(self) -> None:
        keep, chunk, capacity = self.keep, self.chunk_bytes, self.capacity_bytes
        if type(keep) is not int or keep < 1:
            raise InvalidArgumentError(f"keep: expected at least 1 version, got {keep!r}")
        if type(chunk) is not int or chunk < 4096 or chunk % 4096:
            raise InvalidArgumentError(
                f"chunk_bytes: expected a positive multiple of 4096, got {chunk!r}"
            )
        if capacity is not None and (type(capacity) is not int or capacity < chunk):
            raise InvalidArgumentError(
                f"capacity_bytes: expected at least one chunk ({chunk}), got {capacity!r}"
            )
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise InvalidArgumentError(f"shm_dir: expected a directory, got {self.shm_dir!r}")


@dataclass(frozen=True)
class WeightsServerOptions:
    """Where the publisher serves its versions and how long its leases last.

    Args:
      host, port: where its block server listens (default ``127.0.0.1``, a free port); off
        loopback it needs ``tls`` (:class:`TlsOptions`).
      lease_ttl_s: the longest hold a subscriber is granted on a version (default 10 s; a
        subscriber renews it while it pulls).
      registry_ttl_s: the registry lease of the publisher's node, renewed by heartbeat
        (default 10 s).
      lease_max_s: the longest a subscriber may hold a version, renewals included, so a
        subscriber that keeps renewing pins nothing for ever (default None: the block
        server's, 600 s or ``lease_ttl_s`` if longer; at most a week); raise it where one pull
        can take longer (a big tree over a slow link).
      parts_timeout_s: for a trainer of several ``jax.distributed`` processes, how long a
        publish waits for every process's part, and for the first process's commit (default
        120 s); past it nothing of the version is visible.
    """

    host: str = "127.0.0.1"
    port: int = 0
    lease_ttl_s: float = 10.0
    registry_ttl_s: float = 10.0
    lease_max_s: float | None = None
    parts_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise InvalidArgumentError(f"host: expected a host name or address, got {self.host!r}")
        if type(self.port) is not int or not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port: expected 0 to 65535, got {self.port!r}")
        _seconds(self.lease_ttl_s, "lease_ttl_s", 3600)
        _seconds(self.registry_ttl_s, "registry_ttl_s")
        _seconds(self.parts_timeout_s, "parts_timeout_s")
        if self.lease_max_s is not None:
            _seconds(self.lease_max_s, "lease_max_s", 7 * 86400)  # the block server's bound
            if self.lease_max_s < self.lease_ttl_s:
                raise InvalidArgumentError(
                    f"lease_max_s: expected at least lease_ttl_s ({self.lease_ttl_s:g} s), got "
                    f"{self.lease_max_s!r}; raise it or lower lease_ttl_s"
                )


@dataclass(frozen=True)
class WeightsClientOptions:
    """A subscriber's connections to the publisher and its deadlines.

    Args:
      connections: TCP connections to the publisher (1 to 64, default 2).
      timeout_s: the deadline of each request to the publisher (default 10 s).
      deadline_s: the longest a whole pull may take (default 120 s; ``pull(deadline_s=)``
        sets it for one pull).
      same_host: read the publisher's /dev/shm pool file directly when it runs on this host
        (the same boot and user; default True), else over the data plane.
      poll_s: how often ``Subscriber.wait_for_newer`` asks the publisher for its newest
        version (default 0.05 s: one round trip of a few hundred bytes each time).
      relay_wait_s: with relays (``Subscriber(relays=True)``, a relay's ``upstream``), how
        long a pull waits for a relay to list the version, and for a relay listing it to
        send a chunk it has not sent yet, before it takes the chunks from the next relay or
        the publisher (default 30 s; a pull gives relays half of its deadline at most).
    """

    connections: int = 2
    timeout_s: float = 10.0
    deadline_s: float = 120.0
    same_host: bool = True
    poll_s: float = 0.05
    relay_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if type(self.connections) is not int or not 1 <= self.connections <= 64:
            raise InvalidArgumentError(f"connections: expected 1 to 64, got {self.connections!r}")
        _seconds(self.timeout_s, "timeout_s")
        _seconds(self.deadline_s, "deadline_s")
        if not isinstance(self.same_host, bool):
            raise InvalidArgumentError(f"same_host: expected True or False, got {self.same_host!r}")
        _seconds(self.poll_s, "poll_s", most=60.0)
        _seconds(self.relay_wait_s, "relay_wait_s")


OptionsT = TypeVar("OptionsT")


def options_or_default(kind: type[OptionsT], value: OptionsT | None, argument: str) -> OptionsT:
    """``value`` if it is a ``kind``, ``kind()`` (its defaults) if None, else a clear error."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise InvalidArgumentError(
            f"{argument}: expected a tpusync.weights.{kind.__name__}, got {type(value).__name__}"
        )
    return value


def check_registry(registry: Any) -> None:
    """Refuses a ``registry`` that is no :class:`tpusync.cluster.Registry` (None passes)."""
    if registry is not None and not isinstance(registry, Registry):
        raise InvalidArgumentError(
            f"registry: expected a tpusync.cluster.Registry, got {type(registry).__name__}"
        )


def block_server_options(
    secret: bytes, server: WeightsServerOptions, tls: TlsOptions
) -> BlockServerOptions:
    """The block server's options of a weights server (a publisher's, a relay's), checked."""
    return BlockServerOptions(
        secret=secret,
        host=server.host,
        port=server.port,
        tls=tls.context,
        insecure=tls.insecure,
        lease_ttl_s=server.lease_ttl_s,
        lease_max_s=server.lease_max_s,
    )

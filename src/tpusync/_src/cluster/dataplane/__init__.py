"""The TCP data plane: :class:`BlockServer` serves a HostPool's blocks to peers,
:class:`BlockClient` pulls them straight into a local HostPool's slots, :class:`RemotePool` is
the read side of the :class:`~tpusync.tiers.LowerTier` interface over a client.

Connection: TCP, then the registry's mutual HMAC-SHA256 handshake (same frames, same shared
secret rules: see :mod:`tpusync._src.cluster.registry.server`); nothing but the handshake is
answered before it succeeds. Then control requests are the registry's frames (4-byte big-endian
length + JSON object, ``{"id", "method", "params"}`` -> ``{"id", "result"}`` or ``{"id",
"error"}``)::

    hello    {"protocol": "tpusync-blocks", "version": 1, "layout": {...} (optional)}
             -> {"protocol", "version", "server_id", "fingerprint" (hex), "payload_bytes",
                 "capacity", "lease_ttl_s", "writable" (accepts put),
                 "local" (only when the pool is a named /dev/shm pool: its file's "path", the
                 host's "boot_id", the server's "uid")}
    acquire  {"keys": [hex, ...], "ttl_s": s, "slots": true (optional)}
             -> {"lease", "present", "checksums", "ttl_s", "slots" (when asked: each key's
                 slot in the pool, -1 where absent)}
    renew    {"lease": id, "ttl_s": s}          -> bool (False past the lease's lease_max_s)
    release  {"lease": id}                       -> bool (held the whole time)
    contains {"keys": [hex, ...]}                -> [bool, ...]
    stat     {}                                  -> {"capacity", "used"}
    get      {"lease": id, "keys": [hex, ...]}   -> binary frames, not JSON (see
             :mod:`tpusync._src.cluster.dataplane.wire`): per key in order a BLOCK frame (header +
             payload) or a MISSING frame, then END; or an ERROR frame, which ends the response.

A pull (:meth:`BlockClient.pull`): reserve slots in the target for the keys it lacks, acquire a
lease on them (the server pins the present ones and hands out their recorded checksums), stripe
``get`` requests over the client's connections (one thread each), receive every payload with
``recv_into`` straight into its reserved slot, verify every block (header checksum = lease
checksum = checksum of the received bytes, fingerprint = the target's), release the lease, and
commit the verified blocks only if the release answered True (the lease never expired: see
:mod:`tpusync._src.cluster.dataplane.leases` for the timing rule); everything else is aborted. A
connection that breaks, times out or breaks the format loses the blocks not yet complete on it
(their slots are aborted; the connection is re-made on the next pull).

:meth:`BlockClient.pull_scattered` is the same pull with no pool: each block is received
straight into the caller's places, run by run (:class:`Scatter`; ``recvmsg`` over the runs, then
the bytes hashed where they landed, still in cache), and a verified key is reported loaded;
weights subscribers land their shards this way.

A client on the same host, boot and uid as a server that advertises ``"local"`` (and made
with ``same_host=True``, the default) asks the lease for the slots and copies each block from
the mapped pool file into its place, hashing it as it is copied: the same lease, timing rule
and verification, no socket carrying the payload
(:mod:`tpusync._src.cluster.dataplane.local_reads`).

The server pins the slots of every ``get`` while it sends them (on top of the lease's pins) and
sends each payload from a view of its slot (``sendmsg``, no copy).

With ``tls=ssl.SSLContext`` every connection is encrypted (required off loopback unless
``insecure=True``: the MACs stop strangers, not eavesdroppers). Store nodes add ``put``,
``delete`` and ``keys`` and bind each connection to the layout its hello names
(:mod:`tpusync._src.cluster.store_node`); a plain server answers ``hello`` with its own layout.
"""

from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.client import BlockClient, HeldBlocks, PullResult
from tpusync._src.cluster.dataplane.leases import Lease, LeaseTable
from tpusync._src.cluster.dataplane.protocol import MAX_KEYS_PER_REQUEST
from tpusync._src.cluster.dataplane.remote_pool import RemotePool
from tpusync._src.cluster.dataplane.server import BlockServer, Served
from tpusync._src.tiers.scatter import Scatter

__all__ = [
    "MAX_KEYS_PER_REQUEST",
    "BlockClient",
    "BlockServer",
    "HeldBlocks",
    "Lease",
    "LeaseTable",
    "PullResult",
    "RemotePool",
    "Scatter",
    "Served",
    "wire",
]

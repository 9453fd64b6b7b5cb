# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Socket I/O of the data plane with the GIL released: sending a list of buffers, receiving into
a buffer (hashed piece by piece as it lands), and receiving a pull's BLOCK frames straight into
their slots, checked against the headers expected (cluster/dataplane/wire.py lays the format out)."""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcmp, memcpy, memset, strerror

from tpusync._native._checksum cimport (
    tps_checksum_share_path_flag, tps_crc32c, tps_sum64_digest, tps_sum64_init, tps_sum64_state,
    tps_sum64_update, tps_xxh64,
)
from tpusync._native.checksum cimport shared_path_flag

import numpy as np

# Received bytes are hashed with this module's copy of the checksum code: on the code path the
# checksum module chose.
tps_checksum_share_path_flag(shared_path_flag())

cdef size_t HASH_STEP = 64 << 10  # bytes recv_exact gathers before hashing them


cdef extern from "poll.h" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN

cdef extern from "sys/socket.h" nogil:
    ssize_t recv(int sockfd, void *buf, size_t length, int flags)
    struct msghdr:
        void *msg_name
        unsigned int msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int sockfd, const msghdr *msg, int flags)
    ssize_t recvmsg(int sockfd, msghdr *msg, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT
    int setsockopt(int sockfd, int level, int optname, const void *optval, unsigned int optlen)
    int SOL_SOCKET
    int SO_RCVLOWAT

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "errno.h":
    int EINTR
    int EAGAIN
    int EWOULDBLOCK

cdef extern from "poll.h" nogil:
    short POLLOUT


cdef extern from "time.h" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC


cdef double _monotonic() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef int _retry_after(pollfd *pfd, int timeout_ms) noexcept nogil:
    """After a socket call failed with ``errno``: 1 to try it again (interrupted, or the socket
    is ready now), 0 when ``timeout_ms`` passed with the socket still not ready, -1 for a real
    error (``errno`` kept)."""
    cdef int saved = errno
    if saved == EINTR:
        return 1
    if saved != EAGAIN and saved != EWOULDBLOCK:
        return -1
    cdef int r = poll(pfd, 1, timeout_ms)
    if r < 0:
        return 1 if errno == EINTR else -1
    return 1 if r > 0 else 0


cdef class PieceHasher:
    """The piece checksums (``sum64``) of one block's bytes as they arrive, piece by piece, so
    that each piece is hashed while its bytes are still in cache (fed by :func:`recv_exact`).

    ``offsets`` and ``lengths`` are the pieces' places in the block (a layout's piece table,
    sorted, not overlapping); bytes between pieces are not hashed. :attr:`digests` holds every
    piece's checksum once :attr:`complete`."""

    cdef int64_t[::1] _offsets
    cdef int64_t[::1] _lengths
    cdef uint64_t[::1] _digests
    cdef Py_ssize_t _piece
    cdef int64_t _position
    cdef tps_sum64_state _state
    cdef readonly object digests

    def __cinit__(self, offsets, lengths):
        self._offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self._lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        if self._offsets.shape[0] != self._lengths.shape[0]:
            raise ValueError("offsets and lengths differ in length")
        self.digests = np.zeros(self._offsets.shape[0], dtype=np.uint64)
        self._digests = self.digests
        self._piece = 0
        self._position = 0
        tps_sum64_init(&self._state)

    @property
    def position(self):
        """How many of the block's bytes were fed."""
        return self._position

    @property
    def complete(self):
        """Whether every piece was hashed."""
        return self._piece == self._offsets.shape[0]

    def feed(self, data):
        """Feeds the block's next bytes (for tests and the paths that receive in Python)."""
        cdef const unsigned char[::1] view = memoryview(data).cast("B")
        if view.shape[0]:
            with nogil:
                self._feed(&view[0], view.shape[0])

    cdef void _reset(self) noexcept nogil:
        """Starts over for the next block (the digests are overwritten piece by piece)."""
        self._piece = 0
        self._position = 0
        tps_sum64_init(&self._state)

    cdef void _feed(self, const unsigned char *data, int64_t n) noexcept nogil:
        """``data`` holds the block's bytes [position, position + n)."""
        cdef int64_t end = self._position + n, start, stop, lo, hi
        while self._piece < self._offsets.shape[0]:
            start = self._offsets[self._piece]
            stop = start + self._lengths[self._piece]
            lo = start if start > self._position else self._position
            hi = stop if stop < end else end
            if hi > lo:
                tps_sum64_update(&self._state, data + (lo - self._position), <size_t>(hi - lo))
            if stop > end:
                break  # the rest of this piece comes later
            self._digests[self._piece] = tps_sum64_digest(&self._state)
            tps_sum64_init(&self._state)
            self._piece += 1
        self._position = end


def send_all(int fd, buffers, double timeout_s, double budget_s=1e300):
    """Sends every buffer in order with ``sendmsg`` on the socket ``fd`` (no joining copy), the
    GIL released for the whole loop, waiting at most ``timeout_s`` each time the socket is full
    and ``budget_s`` for the whole call (a peer that takes a byte now and then cannot stretch
    it). Works on blocking and non-blocking sockets. Returns the bytes sent; raises
    TimeoutError when the peer took nothing for ``timeout_s`` or the budget ran out (the caller
    tells them apart by its own clock), OSError for a socket error."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    cdef Py_ssize_t count = len(views), i, first = 0
    if count == 0:
        return 0
    cdef iovec *iov = <iovec *> PyMem_Malloc(count * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    cdef const unsigned char[::1] v
    cdef size_t total = 0, sent = 0
    cdef ssize_t k = 0
    cdef int r = 0, status = 0, err = 0, wait_ms = 0
    cdef int timeout_ms = <int>(timeout_s * 1000.0) if timeout_s < 2e6 else 2000000000
    cdef double end = _monotonic() + budget_s, left = 0.0
    cdef msghdr msg
    cdef pollfd pfd
    try:
        for i in range(count):
            v = views[i]
            iov[i].iov_base = <void *> &v[0]
            iov[i].iov_len = v.shape[0]
            total += v.shape[0]
        memset(&msg, 0, sizeof(msg))
        pfd.fd = fd
        pfd.events = POLLOUT
        with nogil:
            while first < count:
                msg.msg_iov = iov + first
                msg.msg_iovlen = count - first
                k = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                if k < 0:
                    left = end - _monotonic()
                    if left <= 0:
                        status = -3  # the whole call's budget ran out
                        break
                    wait_ms = timeout_ms
                    if left * 1000.0 < wait_ms:
                        wait_ms = <int>(left * 1000.0) + 1
                    r = _retry_after(&pfd, wait_ms)
                    if r == 0:
                        status = -2 if wait_ms == timeout_ms else -3
                        break
                    if r < 0:
                        status, err = -1, errno
                        break
                    continue
                sent += <size_t>k
                while first < count and <size_t>k >= iov[first].iov_len:
                    k -= iov[first].iov_len
                    first += 1
                if first < count and k:
                    iov[first].iov_base = <char *> iov[first].iov_base + k
                    iov[first].iov_len -= k
    finally:
        PyMem_Free(iov)
    if status == -2:
        raise TimeoutError(f"the peer took nothing for {timeout_s:g} s")
    if status == -3:
        raise TimeoutError(f"the send did not end within its budget of {budget_s:g} s")
    if status == -1:
        raise OSError(err, strerror(err).decode())
    return sent


cdef size_t _rcvlowat_max = 256 << 10
# Most bytes one read takes (recv_exact, FrameReceiver). A read of a whole 2 MiB payload copies
# for so long that the sender's window closes and it sleeps; reads of 128 KiB keep both ends
# streaming and the bytes hot for the hash (docs/decisions/0003).
cdef size_t _recv_step = 128 << 10


def _set_recv_step(size_t nbytes):
    """Sets the most bytes one read takes (for tests and A/B runs); returns the previous."""
    global _recv_step
    previous, _recv_step = _recv_step, max(nbytes, 1)
    return previous


def _set_rcvlowat_max(size_t nbytes):
    """How many bytes recv_exact lets arrive before a wait ends (1: every arrival)."""
    global _rcvlowat_max
    _rcvlowat_max = max(nbytes, 1)


cdef int _wait_for_more(int fd, pollfd *pfd, size_t missing, int *lowat,
                        int timeout_ms) noexcept nogil:
    """After a read found nothing: waits (``_retry_after``) until a good part of the ``missing``
    bytes arrived, not each packet -- SO_RCVLOWAT raised to min(missing, _rcvlowat_max), never
    more than is still missing: fewer wake-ups and longer copies. ``lowat`` is the mark now set
    (put it back with ``_reset_lowat``)."""
    cdef int want = <int> (missing if missing < _rcvlowat_max else _rcvlowat_max)
    cdef int saved
    if want != lowat[0]:
        saved = errno  # what _retry_after judges, whatever setsockopt does
        if setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(int)) == 0:
            lowat[0] = want
        (&errno)[0] = saved  # errno is a macro: written through its address
    return _retry_after(pfd, timeout_ms)


cdef void _reset_lowat(int fd, int lowat) noexcept nogil:
    """Other readers of the socket (and polls) see every byte again."""
    cdef int one = 1
    if lowat != 1:
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(int))


def recv_exact(int fd, buffer, double timeout_s, PieceHasher hasher=None):
    """Receives until ``buffer`` (a writable contiguous buffer) is full from the socket ``fd``,
    waiting at most ``timeout_s`` for each read; the GIL is released for the whole loop (a
    block's payload is one call, not one Python round trip per kernel read). Returns the bytes
    received: all of them, or fewer when the time ran out (then the caller decides whether its
    deadline passed or it waits again for the rest). Raises EOFError when the peer closed the
    connection and OSError for a socket error. Works on blocking and non-blocking sockets.
    With ``hasher``, every byte received is fed to it as it lands (``buffer`` holds the block's
    bytes from ``hasher.position`` on)."""
    cdef unsigned char[::1] view = memoryview(buffer).cast("B")
    cdef size_t n = view.shape[0]
    cdef unsigned char *p = &view[0] if n else NULL
    cdef size_t got = 0
    cdef ssize_t k = 0
    cdef int r = 0, status = 0, err = 0
    cdef int timeout_ms = <int>(timeout_s * 1000.0) if timeout_s < 2e6 else 2000000000
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef bint hashing = hasher is not None
    cdef size_t fed = 0
    cdef int lowat = 1
    cdef bint waited_out = False
    with nogil:
        while got < n:
            # read first, wait only when nothing is there: one system call per read while
            # data streams in (MSG_DONTWAIT: never blocks, whatever the socket's mode)
            k = recv(fd, p + got, n - got if n - got < _recv_step else _recv_step, MSG_DONTWAIT)
            if k == 0:
                status = -2
                break
            if k < 0:
                if waited_out:
                    break  # a whole wait and nothing arrived: the caller checks its deadline
                r = _wait_for_more(fd, &pfd, n - got, &lowat, timeout_ms)
                if r < 0:
                    status, err = -1, errno
                    break
                # on a timeout, read once more: bytes below the low mark count as progress
                waited_out = r == 0
                continue
            waited_out = False
            got += <size_t>k
            if hashing and (got - fed >= HASH_STEP or got == n):
                # hashed while still in cache, in steps long enough for the fast path (0003)
                hasher._feed(p + fed, <int64_t>(got - fed))
                fed = got
        if hashing and got > fed:  # timed out mid-step: the hasher keeps up with `got`
            hasher._feed(p + fed, <int64_t>(got - fed))
        _reset_lowat(fd, lowat)
    if status == -2:
        raise EOFError("connection closed by the peer")
    if status == -1:
        raise OSError(err, strerror(err).decode())
    return got


FRAME_HEADER_BYTES = 96
FRAMES_DONE, FRAMES_HEADER, FRAMES_TIMEOUT, FRAMES_SILENT = 0, 1, 2, 3
cdef enum:
    _FRAMES_DONE = 0
    _FRAMES_HEADER = 1
    _FRAMES_TIMEOUT = 2
    _FRAMES_SILENT = 3


cdef void _block_header(unsigned char *out, uint64_t request_id, const unsigned char *key,
                        size_t key_len, const unsigned char *fingerprint, uint64_t length,
                        uint16_t scheme, uint64_t checksum) noexcept nogil:
    """The 96 bytes of a BLOCK frame header (cluster/dataplane/wire.py lays the format out)."""
    cdef uint16_t version = 1, frame_type = 1
    cdef uint8_t n = <uint8_t> key_len
    cdef uint32_t crc
    memset(out, 0, 96)
    memcpy(out, b"TPSB", 4)
    memcpy(out + 4, &version, 2)
    memcpy(out + 6, &frame_type, 2)
    memcpy(out + 8, &request_id, 8)
    memcpy(out + 16, &n, 1)
    memcpy(out + 17, key, key_len)
    memcpy(out + 49, fingerprint, 16)
    memcpy(out + 65, &length, 8)
    memcpy(out + 73, &scheme, 2)
    memcpy(out + 75, &checksum, 8)
    crc = tps_crc32c(0, out, 92)
    memcpy(out + 92, &crc, 4)


def block_frame_headers(uint64_t request_id, list keys not None, bytes fingerprint not None,
                        uint64_t payload_length, const uint64_t[::1] checksums not None,
                        int scheme):
    """The BLOCK frame headers of ``keys`` (each with its checksum), joined: what
    :class:`FrameReceiver` expects, built as ``wire.encode_header`` builds them."""
    cdef Py_ssize_t n = len(keys), i
    if checksums.shape[0] != n or len(fingerprint) != 16:
        raise ValueError("one checksum per key and a 16-byte fingerprint")
    out = bytearray(96 * n)
    cdef unsigned char[::1] view = out
    cdef bytes key
    for i in range(n):
        key = keys[i]
        if not 1 <= len(key) <= 32:
            raise ValueError("keys are 1 to 32 bytes")
        _block_header(&view[96 * i], request_id, key, len(key), fingerprint, payload_length,
                      <uint16_t> scheme, checksums[i])
    return bytes(out)


cdef enum:
    _MAX_IOVS = 64  # places one read fills at most (scattered payloads)


cdef tuple _checked_runs(runs, Py_ssize_t n, uint64_t size):
    """``runs`` as contiguous arrays, after checking they tile each of ``n`` payloads of
    ``size`` bytes (ValueError otherwise)."""
    try:
        first, offsets, targets = runs
    except (TypeError, ValueError):
        raise ValueError("runs: (first, offsets, targets)") from None
    first = np.ascontiguousarray(first, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    targets = np.ascontiguousarray(targets, dtype=np.uint64)
    count = offsets.shape[0]
    if first.shape != (n + 1,) or targets.shape != (count,) or offsets.ndim != 1:
        raise ValueError("runs: first has one entry per block and one more; one target per run")
    if first[0] != 0 or first[n] != count or (np.diff(first) < 1).any():
        raise ValueError("runs: every block has a run, and first ends at the run count")
    starts = np.zeros(count, dtype=bool)
    starts[first[:-1]] = True
    rising = np.diff(offsets, prepend=np.int64(-1)) > 0
    if count and (
        (offsets[starts] != 0).any() or not rising[~starts].all()
        or offsets.max() >= <int64_t> size or (targets == 0).any()
    ):
        raise ValueError(
            "runs: each block's offsets start at 0 and rise inside the payload; targets nonzero"
        )
    return first, offsets, targets


cdef class FrameReceiver:
    """Receives one response's BLOCK frames straight into their slots, with the GIL released
    across blocks: each header must equal, byte for byte, the one expected for its block (its
    key, request id, layout fingerprint, length and recorded checksum); the payload lands in
    the block's slot and is hashed piece by piece as it arrives (:class:`PieceHasher`), and
    the block's checksum is compared with the one recorded. Each payload read also takes the
    next frame's header (a BLOCK payload is always followed by one), one system call less per
    block.

    :meth:`run` stops at a header it did not expect (a MISSING, ERROR or early END frame, a
    damaged header, ...): :attr:`header` holds it and :attr:`index` is its block; the caller
    decodes it and goes on with :meth:`resume`. Once every block arrived, :meth:`run` reads the
    header that follows them (the END frame, for the caller to check).

    ``addresses`` are the slots' payload addresses: the caller keeps that memory mapped and
    writable (and reserved for these blocks) until the receiver is done.

    ``runs`` (``first``, ``offsets``, ``targets``) scatters each payload instead, received
    straight into its places with no copy after: block ``i``'s runs are ``first[i]`` to
    ``first[i + 1]``, each starting at ``offsets[r]`` in the payload (the first at 0, rising)
    and landing at address ``targets[r]`` (nonzero), up to the next run or the payload's end.
    ``addresses`` is then None. The bytes of a block that fails its checksum are wherever its
    runs point: only a verified block's places hold its bytes."""

    cdef int _fd
    cdef Py_ssize_t _n
    cdef bytes _expected
    cdef const int64_t[::1] _first
    cdef const int64_t[::1] _run_offsets
    cdef const uint64_t[::1] _run_targets
    cdef Py_ssize_t _recv_run
    cdef Py_ssize_t _hash_run
    cdef const uint64_t[::1] _checksums
    cdef uint64_t _size
    cdef PieceHasher _hasher
    cdef Py_ssize_t _pieces
    cdef unsigned char _header[96]
    cdef size_t _header_got
    cdef uint64_t _payload_got
    cdef uint64_t _fed
    cdef bint _in_payload
    cdef int _iovs
    cdef readonly Py_ssize_t index
    cdef readonly object results
    cdef unsigned char[::1] _results
    cdef readonly uint64_t bytes_received
    cdef readonly uint64_t bytes_read

    def __cinit__(self, int fd, bytes expected_headers not None, addresses,
                  const uint64_t[::1] checksums, uint64_t payload_length, offsets, lengths,
                  runs=None):
        self._n = checksums.shape[0]
        if len(expected_headers) != 96 * self._n:
            raise ValueError("one 96-byte header, address and checksum per block")
        if (addresses is None) == (runs is None):
            raise ValueError("give addresses or runs, not both")
        if runs is None:
            targets = np.ascontiguousarray(addresses, dtype=np.uint64)
            if targets.shape != (self._n,):
                raise ValueError("one 96-byte header, address and checksum per block")
            runs = (np.arange(self._n + 1, dtype=np.int64), np.zeros(self._n, np.int64), targets)
        first, run_offsets, run_targets = _checked_runs(runs, self._n, payload_length)
        self._fd = fd
        self._expected = expected_headers
        self._first = first
        self._run_offsets = run_offsets
        self._run_targets = run_targets
        self._checksums = checksums
        self._size = payload_length
        self._hasher = PieceHasher(offsets, lengths)
        self._pieces = self._hasher._offsets.shape[0]
        self.results = np.zeros(self._n, dtype=np.uint8)  # 1: verified, 2: failed its checksum
        self._results = self.results
        self.index = 0
        self._header_got = 0
        self._in_payload = False
        self.bytes_received = 0  # verified or not, whole payloads
        self.bytes_read = 0  # everything read from the socket

    @property
    def header(self):
        """The header :meth:`run` stopped at (96 bytes), or the END frame's after the last
        block."""
        return PyBytes_FromStringAndSize(<char *> self._header, 96)

    def resume(self, Py_ssize_t index):
        """Goes on at block ``index`` (0..blocks), reading its header first: after the caller
        handled the frame :meth:`run` stopped at (and, for a BLOCK frame it took itself, its
        payload)."""
        if not 0 <= index <= self._n:
            raise ValueError(f"index {index} is outside 0..{self._n}")
        self.index = index
        self._header_got = 0
        self._in_payload = False

    cdef inline uint64_t _run_end(self, Py_ssize_t r) noexcept nogil:
        """Where run ``r`` of the current block ends in its payload."""
        if r + 1 < self._first[self.index + 1]:
            return <uint64_t> self._run_offsets[r + 1]
        return self._size

    cdef uint64_t _gather(self, iovec *iov, uint64_t want) noexcept nogil:
        """Fills ``iov`` with the places of the payload's next ``want`` bytes (fewer when the
        runs are short: at most _MAX_IOVS places); sets ``_iovs`` and returns the bytes."""
        cdef uint64_t at = self._payload_got, stop = at + want, end
        cdef Py_ssize_t r = self._recv_run
        while self._run_end(r) <= at:
            r += 1
        self._recv_run = r
        self._iovs = 0
        while at < stop and self._iovs < _MAX_IOVS:
            end = self._run_end(r)
            if end > stop:
                end = stop
            iov[self._iovs].iov_base = <void *> <uintptr_t> (
                self._run_targets[r] + (at - <uint64_t> self._run_offsets[r]))
            iov[self._iovs].iov_len = end - at
            self._iovs += 1
            at = end
            r += 1
        return at - self._payload_got

    cdef void _hash_received(self) noexcept nogil:
        """Hashes the payload's bytes received since the last call, where they landed."""
        cdef uint64_t at = self._fed, end
        cdef Py_ssize_t r = self._hash_run
        while at < self._payload_got:
            end = self._run_end(r)
            if end > at:
                if end > self._payload_got:
                    end = self._payload_got
                self._hasher._feed(
                    <const unsigned char *> <uintptr_t> (
                        self._run_targets[r] + (at - <uint64_t> self._run_offsets[r])),
                    <int64_t> (end - at))
                at = end
                if at < self._run_end(r):
                    break
            r += 1
        self._hash_run = r
        self._fed = self._payload_got

    def run(self, double budget_s, double silence_s):
        """Receives until every block and the header after them arrived (FRAMES_DONE), a
        header differs from the one expected (FRAMES_HEADER), ``budget_s`` passed
        (FRAMES_TIMEOUT: the caller checks its deadline and calls again to go on), or
        ``silence_s`` passed without a byte (FRAMES_SILENT). Raises EOFError when the peer
        closed the connection and OSError for a socket error."""
        cdef double now = _monotonic()
        cdef double end = now + budget_s, last_byte = now, left
        cdef int timeout_ms
        cdef const unsigned char *expected = self._expected
        cdef pollfd pfd
        pfd.fd = self._fd
        pfd.events = POLLIN
        cdef iovec iov[_MAX_IOVS + 1]
        cdef msghdr msg
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = iov
        cdef ssize_t k = 0
        cdef uint64_t missing, take
        cdef int r = 0, status = -1, err = 0, lowat = 1
        cdef bint waited_out = False
        cdef bint read_some = False
        with nogil:
            while True:
                if read_some:  # data keeps coming: still hand back at the budget
                    read_some = False
                    last_byte = _monotonic()
                    if last_byte >= end:
                        status = _FRAMES_TIMEOUT
                        break
                if not self._in_payload:
                    if self._header_got == 96:
                        if self.index == self._n:
                            status = _FRAMES_DONE
                            break
                        if memcmp(self._header, expected + 96 * self.index, 96) != 0:
                            status = _FRAMES_HEADER
                            break
                        self._in_payload = True
                        self._payload_got = 0
                        self._fed = 0
                        self._header_got = 0
                        self._recv_run = self._first[self.index]
                        self._hash_run = self._recv_run
                        self._hasher._reset()
                        continue
                    missing = 96 - self._header_got
                    k = recv(self._fd, self._header + self._header_got, missing, MSG_DONTWAIT)
                else:
                    missing = self._size - self._payload_got
                    take = self._gather(iov, missing if missing < _recv_step else _recv_step)
                    msg.msg_iovlen = self._iovs
                    if take == missing:  # the next frame's header with the payload's end
                        iov[self._iovs].iov_base = self._header
                        iov[self._iovs].iov_len = 96
                        msg.msg_iovlen += 1
                    k = recvmsg(self._fd, &msg, MSG_DONTWAIT)
                if k == 0:
                    status = -2
                    break
                if k < 0:
                    now = _monotonic()
                    if now - last_byte >= silence_s and waited_out:
                        status = _FRAMES_SILENT
                        break
                    if now >= end and waited_out:
                        status = _FRAMES_TIMEOUT
                        break
                    left = last_byte + silence_s - now
                    if end - now < left:
                        left = end - now
                    if left < 0:
                        left = 0
                    timeout_ms = <int>(left * 1000.0) + 1 if left < 2e6 else 2000000000
                    r = _wait_for_more(self._fd, &pfd, missing, &lowat, timeout_ms)
                    if r < 0:
                        status, err = -1, errno
                        break
                    # on a timeout, read once more: bytes below the low mark count as progress
                    waited_out = r == 0
                    continue
                waited_out = False
                self.bytes_read += <uint64_t> k
                read_some = True
                if not self._in_payload:
                    self._header_got += <size_t> k
                    continue
                take = <uint64_t> k if <uint64_t> k < missing else missing
                self._payload_got += take
                self._header_got = <size_t> (<uint64_t> k - take)
                if self._payload_got - self._fed >= HASH_STEP or self._payload_got == self._size:
                    self._hash_received()
                if self._payload_got == self._size:
                    self._results[self.index] = 1 if (
                        self._hasher._piece == self._pieces
                        and tps_xxh64(&self._hasher._digests[0] if self._pieces else NULL,
                                      <size_t> self._pieces * 8, 0)
                        == self._checksums[self.index]
                    ) else 2
                    self.bytes_received += self._size
                    self.index += 1
                    self._in_payload = False
            _reset_lowat(self._fd, lowat)
        if status == -2:
            raise EOFError("connection closed by the peer")
        if status == -1:
            raise OSError(err, strerror(err).decode())
        return status

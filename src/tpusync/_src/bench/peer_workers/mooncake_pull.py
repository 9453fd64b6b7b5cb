"""Mooncake's transfer engine reading blocks from another process over TCP, as
:mod:`tpusync._src.bench.network` pulls them with tpusync: a server child (this file, kind
``server``) registers ``blocks`` random blocks of ``block_bytes``; the client (kind ``client``)
reads them all into its own registered buffer with one ``batch_transfer_sync_read`` per pull.
Both engines use the P2P handshake (no metadata server) and the ``tcp`` protocol. Runs under
Mooncake's interpreter (the non-CUDA wheel).

The client answers ``{"op": "pull"}`` with the seconds of one pull; its first line says whether
a pull delivered every byte (a BLAKE2b of the server's buffer against the client's)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

import numpy as np
from mooncake.engine import TransferEngine
from protocol import PREFIX, config_from_argv, reply, serve


def engine() -> TransferEngine:
    e = TransferEngine()
    code = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if code != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {code}")
    return e


def registered(e: TransferEngine, buffer: np.ndarray) -> int:
    address = buffer.ctypes.data
    code = e.register_memory(address, buffer.nbytes)
    if code != 0:
        raise RuntimeError(f"register_memory returned {code}")
    return address


def version() -> str:
    for name in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def server(config: dict[str, Any]) -> None:
    nbytes = config["blocks"] * config["block_bytes"]
    buffer = np.frombuffer(np.random.default_rng(config["seed"]).bytes(nbytes), np.uint8).copy()
    e = engine()
    address = registered(e, buffer)
    digest = hashlib.blake2b(buffer, digest_size=16).hexdigest()
    reply({"port": e.get_rpc_port(), "address": address, "digest": digest})
    serve(lambda request: {"alive": True})


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode("utf-8", "replace")
        if not line:
            raise RuntimeError(f"the Mooncake server exited (rc={proc.wait()})")
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX) :])
    raise TimeoutError("the Mooncake server did not answer")


def client(config: dict[str, Any]) -> None:
    blocks, block_bytes = config["blocks"], config["block_bytes"]
    argv = [sys.executable, __file__, "--child", "server", json.dumps(config)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        found = read_line(proc, 120.0)
        e = engine()
        target = np.zeros(blocks * block_bytes, np.uint8)
        local = registered(e, target)
        peer = f"127.0.0.1:{found['port']}"
        locals_ = [local + i * block_bytes for i in range(blocks)]
        remotes = [found["address"] + i * block_bytes for i in range(blocks)]
        lengths = [block_bytes] * blocks

        def pull() -> float:
            start = time.perf_counter()
            code = e.batch_transfer_sync_read(peer, locals_, remotes, lengths)
            seconds = time.perf_counter() - start
            if code != 0:
                raise RuntimeError(f"batch_transfer_sync_read returned {code}")
            return seconds

        pull()
        verified = hashlib.blake2b(target, digest_size=16).hexdigest() == found["digest"]
        reply({"verified": verified, "mooncake": version()})

        def handle(request: dict[str, Any]) -> dict[str, Any]:
            if request["op"] != "pull":
                raise ValueError(f"unknown op {request['op']!r}")
            return {"seconds": pull()}

        serve(handle)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


if __name__ == "__main__":
    kind, config = config_from_argv(sys.argv)
    {"server": server, "client": client}[kind](config)

"""info(): which engine each device gets and why, and the host facts that limit tpusync."""

from __future__ import annotations

import os
import resource
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import jaxlib

from tpusync import options
from tpusync._src.engines.native import copy_threads
from tpusync._src.memory import fork_guard
from tpusync._src.tiers.direct_io import check_o_direct
from tpusync._src.transfer.select import device_choice
from tpusync._version import __version__

__all__ = ["DeviceInfo", "HostInfo", "Info", "info"]


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    platform: str
    kind: str
    process_index: int
    path: str  # "native" or "jax"
    reason: str


@dataclass(frozen=True)
class HostInfo:
    shm_total_bytes: int | None
    shm_free_bytes: int | None
    memlock_soft: int | None  # None: unlimited
    memlock_hard: int | None
    o_direct_dir: str
    o_direct: bool
    o_direct_reason: str
    transparent_huge_pages: str | None
    shmem_huge_pages: str | None  # 'deny' keeps /dev/shm pools on small pages
    huge_pages_for_cpu_pools: bool  # Options.huge_pages: CPU DevicePools, /dev/shm pools collapsed
    copy_threads: int
    cpu_count: int


@dataclass(frozen=True)
class Info:
    version: str
    jax_version: str
    jaxlib_version: str
    backend: str
    devices: list[DeviceInfo] = field(default_factory=list)
    host: HostInfo | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"tpusync {self.version} (jax {self.jax_version}, jaxlib {self.jaxlib_version}, "
            f"backend {self.backend})",
            "devices:",
        ]
        for d in self.devices:
            lines.append(f"  {d.platform}:{d.id} ({d.kind}) -> {d.path}: {d.reason}")
        h = self.host
        if h is not None:
            lines += [
                "host:",
                f"  /dev/shm: {_gib(h.shm_free_bytes)} free of {_gib(h.shm_total_bytes)}",
                f"  RLIMIT_MEMLOCK: soft {_limit(h.memlock_soft)}, hard {_limit(h.memlock_hard)}",
                f"  O_DIRECT in {h.o_direct_dir}: {'yes' if h.o_direct else 'no'} "
                f"({h.o_direct_reason})",
                f"  transparent huge pages: {h.transparent_huge_pages} (shmem "
                f"{h.shmem_huge_pages}); CPU device and /dev/shm pools collapsed: "
                f"{'yes' if h.huge_pages_for_cpu_pools else 'no (TPUSYNC_HUGE_PAGES=0)'}",
                f"  copy threads: {h.copy_threads} of {h.cpu_count} usable cores",
            ]
        return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def _limit(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / 2**20:.0f} MiB"


def _statvfs(path: str) -> tuple[int | None, int | None]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _thp(which: str = "enabled") -> str | None:
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{which}") as f:
            text = f.read().strip()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text


def host_info(directory: str | None = None) -> HostInfo:
    total, free = _statvfs("/dev/shm")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    directory = directory or tempfile.gettempdir()
    ok, reason = check_o_direct(directory)
    return HostInfo(
        shm_total_bytes=total,
        shm_free_bytes=free,
        memlock_soft=None if soft == resource.RLIM_INFINITY else soft,
        memlock_hard=None if hard == resource.RLIM_INFINITY else hard,
        o_direct_dir=directory,
        o_direct=ok,
        o_direct_reason=reason,
        transparent_huge_pages=_thp(),
        shmem_huge_pages=_thp("shmem_enabled"),
        huge_pages_for_cpu_pools=options.current().huge_pages,
        copy_threads=copy_threads(),
        cpu_count=len(os.sched_getaffinity(0)),
    )


def info(directory: str | None = None) -> Info:
    """Reports, per device, which engine tpusync uses and why, and the host's limits.

    Args:
      directory: where to check O_DIRECT (e.g. the disk tier's directory); default: the
        temporary directory.
    """
    fork_guard.check_device_use("tpusync.info")  # it lists JAX's devices
    devices = []
    for device in jax.devices():
        path = device_choice(device) if device.process_index == jax.process_index() else None
        devices.append(
            DeviceInfo(
                id=device.id,
                platform=device.platform,
                kind=device.device_kind,
                process_index=device.process_index,
                path=path.name if path else "remote",
                reason=path.reason if path else "not addressable from this process",
            )
        )
    return Info(
        version=__version__,
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        backend=jax.default_backend(),
        devices=devices,
        host=host_info(directory),
    )

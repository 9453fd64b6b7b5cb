"""benchmarks/RESULTS.md: a table per benchmark from the latest result file of each, written
after every ``tpusync bench`` run (:func:`write_results_md`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "disagg_limits",
    "hit_limit_ratio",
    "latest_results",
    "nixl_figures",
    "paired_figures",
    "write_results_md",
]

Table = tuple[list[str], list[list[str]]]
NO_PEER = "none runs here"


def _num(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def _ratio(value: Any, limit: Any) -> str:
    if not isinstance(value, int | float) or not isinstance(limit, int | float) or not limit:
        return "-"
    ratio = value / limit
    return f"{ratio:.2f}" + (" (limit beaten: the limit is wrong)" if ratio > 1.0 else "")


def _peer(value: Any, peers: dict[str, Any]) -> str:
    """``value`` against the fastest of ``peers`` that ran, with its name."""
    ran = {name: v for name, v in peers.items() if isinstance(v, int | float) and v}
    if not isinstance(value, int | float) or not ran:
        return "-"
    best = max(ran, key=ran.__getitem__)
    return f"{value / ran[best]:.2f} ({best})"


FIGURE_KEYS = ("native", "jax", "tpu_sync")


def _transfer(record: dict[str, Any]) -> Table:
    headers = ["block", "way", "limit GB/s", "native", "x limit", "jax", "TPU Sync", "x peer"]
    rows = []
    for r in record.get("results", []):
        limit = r.get("limit_gbps")
        for way in ("d2h", "h2d"):
            native, jax, tpu_sync = (r.get(f"{way}_{k}_gbps") for k in FIGURE_KEYS)
            rows.append(
                [
                    f"{r.get('block_kib')} KiB",
                    way.upper(),
                    f"{_num(limit)} {r.get('limit_method', 'np.copyto')}",
                    _num(native),
                    _ratio(native, limit),
                    _num(jax),
                    _num(tpu_sync) if tpu_sync else "skipped",
                    _peer(native, {"jax": jax, "TPU Sync": tpu_sync}),
                ]
            )
    return headers, rows


def _tiers(record: dict[str, Any]) -> Table:
    headers = ["tier", "block", "limit GB/s", "put", "x limit", "get", "x limit", "x peer"]
    rows = []
    for r in record.get("results", []):
        limit = r.get("limit_gbps")
        rows.append(
            [r.get("tier", "-"), f"{r.get('block_mib')} MiB",
             f"{_num(limit)} {r.get('limit_method', 'np.copyto')}",
             _num(r.get("put_gbps")), _ratio(r.get("put_gbps"), limit),
             _num(r.get("get_gbps")), _ratio(r.get("get_gbps"), limit),
             f"put {_peer(r.get('put_gbps'), {'pure JAX': r.get('put_jax_gbps')})}, "
             f"get {_peer(r.get('get_gbps'), {'pure JAX': r.get('get_jax_gbps')})}"]
        )  # fmt: skip
    for r in record.get("disk", []):
        write = r.get("limit_write_gbps", r.get("fio_write_gbps"))
        read = r.get("limit_read_gbps", r.get("fio_read_gbps"))
        rows.append(
            [r.get("tier", "-"), f"{r.get('block_mib')} MiB",
             f"{_num(write)} w ({r.get('limit_write_method', 'fio')}) / {_num(read)} r "
             f"({r.get('limit_read_method', 'fio')})",
             _num(r.get("put_gbps")), _ratio(r.get("put_gbps"), write),
             _num(r.get("get_gbps")), _ratio(r.get("get_gbps"), read), NO_PEER]
        )  # fmt: skip
    return headers, rows


def _prefix(record: dict[str, Any]) -> Table:
    headers = ["tokens", "cold TTFT ms", "DRAM ms", "/dev/shm restart ms", "disk ms",
               "DRAM load x limit", "disk load x limit", "x peer"]  # fmt: skip
    rows = []
    for r in record.get("results", []):
        kv, limit, fio = r.get("kv_bytes"), r.get("memcpy_gbps"), r.get("fio_read_gbps")
        dram = kv / r["dram_load_s"] / 1e9 if kv and r.get("dram_load_s") else None
        disk = kv / r["disk_load_s"] / 1e9 if kv and r.get("disk_load_s") else None
        rows.append(
            [str(r.get("tokens"))]
            + [_num((r.get(k) or 0) * 1e3, 1) for k in
               ("cold_ttft_s", "dram_ttft_s", "shm_restart_ttft_s", "disk_ttft_s")]
            + [_ratio(dram, limit), _ratio(disk, fio), NO_PEER]
        )  # fmt: skip
    return headers, rows


NETWORK_PEERS = ("jax.experimental.transfer", "Mooncake transfer engine (tcp)")


def _network(record: dict[str, Any]) -> Table:
    loop = record.get("loopback") or {}
    gbps, limits = loop.get("gbps", {}), loop.get("limit_gbps", {})
    peers = {name: gbps.get(name) for name in NETWORK_PEERS}
    rows = []
    for name, value in gbps.items():
        count = name.rsplit(" ", 2)[-2] if name.startswith("tpusync") else None
        limit = limits.get(count) if count and " TLS" not in name else None
        peer = _peer(value, peers) if name.startswith("tpusync") else ""
        rows.append([name, _num(value), _num(limit) if limit else "", _ratio(value, limit), peer])
    for name in NETWORK_PEERS:
        if name not in gbps:
            rows.append([name, "skipped", "", "", ""])
    for name, value in ((record.get("two_paths") or {}).get("gbps") or {}).items():
        rows.append([f"two namespaces: {name}", _num(value, 3), "", "-", ""])
    registry = (record.get("registry") or {}).get("lookups_per_s") or {}
    redis = registry.get("RedisRegistry -> redis-server")
    for name, value in registry.items():
        rows.append([f"lookups/s: {name}", f"{value:,.0f}", "", "-",
                     _peer(value, {"Redis": redis}) if "Redis" not in name else ""])  # fmt: skip
    return ["path", "GB/s", "limit GB/s", "x limit", "x peer"], rows


def _mac_cost(record: dict[str, Any]) -> Table:
    gbps = record.get("gbps", {})
    limit = gbps.get("limit")
    own = "none (tpusync's own MAC cost)"
    rows = [[name, _num(value), _ratio(value, limit) if name != "limit" else "", own]
            for name, value in gbps.items()]  # fmt: skip
    for name, value in (record.get("shared_fs_gbps") or {}).items():
        rows.append([f"shared fs {name}", _num(value), _ratio(value, limit), own])
    return ["what", "GB/s", "x limit", "x peer"], rows


# vllm_ttft records made before they said their block size used 32-token blocks
VLLM_TTFT_OLD_BLOCK = 32


def vllm_loaded_bytes(result: dict[str, Any]) -> int:
    """The bytes a warm hit of a vllm_ttft prompt loads: its full blocks before the last token
    (the connector leaves that one to vLLM), not the whole prompt's KV."""
    if "loaded_bytes" in result:
        return int(result["loaded_bytes"])
    block = int(result.get("block_size", VLLM_TTFT_OLD_BLOCK))
    tokens = int(result["tokens"])
    return int(result["kv_bytes"]) // (tokens // block) * ((tokens - 1) // block)


def paired_ratio(row: dict[str, Any]) -> Any:
    """The median of a row's TTFTs over vLLM's own prefix hit right after each, in the same
    engine ("-" for records made before the pairs were)."""
    own = row.get("own_hit_ttft_s_runs") or []
    pairs = [t / o for t, o in zip(row["ttft_s_runs"], own, strict=False) if o > 0]
    return float(np.median(pairs)) if pairs else "-"


# vllm_ttft's rows after the cold prefill and vLLM's own prefix hit, in the order they run
VLLM_TTFT_ROWS = (
    "tpusync DRAM",
    "tpusync DRAM own threads",
    "tpusync DRAM by layer",
    "tpusync disk",
    "tpusync store node",
    "Example /dev/shm",
    "Example disk",
)


def bracketing_limits(
    runs: dict[str, list[float]], nbytes: int, rows: Sequence[str | None]
) -> dict[str, float]:
    """Each row's memory limit (GB/s) from a ``MemoryLimit``'s runs: ``rows[k]`` names the row
    that sample ``k`` was taken in (after one of its hits, the last one after the row), None
    for samples before the first row. A row's limit is the fastest of its own samples and the
    last sample before it, each sample's best method. This VM's memory speed drifts within
    seconds, so a load is set beside what the memory did around it, not a median over all."""
    best = _sample_bests(runs, nbytes)
    limits: dict[str, float] = {}
    for k, row in enumerate(rows[: len(best)]):
        if row is None:
            continue
        if row not in limits:
            limits[row] = best[k - 1] if k else best[k]
        limits[row] = max(limits[row], best[k])
    return limits


def _sample_bests(runs: dict[str, list[float]], nbytes: int) -> list[float]:
    """Each ``MemoryLimit`` sample's limit in GB/s: its fastest method (``np.copyto`` never
    is one)."""
    methods = [m for m in runs if m != "np.copyto"]
    return [max(nbytes / runs[m][k] for m in methods) / 1e9 for k in range(len(runs[methods[0]]))]


def hit_limit_ratio(result: dict[str, Any], row: str) -> Any:
    """The median, over a vllm_ttft row's hits, of each load's GB/s over the memory limit
    around that hit: the faster of the samples taken just before it (after the previous hit's
    pair, or the last one before the row) and just after its pair (the hit and the prefix hit
    after it). The machine's memory speed can flip from one minute to the next
    (docs/connectors/vllm.md), and the fastest sample around a whole row
    (:func:`row_memory_limit`) may come from the other speed than its loads; the samples on
    both sides of a hit, seconds apart (the row's first hit: the sample before it was taken
    before its engine started), say what the memory did while it loaded. "-" for records
    without samples taken in the row."""
    runs, rows = result.get("limit_s_runs"), result.get("limit_sampled_in")
    loads = (result.get(row) or {}).get("load_s_runs") or []
    if not isinstance(runs, dict) or not rows or not loads:
        return "-"
    best = _sample_bests(runs, int(result["kv_bytes"]))
    after = [k for k, name in enumerate(rows[: len(best)]) if name == row]
    # one sample after each hit's pair and one before the row, or the pairs are unknown
    if len(after) != len(loads) or after[0] == 0:
        return "-"
    around = [max(best[k - 1], best[k]) for k in after]
    loaded = vllm_loaded_bytes(result)
    ratios = [loaded / s / 1e9 / g for s, g in zip(loads, around, strict=True) if s == s and s > 0]
    return float(np.median(ratios)) if ratios else "-"


def row_memory_limit(result: dict[str, Any], row: str) -> float:
    """A vllm_ttft row's memory limit (GB/s): derived from the samples and the rows they were
    taken in (:func:`bracketing_limits`) where the record has them, else the per-row limits
    that older records stored, else (older still) the size's median limit."""
    if "limit_sampled_in" in result:
        by_row = bracketing_limits(
            result["limit_s_runs"], int(result["kv_bytes"]), result["limit_sampled_in"]
        )
    else:
        by_row = result.get("limit_gbps_by_row") or {}
    return float(by_row.get(row, result["limit_gbps"]))


def paired_over_hit(result: dict[str, Any]) -> dict[str, float]:
    """Per row of a vllm_ttft prompt that has the pairs: the median of its TTFT minus vLLM's
    own prefix hit right after it in the same engine (seconds)."""
    over = {}
    for name, row in result.items():
        if isinstance(row, dict) and row.get("own_hit_ttft_s_runs") and row.get("ttft_s_runs"):
            pairs = zip(row["ttft_s_runs"], row["own_hit_ttft_s_runs"], strict=False)
            over[name] = float(np.median([t - o for t, o in pairs]))
    return over


def _vllm_ttft(record: dict[str, Any]) -> Table:
    headers = ["tokens", "cold ms", "vLLM prefix hit ms", "tpusync DRAM ms (x hit; paired)",
               "DRAM load x limit (per hit)", "tpusync disk ms", "disk load x limit",
               "tpusync node ms", "x Example (over hit, paired): shm / disk"]  # fmt: skip
    rows = []
    fio = (record.get("disk_limit") or {}).get("fio_read_gbps")
    for r in record.get("results", []):
        med = {k: float(np.median(v)) for k, v in _ttft_runs(r).items() if v}
        hit = med.get("prefix")
        if not hit:
            continue
        over = {k: v - hit for k, v in med.items()}
        over.update(paired_over_hit(r))  # where each hit has vLLM's own beside it: those
        loads = (r.get("tpusync DRAM") or {}).get("load_s_runs") or []
        load = float(np.median(loads)) if loads else None
        loaded = vllm_loaded_bytes(r)
        dram_gbps = loaded / load / 1e9 if load else None
        disk_loads = (r.get("tpusync disk") or {}).get("load_s_runs") or []
        disk_load = float(np.median(disk_loads)) if disk_loads else None
        disk_gbps = loaded / disk_load / 1e9 if disk_load else None

        rows.append([
            str(r.get("tokens")), _num(med.get("cold", 0) * 1e3, 1), _num(hit * 1e3, 1),
            f"{med.get('tpusync DRAM', 0) * 1e3:.1f} ({med.get('tpusync DRAM', 0) / hit:.2f}"
            f"{_paired(r.get('tpusync DRAM') or {})})",
            _ratio(dram_gbps, row_memory_limit(r, "tpusync DRAM") if "limit_gbps" in r else None)
            + _hit_limit(r),
            _num(med.get("tpusync disk", 0) * 1e3, 1),
            _ratio(disk_gbps, fio) if fio else "-",
            _num(med.get("tpusync store node", 0) * 1e3, 1),
            f"{_faster(over, 'tpusync DRAM', 'Example /dev/shm')} / "
            f"{_faster(over, 'tpusync disk', 'Example disk')}",
        ])  # fmt: skip
    return headers, rows


def _hit_limit(result: dict[str, Any]) -> str:
    ratio = hit_limit_ratio(result, "tpusync DRAM")
    return f" ({ratio:.2f})" if isinstance(ratio, float) else ""


def _paired(row: dict[str, Any]) -> str:
    ratio = paired_ratio(row) if row.get("ttft_s_runs") else "-"
    return f"; {ratio:.2f}" if isinstance(ratio, float) else ""


def _faster(over: dict[str, float], ours: str, theirs: str) -> str:
    """How many times ``theirs`` takes ``ours``'s time over the prefix hit."""
    mine, other = over.get(ours), over.get(theirs)
    return f"{other / mine:.1f}x" if mine and other and mine > 0 else "-"


def _ttft_runs(r: dict[str, Any]) -> dict[str, list[float]]:
    runs = {"cold": r.get("cold_ttft_s_runs") or [], "prefix": r.get("prefix_ttft_s_runs") or []}
    for row in VLLM_TTFT_ROWS:
        runs[row] = (r.get(row) or {}).get("ttft_s_runs") or []
    return runs


def _vllm_load_contention(record: dict[str, Any]) -> Table:
    rows = []
    for r in record.get("results", []):
        limit = r.get("limit_gbps")
        for name, gbps in r.items():
            if ", copy threads " in name:
                rows.append([str(r.get("tokens")), name, _num(gbps), _ratio(gbps, limit)])
    return ["tokens", "load", "GB/s", "x limit"], rows


def hicache_round_trip(result: dict[str, Any], backend: str) -> float | None:
    """An sglang_hicache row's round trip in GB/s: the batch's bytes twice over the median set
    plus the median get time (None where ``backend`` has no runs)."""
    runs = (result.get("runs") or {}).get(backend) or {}
    if not runs.get("set") or not runs.get("get"):
        return None
    moved = result["batch_pages"] * result["page_bytes"]
    return 2 * moved / (float(np.median(runs["set"])) + float(np.median(runs["get"]))) / 1e9


def _sglang_hicache(record: dict[str, Any]) -> Table:
    rows = []
    for r in record.get("results", []):
        ours, file = hicache_round_trip(r, "tpusync"), hicache_round_trip(r, "sglang file")
        rows.append([
            r.get("layout", "?"), str(r.get("page_size")), _num(ours),
            _ratio(ours, r.get("limit_gbps")), _num(file) if file else "-",
            f"{ours / file:.1f}x" if ours and file else "-",
        ])  # fmt: skip
    headers = ["layout", "page tokens", "tpusync round trip GB/s", "x limit",
               "SGLang file GB/s", "tpusync x file"]  # fmt: skip
    return headers, rows


def _weights(record: dict[str, Any]) -> Table:
    g = record.get("gbps", {})
    lim = (record.get("limit") or {}).get("gbps")
    net = (record.get("tcp_limit") or {}).get("gbps")
    reshard = record.get("reshard_device_put_gbps")

    names = {"raw pull": "BlockClient", "jax e2e": "jax.experimental.transfer",
             "orbax e2e": "orbax"}  # fmt: skip

    def row(label: str, key: str, limit: float | None, peers: tuple[str, ...]) -> list[str]:
        value = g.get(key)
        ratios = [f"{value / g[p]:.1f}x {names[p]}" for p in peers if value and g.get(p)]
        return [label, _num(value), _ratio(value, limit), ", ".join(ratios) or "-"]

    e2e = ("jax e2e", "orbax e2e")

    rows = [
        ["memory limit / TCP limit (2 streams)", f"{_num(lim)} / {_num(net)}", "", ""],
        ["jax.device_put 8x1 -> 2x4 in process", _num(reshard), "", ""],
        ["BlockClient pull of the chunks", _num(g.get("raw pull")), _ratio(g.get("raw pull"), net),
         ""],
        ["jax.experimental.transfer + device_put", _num(g.get("jax e2e")), "", ""],
        ["orbax save + restore", _num(g.get("orbax e2e")), "", ""],
        row("publish", "publish", lim, ()),
        row("same host: pull", "shm pull", lim, ()),
        row("same host: end to end", "shm e2e", lim, e2e),
        row("in process: publish -> commit", "in-process e2e", lim, ()),
        row("network: pull", "net pull", net, ("raw pull",)),
        row("network: end to end", "net e2e", net, e2e),
    ]  # fmt: skip
    return ["path (1.26 GiB bf16, 8x1 -> 2x4)", "GB/s", "x limit", "x peers"], rows


def _generic(record: dict[str, Any]) -> Table:
    rows = [[k, _num(v)] for k, v in record.items() if isinstance(v, int | float)]
    return ["figure", "value"], rows


def _vllm_disagg(record: dict[str, Any]) -> Table:
    headers = ["tokens", "cold ms", "consumer TTFT ms (x cold)", "transfer GB/s (TCP)",
               "x TCP limit", "data plane GB/s", "transfer x data plane",
               "ExampleConnector consumer ms", "NIXL consumer ms, GB/s (this host)",
               "NIXL consumer ms, GB/s (TCP)",
               "same host: consumer ms, transfer GB/s, x its pull alone, x copy limit",
               "TCP, ends unpinned: consumer ms, transfer GB/s, x its pull alone",
               "same tokens"]  # fmt: skip
    rows = []
    for r in record.get("results", []):
        ours, peer = r.get("tpusync") or {}, r.get("ExampleConnector") or {}
        local = r.get("tpusync same host") or {}
        unpinned = r.get("tpusync, ends unpinned") or {}
        runs = [r.get("cold_ttft_s_runs"), ours.get("ttft_s_runs"), ours.get("load_s_runs"),
                r.get("data_plane_s_runs"), peer.get("ttft_s_runs")]  # fmt: skip
        if not all(runs):
            continue
        cold, ttft, load, plane, example = (float(np.median(v)) for v in runs)  # type: ignore[arg-type]
        if r.get("data_plane_best"):  # older records: its own node, the best repeat
            plane = float(min(r["data_plane_s_runs"]))
        # else the median; since data_plane_paired, of each load's pull repeated alone
        gb = float(r.get("loaded_bytes", 0)) / 1e9
        tcp_limit, memory_limit = disagg_limits(r)
        local_figures = paired_figures(local, gb, memory_limit)
        unpinned_figures = paired_figures(unpinned, gb, None)
        nixl = [r.get(f"NIXL {t}") or {} for t in ("cma", "tcp")]
        same = bool(ours.get("outputs_equal") and peer.get("outputs_equal")) and all(
            p.get("outputs_equal", True)
            for p in [*nixl, local, unpinned]  # True: not run
        )
        rows.append([
            str(r.get("tokens")), _num(cold * 1e3, 1),
            f"{ttft * 1e3:.1f} ({ttft / cold:.2f}x)", _num(gb / load),
            _ratio(gb / load, tcp_limit), _num(gb / plane),
            # a paired repeat of the load's own pull is no limit: ours may match it within noise
            f"{plane / load:.2f}" if r.get("data_plane_paired") else _ratio(gb / load, gb / plane),
            _num(example * 1e3, 1),
            *(", ".join(nixl_figures(p, int(r.get("loaded_bytes", 0)))) for p in nixl),
            ", ".join(local_figures) if local_figures else "-",
            ", ".join(unpinned_figures[:3]) if unpinned_figures else "-",
            "yes" if same else "NO",
        ])  # fmt: skip
    return headers, rows


def disagg_limits(r: dict[str, Any]) -> tuple[float | None, float | None]:
    """A ``vllm_disagg`` result's physical limits in GB/s: one TCP stream over loopback and a
    streaming memory copy (None in records from before they were measured)."""
    found = []
    for key in ("tcp_limit", "memory_limit"):
        gbps = (r.get(key) or {}).get("limit_gbps")
        found.append(float(gbps) if isinstance(gbps, int | float) and gbps > 0 else None)
    return found[0], found[1]


def paired_figures(
    local: dict[str, Any], gb: float, limit_gbps: float | None
) -> tuple[str, str, str, str] | None:
    """A ``vllm_disagg`` consumer with its own paired pulls alone (None where not measured):
    its median TTFT (ms), transfer rate (GB/s), transfer against those pulls, and its rate
    against ``limit_gbps`` ("-" for None)."""
    runs = [local.get(k) for k in ("ttft_s_runs", "load_s_runs", "data_plane_s_runs")]
    if not all(runs):
        return None
    ttft, load, plane = (float(np.median(v)) for v in runs)  # type: ignore[arg-type]
    return (
        f"{ttft * 1e3:.1f}",
        f"{gb / load:.2f}",
        f"{plane / load:.2f}",
        _ratio(gb / load, limit_gbps),
    )


def nixl_figures(peer: dict[str, Any], loaded_bytes: int) -> tuple[str, str]:
    """A NIXL consumer's median TTFT (ms) and transfer rate (GB/s, over the bytes NIXL says it
    moved where recorded), or why it has none: "not run" (nixl missing), "failed"."""
    if "missing" in peer:
        return "not run", "-"
    if "error" in peer:
        return "failed", "-"
    ttft = peer.get("ttft_s_runs") or []
    pairs = [
        (s, n)
        for s, n in zip(
            peer.get("load_s_runs") or [],
            peer.get("load_bytes_runs") or [loaded_bytes] * len(ttft),
            strict=False,
        )
        if s == s and s > 0  # NaN: no transfer seen
    ]
    if not ttft:
        return "-", "-"
    rate = f"{float(np.median([n / s for s, n in pairs])) / 1e9:.2f}" if pairs else "-"
    return f"{float(np.median(ttft)) * 1e3:.1f}", rate


TABLES: dict[str, Callable[[dict[str, Any]], Table]] = {
    "transfer": _transfer,
    "tiers": _tiers,
    "prefix": _prefix,
    "network": _network,
    "mac_cost": _mac_cost,
    "vllm_ttft": _vllm_ttft,
    "vllm_disagg": _vllm_disagg,
    "vllm_load_contention": _vllm_load_contention,
    "sglang_hicache": _sglang_hicache,
    "weights": _weights,
}


def _when(path: Path, record: dict[str, Any]) -> str:
    stamp = record.get("date") or record.get("time")
    return str(stamp) if stamp else f"mtime {path.stat().st_mtime:.0f}"


def latest_results(results_dir: str | os.PathLike[str]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The latest result file of each benchmark folder (by its recorded date, else mtime)."""
    latest: dict[str, tuple[Path, dict[str, Any]]] = {}
    base = Path(results_dir)
    if not base.is_dir():
        return latest
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        found = []
        for path in folder.glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(record, dict):
                found.append((_when(path, record), path.stat().st_mtime, path, record))
        if found:
            _, _, path, record = max(found, key=lambda item: (item[0], item[1]))
            latest[folder.name] = (path, record)
    return latest


def _markdown(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def write_results_md(
    results_dir: str | os.PathLike[str], target: str | os.PathLike[str] | None = None
) -> Path:
    """Writes a markdown table per benchmark from its latest file in ``results_dir``
    (``<bench>/<commit>-<machine>.json``) to ``target`` (default: ``RESULTS.md`` beside
    ``results_dir`` when it is the scheme's own ``results`` folder, as ``benchmarks/results``
    is, else inside it: a run into ``--results-dir /tmp/x`` writes nothing into ``/tmp``).
    Returns the path written."""
    base = Path(results_dir)
    if target is not None:
        out = Path(target)
    else:
        out = (base.parent if base.name == "results" else base) / "RESULTS.md"
    lines = [
        "# Benchmark results",
        "",
        "Generated by `tpusync bench` from the latest file of each benchmark in "
        f"`{base.name}/<bench>/<commit>-<machine>.json`; do not edit. Ratios are to the physical "
        "limit measured in the same run (`tpusync._src.bench.limits`); a ratio above 1 means the "
        "limit is wrong.",
    ]
    for bench, (path, record) in latest_results(base).items():
        load = record.get("load_average") or {}
        start, end = load.get("start"), load.get("end")
        load_text = (
            f"load average {start[0]:.2f} at start, {end[0]:.2f} at end"
            if start and end
            else "load average not recorded"
        )
        machine = record.get("machine") or {}
        lines += [
            "",
            f"## {bench}",
            "",
            f"`{path.relative_to(base.parent)}`: commit `{record.get('commit', 'unknown')}`, "
            f"{_when(path, record)}, {machine.get('name') or machine.get('platform', '?')}, "
            f"{load_text}.",
            "",
        ]
        headers, rows = TABLES.get(bench, _generic)(record)
        lines += _markdown(headers, rows) if rows else ["(no rows)"]
    out.write_text("\n".join(lines) + "\n")
    return out

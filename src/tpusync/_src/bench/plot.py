"""PNG charts of benchmark results (``tpusync bench --plot DIR``): GB/s bars with each group's
limit as a horizontal line, TTFT bars. matplotlib is optional (``pip install tpusync[bench]``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tpusync._src.cli_common import have_matplotlib
from tpusync.errors import PlotUnavailableError

__all__ = ["PLOTS", "PlotUnavailableError", "have_matplotlib", "plot_results"]

INSTALL_HINT = "pip install tpusync[bench]"


def _pyplot() -> Any:
    if not have_matplotlib():
        raise PlotUnavailableError(f"--plot: needs matplotlib; install it with `{INSTALL_HINT}`")
    import matplotlib  # optional heavy dependency: tpusync[bench], only --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional heavy dependency: tpusync[bench], only --plot

    return plt


Group = tuple[str, dict[str, float], float | None]  # label, bars, limit


def _bars(
    path: Path,
    title: str,
    ylabel: str,
    groups: Sequence[Group],
    limit_label: str = "limit",
    log: bool = False,
) -> Path:
    """Grouped bars, one group per label, each group's limit a horizontal line over it, each
    bar's value on it; ``log``: a log scale (TTFTs cold and warm differ a hundredfold)."""
    plt = _pyplot()
    series = list(dict.fromkeys(name for _, bars, _ in groups for name in bars))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) ** 0.5 + 3),
                                    4.5))  # fmt: skip
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shown: set[str] = set()
    for g, (_, bars, _) in enumerate(groups):  # only the bars a group has, centred on it
        names = [name for name in series if name in bars]
        for k, name in enumerate(names):
            x = g + (k - (len(names) - 1) / 2) * width
            color = colors[series.index(name) % len(colors)]
            label = None if name in shown else name
            shown.add(name)
            drawn = ax.bar([x], [bars[name]], width * 0.95, color=color, label=label)
            # on a white box above the limit lines: a value next to its limit stays readable
            texts = ax.bar_label(drawn, fmt="%.3g", fontsize=7, padding=1, zorder=4)
            for text in texts:
                text.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.6,
                               "alpha": 0.85})  # fmt: skip
    labelled = False
    for g, (_, _, limit) in enumerate(groups):
        if limit:
            ax.hlines(limit, g - 0.45, g + 0.45, colors="black", linestyles="--", linewidth=1.5,
                      label=None if labelled else limit_label)  # fmt: skip
            labelled = True
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([label for label, _, _ in groups], rotation=20, ha="right")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _transfer(record: dict[str, Any], out: Path) -> list[Path]:
    groups: list[Group] = []
    for r in record.get("results", []):
        bars = {name: r[f"{k}_gbps"] for k, name in
                (("d2h_native", "D2H native"), ("d2h_jax", "D2H jax"),
                 ("d2h_tpu_sync", "D2H TPU Sync"), ("h2d_native", "H2D native"),
                 ("h2d_jax", "H2D jax"), ("h2d_tpu_sync", "H2D TPU Sync"))
                if f"{k}_gbps" in r}  # fmt: skip
        groups.append((f"{r['block_kib']} KiB", bars, r.get("limit_gbps")))
    return [_bars(out / "transfer.png", "device <-> host, scattered blocks", "GB/s", groups,
                  "memory limit")]  # fmt: skip


def _tiers(record: dict[str, Any], out: Path) -> list[Path]:
    dram: list[Group] = []
    for r in record.get("results", []):
        bars = {k.replace("_", " "): r[f"{k}_gbps"] for k in
                ("put", "get", "get_fresh", "put_jax", "get_jax") if f"{k}_gbps" in r}  # fmt: skip
        dram.append((f"{r['tier']} {r['block_mib']} MiB", bars, r.get("limit_gbps")))
    lower_put: list[Group] = []
    lower_get: list[Group] = []
    for r in record.get("disk", []):
        label = f"{r['tier']} {r['block_mib']} MiB"
        lower_put.append((label, {"put": r["put_gbps"], "raw write": r["raw_write_gbps"]},
                          r.get("limit_write_gbps", r.get("fio_write_gbps"))))  # fmt: skip
        lower_get.append((label, {"get": r["get_gbps"], "raw read": r["raw_read_gbps"]},
                          r.get("limit_read_gbps", r.get("fio_read_gbps"))))  # fmt: skip
    paths = [_bars(out / "tiers_dram.png", "DRAM tier, checksums on", "GB/s", dram,
                   "memory limit")]  # fmt: skip
    if lower_put:
        paths.append(_bars(out / "tiers_disk_write.png", "disk / shared-FS put", "GB/s",
                           lower_put, "limit (fio or raw loop)"))  # fmt: skip
        paths.append(_bars(out / "tiers_disk_read.png", "disk / shared-FS get", "GB/s",
                           lower_get, "limit (fio or raw loop)"))  # fmt: skip
    return paths


def _prefix(record: dict[str, Any], out: Path) -> list[Path]:
    groups: list[Group] = []
    for r in record.get("results", []):
        bars = {name: r[key] * 1e3 for name, key in
                (("cold", "cold_ttft_s"), ("DRAM", "dram_ttft_s"),
                 ("/dev/shm restart", "shm_restart_ttft_s"), ("disk", "disk_ttft_s"))
                if key in r}  # fmt: skip
        groups.append((f"{r['tokens']} tokens", bars, None))
    return [_bars(out / "prefix_ttft.png", "time to first token, cold vs prefix hit",
                  "TTFT (ms, log scale)", groups, log=True)]  # fmt: skip


def _network(record: dict[str, Any], out: Path) -> list[Path]:
    loop = record.get("loopback") or {}
    gbps, limits = loop.get("gbps", {}), loop.get("limit_gbps", {})
    peers = {name: gbps[name] for name in ("jax.experimental.transfer",
             "Mooncake transfer engine (tcp)") if name in gbps}  # fmt: skip
    groups: list[Group] = []
    for count, limit in limits.items():
        suffix = f"{count} conn{'s' if int(count) > 1 else ''}"
        bars = {name: gbps[f"tpusync{name} {suffix}"] for name in ("", " TLS", " push")
                if f"tpusync{name} {suffix}" in gbps}  # fmt: skip
        bars = {("tpusync" + k): v for k, v in bars.items()}
        bars.update(peers)
        groups.append((suffix, bars, limit))
    return [_bars(out / "network.png", "loopback pulls between two processes", "GB/s", groups,
                  "TCP limit")]  # fmt: skip


def _mac_cost(record: dict[str, Any], out: Path) -> list[Path]:
    gbps = dict(record.get("gbps", {}))
    limit = gbps.pop("limit", None)
    with_mac = record.get("dram_with_mac_gbps") or {}
    bars = {**gbps, **{f"{k} + MAC": v for k, v in with_mac.items()}}
    groups: list[Group] = [("DRAM, 2 MiB blocks", bars, limit)]
    if "mac" in bars:
        bars["Poly1305 tags"] = bars.pop("mac")
    shared = {
        k.replace(" mac", ", mac_key"): v for k, v in (record.get("shared_fs_gbps") or {}).items()
    }
    if shared:
        groups.append(("shared FS on tmpfs", shared, limit))
    return [_bars(out / "mac_cost.png", "what a MAC per block costs", "GB/s", groups,
                  "memory limit")]  # fmt: skip


PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "transfer": _transfer,
    "tiers": _tiers,
    "prefix": _prefix,
    "network": _network,
    "mac_cost": _mac_cost,
}


def plot_results(
    bench: str, record: dict[str, Any], directory: str | os.PathLike[str]
) -> list[Path]:
    """PNGs of one benchmark's results in ``directory``; the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plot = PLOTS.get(bench)
    return plot(record, out) if plot else []

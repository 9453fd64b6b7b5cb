"""`tpusync bench`: the command runs a benchmark, writes its result in the scheme
``<results>/<bench>/<commit>-<machine>.json`` and RESULTS.md; the old script keeps its command
line; a ratio above its limit is flagged in the table; --plot without matplotlib says which
extra to install. No figure is asserted: timings on a shared machine are noise."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

import tpusync
from tpusync._src.bench.common import LIMIT_BEATEN, format_table, listen_port
from tpusync._src.bench.plot import plot_results
from tpusync._src.bench.results import (
    TABLES,
    bracketing_limits,
    hicache_round_trip,
    hit_limit_ratio,
    paired_over_hit,
    row_memory_limit,
    vllm_loaded_bytes,
    write_results_md,
)
from tpusync._src.bench.tiers import fastest_read

# the children import the tpusync under test (a relative PYTHONPATH breaks in another cwd)
ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(
        [str(Path(tpusync.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    ),
)


def _tpusync(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tpusync", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def test_bench_transfer_quick_writes_the_scheme_and_results_md(tmp_path: Path) -> None:
    results = tmp_path / "results"
    done = _tpusync(
        "bench", "transfer", "--quick", "--json", "--total-mib", "4", "--repeats", "1",
        "--results-dir", str(results), "--peers-dir", str(tmp_path / "no-peers"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # --json: stdout is JSON only, the tables go to stderr
    assert "x limit" in done.stderr and "limit" in done.stderr
    files = list((results / "transfer").glob("*.json"))
    assert len(files) == 1
    commit, _, machine = files[0].stem.rpartition("-cpu-")
    assert commit and machine.endswith("core")
    record = json.loads(files[0].read_text())
    assert record == printed["transfer"]
    for key in ("commit", "date", "machine", "load_average", "results", "peers"):
        assert key in record
    assert len(record["load_average"]["start"]) == len(record["load_average"]["end"]) == 3
    assert record["peers"]["Google TPU Sync"].startswith("skipped")  # no environment there
    assert "TPU Sync" in done.stderr and "x peer" in done.stderr
    row = record["results"][0]
    for key in ("d2h_native_gbps", "d2h_jax_gbps", "h2d_native_gbps", "h2d_jax_gbps",
                "limit_gbps", "limit_method", "copyto_gbps", "d2h_native_x_limit"):  # fmt: skip
        assert key in row
    assert row["limit_method"] in row["limit_gbps_by_method"]
    markdown = (tmp_path / "RESULTS.md").read_text()
    assert "## transfer" in markdown and files[0].name in markdown


def test_old_transfer_script_keeps_its_command_line(tmp_path: Path) -> None:
    """benchmarks/ab.py runs `benchmarks/transfer.py ... --json X` and reads X."""
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "transfer.py"), "--total-mib", "4",
         "--repeats", "1", "--block-kib", "1024", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["results"][0]["block_kib"] == 1024 and "d2h_native_gbps" in record["results"][0]


def test_table_row_beating_its_limit_is_flagged() -> None:
    table = format_table(
        ["what", "GB/s", "x limit", "x jax"],
        [["ok", 5.0, 0.93, 3.0], ["too fast", 9.0, 1.07, 0.5]],
        limit_columns=(2,),
    )
    lines = table.splitlines()
    assert "warning" in lines[0]
    ok = next(line for line in lines if line.lstrip().startswith("ok"))
    fast = next(line for line in lines if line.lstrip().startswith("too fast"))
    assert LIMIT_BEATEN not in ok
    assert LIMIT_BEATEN in fast and "x limit" in fast
    # a peer ratio above 1 is no beaten limit, and a table without one has no warning column
    plain = format_table(["what", "x limit", "x jax"], [["ok", 0.5, 4.0]], limit_columns=(1,))
    assert LIMIT_BEATEN not in plain and "warning" not in plain


def test_results_md_takes_the_latest_file_and_flags_beaten_limits(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "transfer").mkdir(parents=True)
    row = {"block_kib": 256, "limit_gbps": 10.0, "limit_method": "stream",
           "d2h_native_gbps": 12.5, "d2h_jax_gbps": 2.0, "h2d_native_gbps": 7.0,
           "h2d_jax_gbps": 1.5}  # fmt: skip
    for commit, date in (("aaaa", "2026-01-01T00:00:00Z"), ("bbbb", "2026-02-01T00:00:00Z")):
        record = {
            "commit": commit,
            "date": date,
            "machine": {"name": "cpu-2core"},
            "load_average": {"start": [1.5, 1, 1], "end": [2.5, 1, 1]},
            "results": [row],
        }
        (results / "transfer" / f"{commit}-cpu-2core.json").write_text(json.dumps(record))
    (results / "tiers").mkdir()
    (results / "tiers" / "unknown-commit-cpu-2core.json").write_text(json.dumps({"results": []}))
    path = write_results_md(results)
    assert path == tmp_path / "RESULTS.md"
    text = path.read_text()
    assert "bbbb-cpu-2core.json" in text and "aaaa-cpu-2core.json" not in text
    assert "load average 1.50 at start, 2.50 at end" in text
    assert "1.25 (limit beaten: the limit is wrong)" in text and "0.70" in text
    assert "## tiers" in text


def test_vllm_ttft_rates_divide_the_bytes_loaded_not_the_prompts_kv() -> None:
    per_token = 16384
    # a record that says its block size and loaded bytes is taken at its word
    said = {"tokens": 1024, "kv_bytes": 1024 * per_token, "block_size": 16, "loaded_bytes": 7}
    assert vllm_loaded_bytes(said) == 7
    # 1024 tokens in 32-token blocks: the last token's block is vLLM's, 31 blocks load
    old = {"tokens": 1024, "kv_bytes": 1024 * per_token}
    assert vllm_loaded_bytes(old) == 31 * 32 * per_token
    odd = {"tokens": 1000, "kv_bytes": 31 * 32 * per_token, "block_size": 32}
    assert vllm_loaded_bytes(odd) == 31 * 32 * per_token


def test_vllm_ttft_over_hit_pairs_each_hit_with_vllms_own_right_after_it() -> None:
    result = {
        "tokens": 1024,
        "tpusync DRAM": {"ttft_s_runs": [0.030, 0.020, 0.050],
                         "own_hit_ttft_s_runs": [0.027, 0.019, 0.040]},
        "Example disk": {"ttft_s_runs": [0.5]},  # an old record: no pairs, left out
    }  # fmt: skip
    over = paired_over_hit(result)
    assert over.keys() == {"tpusync DRAM"}
    assert over["tpusync DRAM"] == pytest.approx(0.003)  # the median of 3, 1 and 10 ms


def test_vllm_ttft_row_limit_is_the_fastest_sample_in_or_just_before_the_row() -> None:
    gib = 1 << 30
    # sample 0 before the rows, 1-2 after row a's hits, 3-4 after row b's; seconds per 1 GiB
    runs = {
        "memcpy": [gib / 10e9, gib / 30e9, gib / 10e9, gib / 10e9, gib / 10e9],
        "stream": [gib / 20e9, gib / 25e9, gib / 15e9, gib / 12e9, gib / 14e9],
        "np.copyto": [gib / 90e9] * 5,  # never a limit
    }
    sampled_in = [None, "a", "a", "b", "b"]
    by_row = bracketing_limits(runs, gib, sampled_in)
    assert by_row == pytest.approx({"a": 30.0, "b": 15.0})  # b: a's last sample leads in
    slow_start = {"stream": [gib / 40e9, gib / 12e9, gib / 16e9, gib / 11e9, gib / 13e9]}
    assert bracketing_limits(slow_start, gib, sampled_in) == pytest.approx({"a": 40.0, "b": 16.0})
    sampled = {"limit_gbps": 21.0, "limit_s_runs": slow_start, "kv_bytes": gib,
               "limit_sampled_in": sampled_in}  # fmt: skip
    assert row_memory_limit(sampled, "a") == pytest.approx(40.0)  # derived from the samples
    record = {"limit_gbps": 21.0, "limit_gbps_by_row": {"b": 16.0}}
    assert row_memory_limit(record, "b") == pytest.approx(16.0)
    assert row_memory_limit({"limit_gbps": 21.0}, "b") == 21.0  # an older record


def test_vllm_ttft_hit_limit_sets_each_load_beside_the_faster_sample_around_it() -> None:
    gib = 1 << 30
    # sample 0 before the rows (fast memory), 1-3 after row a's three hits (slow), 4 after b's
    runs = {"stream": [gib / 40e9, gib / 20e9, gib / 25e9, gib / 20e9, gib / 30e9],
            "np.copyto": [gib / 90e9] * 5}  # fmt: skip
    record = {
        "tokens": 1024, "kv_bytes": gib, "block_size": 32, "loaded_bytes": gib, "limit_gbps": 9.0,
        "limit_s_runs": runs, "limit_sampled_in": [None, "a", "a", "a", "b"],
        "a": {"load_s_runs": [gib / 10e9, gib / 20e9, gib / 16e9]},
        "b": {"load_s_runs": []},
    }  # fmt: skip
    # 10/max(40, 20), 20/max(20, 25), 16/max(25, 20): the median 0.64; against the fastest
    # sample around the whole row, 0.4; against the sample after each hit alone, 0.8
    assert hit_limit_ratio(record, "a") == pytest.approx(0.64)
    assert 16 / row_memory_limit(record, "a") == pytest.approx(0.4)
    assert hit_limit_ratio(record, "b") == "-"  # no loads
    assert hit_limit_ratio({"a": record["a"]}, "a") == "-"  # an older record: no samples
    # no sample before the row's first hit: that hit has no limit before it
    first = {**record, "limit_s_runs": {k: v[1:] for k, v in runs.items()},
             "limit_sampled_in": ["a", "a", "a", "b"]}  # fmt: skip
    assert hit_limit_ratio(first, "a") == "-"


def test_vllm_disagg_compares_like_with_like() -> None:
    mb = 10**6
    record = {
        "tokens": 1024, "loaded_bytes": 16 * mb,
        "cold_ttft_s_runs": [0.5],
        "ExampleConnector": {"ttft_s_runs": [0.03], "outputs_equal": True},
        "tpusync": {"ttft_s_runs": [0.02], "load_s_runs": [0.008, 0.010, 0.009],
                    "outputs_equal": True},
        "data_plane_s_runs": [0.009, 0.004, 0.008],
    }  # fmt: skip
    headers = TABLES["vllm_disagg"]({"results": [dict(record, data_plane_paired=True)]})[0]
    column = headers.index("transfer x data plane")

    def ratio(r: dict[str, object]) -> str:
        return str(TABLES["vllm_disagg"]({"results": [r]})[1][0][column])

    # paired repeats of the loads' own pulls: median against median (8 ms / 9 ms)
    assert ratio(dict(record, data_plane_paired=True)) == "0.89"
    # an older record's pulls from a node of their own: their best (4 ms / 9 ms)
    assert ratio(dict(record, data_plane_best=True)) == "0.44"
    # a paired repeat is not a limit: matching it is not flagged as beating one
    faster = dict(record, data_plane_paired=True, data_plane_s_runs=[0.010, 0.011, 0.012])
    assert ratio(faster) == "1.22"
    assert ratio(dict(faster, data_plane_paired=False)).endswith("the limit is wrong)")
    # the consumer reading the node's pool file: its own transfer against its own pulls alone
    local = headers.index("same host: consumer ms, transfer GB/s, x its pull alone, x copy limit")
    tcp = headers.index("x TCP limit")
    assert TABLES["vllm_disagg"]({"results": [record]})[1][0][local] == "-"  # not measured
    read = {"ttft_s_runs": [0.01], "load_s_runs": [0.004, 0.002, 0.003],
            "data_plane_s_runs": [0.004, 0.0036, 0.003], "outputs_equal": True}  # fmt: skip
    row = TABLES["vllm_disagg"]({"results": [dict(record, **{"tpusync same host": read})]})[1][0]
    assert row[local] == "10.0, 5.33, 1.20, -" and row[tcp] == "-" and row[-1] == "yes"
    # the limits measured in the same run: 1.78 GB/s over TCP, 5.33 GB/s from the file
    limits = {"tcp_limit": {"limit_gbps": 3.56}, "memory_limit": {"limit_gbps": 10.66}}
    row = TABLES["vllm_disagg"](
        {"results": [dict(record, **limits, **{"tpusync same host": read})]}
    )[1][0]
    assert row[tcp] == "0.50" and row[local] == "10.0, 5.33, 1.20, 0.50"
    read = dict(read, outputs_equal=False)
    row = TABLES["vllm_disagg"]({"results": [dict(record, **{"tpusync same host": read})]})[1][0]
    assert row[-1] == "NO"
    # the TCP consumer with its ends left to the kernel: against its own pulls alone, no limit
    unpinned = headers.index("TCP, ends unpinned: consumer ms, transfer GB/s, x its pull alone")
    free = {"ttft_s_runs": [0.03], "load_s_runs": [0.016, 0.020], "data_plane_s_runs": [0.009],
            "outputs_equal": True}  # fmt: skip
    row = TABLES["vllm_disagg"]({"results": [dict(record, **{"tpusync, ends unpinned": free})]})[1][
        0
    ]
    assert row[unpinned] == "30.0, 0.89, 0.50" and row[-1] == "yes"
    assert TABLES["vllm_disagg"]({"results": [record]})[1][0][unpinned] == "-"


def test_sglang_hicache_round_trip_moves_the_batch_twice_over_set_plus_get() -> None:
    runs = {"tpusync": {"set": [0.01, 0.03, 0.02], "get": [0.02, 0.01, 0.04]}}
    result = {"batch_pages": 128, "page_bytes": 1 << 20, "runs": runs}
    assert hicache_round_trip(result, "tpusync") == pytest.approx(2 * 128 * 2**20 / 0.04 / 1e9)
    assert hicache_round_trip(result, "sglang file") is None


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """The real command in a process where matplotlib cannot be imported (None in sys.modules)."""
    plots = tmp_path / "plots"
    blocked = (
        "import sys; sys.modules['matplotlib'] = None; from tpusync._src.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked, "bench", "transfer", "--quick", "--plot", str(plots),
         "--results-dir", str(tmp_path / "results")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--plot" in done.stderr and "pip install tpusync[bench]" in done.stderr
    assert not plots.exists() and not (tmp_path / "results").exists()  # refused before running


def test_plot_writes_pngs_with_the_limit(tmp_path: Path) -> None:
    row = {"block_kib": 256, "limit_gbps": 10.0, "d2h_native_gbps": 6.5, "d2h_jax_gbps": 1.5,
           "h2d_native_gbps": 7.0, "h2d_jax_gbps": 1.2}  # fmt: skip
    record = {"results": [row]}
    paths = plot_results("transfer", record, tmp_path)
    assert [p.name for p in paths] == ["transfer.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_written_by_a_run_leave_the_commit_clean(tmp_path: Path) -> None:
    """RESULTS.md and results/ are rewritten by every run: they must not make the next run's
    results "+dirty"; any other tracked change must."""
    from tpusync._src.bench.common import commit_of

    def git(*argv: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, capture_output=True,
                       timeout=30)  # fmt: skip

    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    (tmp_path / "benchmarks" / "results" / "x").mkdir(parents=True)
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("a\n")
    (tmp_path / "benchmarks" / "results" / "x" / "r.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "-A")
    git("commit", "-qm", "init")
    clean = commit_of(tmp_path / "benchmarks")
    assert len(clean) == 40 and not clean.endswith("+dirty")
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("b\n")
    (tmp_path / "benchmarks" / "results" / "x" / "r.json").write_text("{1}\n")
    assert commit_of(tmp_path / "benchmarks") == clean
    (tmp_path / "code.py").write_text("a = 2\n")
    assert commit_of(tmp_path / "benchmarks") == clean + "+dirty"


def _checkout(root: Path) -> Path:
    """A checkout's wheel sources: a Python module, a stub, a header and the build files."""
    (root / "src" / "tpusync" / "bench").mkdir(parents=True)
    (root / "src" / "tpusync" / "bench" / "run.py").write_text("ROWS = 3\n")
    (root / "src" / "tpusync" / "api.pyi").write_text("def f() -> int: ...\n")
    (root / "include").mkdir()
    (root / "include" / "core.h").write_text("int f(void);\n")
    (root / "meson.build").write_text("project('t')\n")
    (root / "pyproject.toml").write_text("[project]\n")
    return root


def test_a_wheel_built_from_other_sources_is_named_stale(tmp_path: Path) -> None:
    """A benchmark run in an environment whose wheel predates the checkout's last change
    measures old code: its results must not go under the checkout's commit. Without the
    environment's stamp the Python files are compared."""
    from tpusync._src.bench.common import stale_install

    checkout = _checkout(tmp_path / "checkout")
    sources, installed = checkout / "src" / "tpusync", tmp_path / "site" / "tpusync"
    shutil.copytree(sources, installed)
    assert stale_install(installed, checkout) is None
    assert stale_install(installed, tmp_path / "no-checkout") is None
    assert stale_install(sources, checkout) is None  # run from the checkout itself
    (sources / "bench" / "run.py").write_text("ROWS = 4\n")
    assert "run.py" in (stale_install(installed, checkout) or "")
    (sources / "bench" / "run.py").write_text("ROWS = 3\n")
    (sources / "new.py").write_text("x = 1\n")  # not in the wheel at all
    assert "new.py" in (stale_install(installed, checkout) or "")


def test_the_environments_wheel_fingerprint_covers_every_source(tmp_path: Path) -> None:
    """With the stamp scripts/_engine_envs.sh writes (the wheel of .wheelhouse/<fingerprint>/),
    any change to what the wheel is built from (a header included) makes the install stale,
    and undoing it (same contents, new times) makes it current again."""
    from tpusync._src.bench.common import stale_install

    script = REPO / "scripts" / "_fingerprint.sh"
    checkout = _checkout(tmp_path / "checkout")
    (checkout / "scripts").mkdir()
    shutil.copy(script, checkout / "scripts" / "_fingerprint.sh")
    installed = tmp_path / "site" / "tpusync"
    shutil.copytree(checkout / "src" / "tpusync", installed)

    def fingerprint() -> str:
        return subprocess.run(
            ["bash", str(checkout / "scripts" / "_fingerprint.sh"), str(checkout)],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip

    stamp = tmp_path / ".tpusync-installed"
    stamp.write_text(f"{checkout}/.wheelhouse/{fingerprint()}/tpusync-0-cp311.whl\n")
    assert stale_install(installed, checkout, stamp) is None
    header = checkout / "include" / "core.h"
    header.write_text("int f(int);\n")
    assert "other sources" in (stale_install(installed, checkout, stamp) or "")
    header.write_text("int f(void);\n")
    assert stale_install(installed, checkout, stamp) is None


def test_results_md_goes_inside_a_results_dir_of_another_name(tmp_path: Path) -> None:
    """--results-dir /tmp/x must not write /tmp/RESULTS.md."""
    other = tmp_path / "quick-run"
    (other / "transfer").mkdir(parents=True)
    (other / "transfer" / "abc-cpu-2core.json").write_text(json.dumps({"results": []}))
    assert write_results_md(other) == other / "RESULTS.md"
    assert not (tmp_path / "RESULTS.md").exists()
    scheme = tmp_path / "results"
    (scheme / "transfer").mkdir(parents=True)
    assert write_results_md(scheme) == tmp_path / "RESULTS.md"


def test_the_disk_limit_is_the_fastest_fio_sample() -> None:
    samples = [
        {"fio_read_gbps": 2.2, "fio_read_method": "a"},
        {"fio_write_gbps": 1.0},  # fio's read failed in this one
        {"fio_read_gbps": 4.1, "fio_read_method": "b"},
    ]
    best = fastest_read(samples)
    assert best["fio_read_gbps"] == 4.1 and best["fio_read_method"] == "b"
    assert best["fio_read_gbps_samples"] == [2.2, 4.1]
    assert "fio_read_gbps_samples" not in samples[2]  # a copy
    assert fastest_read([{"fio_numjobs": 4}]) == {"fio_numjobs": 4, "fio_read_gbps_samples": []}


def test_listen_port_is_free_and_outside_the_ephemeral_range() -> None:
    """A port a child will listen on later: never one that binding port 0 can hand out."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(5):
        port = listen_port()
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_bench_without_a_name_lists_the_benchmarks_and_runs_none(tmp_path: Path) -> None:
    """Issue 54: `tpusync bench` ran every benchmark (most of an hour); now it is the list."""
    from tpusync._src.bench.command import ABOUT, BENCHES, NEEDS

    assert set(BENCHES) <= set(ABOUT) and set(NEEDS) <= set(ABOUT)
    done = _tpusync("bench", cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    for name, (what, duration) in ABOUT.items():
        line = next(line for line in done.stdout.splitlines() if line.split()[:1] == [name])
        assert duration in line and what in line and "min" in duration
        assert ("needs" in line) == (name not in BENCHES), line
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing was written


def test_results_go_where_the_help_says(tmp_path: Path) -> None:
    """The help's default for --results-dir is where a run writes (an installed tpusync: the
    working directory's tpusync-bench-results, not a checkout's benchmarks/results)."""
    shown = subprocess.run(
        [sys.executable, "-m", "tpusync", "bench", "--help"], cwd=tmp_path, capture_output=True,
        text=True, timeout=60, env={**ENV, "COLUMNS": "500"},  # argparse wraps at hyphens too
    ).stdout  # fmt: skip
    shown = " ".join(shown.split())
    match = re.search(
        r"--results-dir DIR where results and RESULTS\.md go \(default: (\S+)\)", shown
    )
    assert match is not None, shown
    done = _tpusync(
        "bench", "mac_cost", "--quick", "--total-mib", "4", "--repeats", "1", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.parent.name for p in Path(match[1]).glob("*/*.json")] == ["mac_cost"]
    assert (Path(match[1]) / "RESULTS.md").is_file()


def test_a_missing_peer_says_how_to_make_it_here_or_from_a_clone(tmp_path: Path) -> None:
    """An installed tpusync has no benchmarks/peers/setup.sh: the hint says where it is; a
    --peers-dir in a checkout gets its script's command."""
    from tpusync._src.bench import external

    installed = external.peer_state("tpu-sync", tmp_path)
    assert "pip installs no scripts" in installed and "--peers-dir" in installed
    peers_dir = tmp_path / "checkout" / "benchmarks" / "peers"
    peers_dir.mkdir(parents=True)
    (peers_dir / "setup.sh").write_text("")
    state = external.peer_state("tpu-sync", peers_dir)
    assert f"make it with `bash {peers_dir / 'setup.sh'}`" in state

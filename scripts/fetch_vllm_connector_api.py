"""Fetches the KV connector interface (``kv_connector/v1/base.py``) of the newest vLLM release
on PyPI into a directory, for tests/vllm/test_connector_api.py to check TpuSyncConnector
against it even where that release's engine cannot run (GPU builds only).

Usage: python scripts/fetch_vllm_connector_api.py DIRECTORY

Writes DIRECTORY/base.py and DIRECTORY/VERSION; does nothing when VERSION already names the
newest release. Reads PyPI's JSON API and streams the release's source archive (~50 MB),
keeping only that one file (standard library only)."""

from __future__ import annotations

import json
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

MEMBER = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
INDEX = "https://pypi.org/pypi/vllm/json"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(sys.argv[1])
    with urllib.request.urlopen(INDEX, timeout=60) as answer:
        release = json.load(answer)
    version = release["info"]["version"]
    stamp = target / "VERSION"
    if stamp.is_file() and stamp.read_text().strip() == version and (target / "base.py").is_file():
        return 0
    sdists = [u for u in release["urls"] if u["packagetype"] == "sdist"]
    if not sdists:
        print(f"vLLM {version} has no source archive on PyPI", file=sys.stderr)
        return 1
    target.mkdir(parents=True, exist_ok=True)
    with (
        # a mirror may answer with URLs relative to the API's
        urllib.request.urlopen(
            urllib.parse.urljoin(INDEX, sdists[0]["url"]), timeout=300
        ) as stream,
        tarfile.open(fileobj=stream, mode="r|gz") as archive,
    ):
        for member in archive:
            if member.isfile() and member.name.endswith("/" + MEMBER):
                data = archive.extractfile(member)
                assert data is not None
                (target / "base.py").write_bytes(data.read())
                stamp.write_text(version + "\n")
                print(f"tpusync: vLLM {version}'s {MEMBER} in {target}")
                return 0
    print(f"vLLM {version}'s source archive has no {MEMBER}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

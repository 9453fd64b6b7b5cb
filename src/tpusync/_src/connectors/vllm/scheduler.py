"""The scheduler side of the vLLM connector: how many tokens of a request the store holds
beyond vLLM's own prefix hit (asked of the worker side, which pins them), which blocks to load
where, and which blocks became full and are to be saved, step by step."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tpusync._src.connectors.vllm.events import as_list
from tpusync._src.connectors.vllm.lookup_service import LookupClient
from tpusync._src.connectors.vllm.metadata import LoadSpec, SaveSpec, TpuSyncMetadata
from tpusync._src.connectors.vllm.settings import ConnectorSettings
from tpusync._src.connectors.vllm.stats import (
    CacheHitSource,
    hit_sources,
    lower_tiers_source,
    tier_sources,
)
from tpusync._src.connectors.vllm.worker import local_worker

__all__ = ["SchedulerSide"]

log = logging.getLogger("tpusync.connectors.vllm")

# how long a scheduling step waits for a new lookup's answer before asking again next step
# (local tiers answer well within it; a store node's lookup over the network may not)
FIRST_WAIT_S = 0.01
# while a producer's announced blocks are not all in the store: the pause between lookups
REMOTE_RETRY_S = 0.05


@dataclass
class _Lookup:
    sequence: int
    local_blocks: int  # vLLM's own prefix hit, in blocks
    blocks: int  # what the store holds after it (pinned by the worker)
    is_async: bool


@dataclass
class _Asking:
    """A lookup sent to the worker side and not answered yet."""

    sequence: int
    local_blocks: int
    usable_blocks: int
    answer: concurrent.futures.Future[tuple[int, bool] | None]
    deadline: float  # time.monotonic() after which it is a miss


@dataclass
class _Tracked:
    """What the scheduler side keeps per running request."""

    request: Any  # vLLM's Request (its block_hashes grow as tokens are appended)
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks already sent to be saved
    loaded: range = range(0)  # blocks loaded from the store: not saved again


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        # one client per tensor-parallel rank: each pins its own part of the blocks
        paths = settings.socket_paths or (settings.socket_path,)
        self._clients = [LookupClient(path, settings.lookup_timeout_s) for path in paths]
        self._sequence = itertools.count(1)
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        # vLLM's null block (bind_block_pool): what a sliding window's dropped blocks point to;
        # never loaded into, never saved from
        self.null_block_id: int | None = None
        # req_id -> (vLLM's own hit in blocks, below DRAM) of its load, until vLLM asks where
        # the hit came from (hit_sources)
        self._hits: dict[str, tuple[int, bool]] = {}
        self._sources = tier_sources(settings.store)
        self._lower_source = lower_tiers_source(self._sources)
        self._loads: list[LoadSpec] = []
        self._releases: list[tuple[str, int]] = []
        self._events: list[Any] = []  # the worker's KV events, until vLLM takes them
        self._issued: dict[str, int] = {}  # req_id -> its last lookup's sequence
        self._asking: dict[str, _Asking] = {}
        # requests waiting for a producer's blocks: req_id -> (waiting since, next lookup at)
        self._awaiting: dict[str, tuple[float, float]] = {}
        self._waited_out: set[str] = set()  # waited remote_wait_s once: never again
        # one thread asks (each socket client is one connection): a stuck lookup delays the
        # next ones, which become misses at their deadlines, never the scheduler
        self._asker = concurrent.futures.ThreadPoolExecutor(1, "tpusync-vllm-lookup")
        # with tensor parallelism it asks every rank at once, a thread per rank: a lookup takes
        # the slowest rank's time, not the sum of all of theirs
        self._rank_askers = (
            concurrent.futures.ThreadPoolExecutor(len(self._clients), "tpusync-vllm-lookup-rank")
            if len(self._clients) > 1
            else None
        )

    def _ask(self, req_id: str, sequence: int, hashes: list[bytes]) -> tuple[int, bool] | None:
        worker = local_worker(self.settings.engine_id)
        if worker is not None:  # the same process: no socket
            return worker.answer(req_id, sequence, hashes)
        if self._rank_askers is None:
            answers = [self._clients[0].lookup(req_id, sequence, hashes)]
        else:
            asked = [
                self._rank_askers.submit(client.lookup, req_id, sequence, hashes)
                for client in self._clients
            ]
            # every rank's, also after one failed: no client is still busy at the next lookup
            concurrent.futures.wait(asked)
            answers = [future.result() for future in asked]
        if any(answer is None for answer in answers):
            return None  # a rank that does not answer: a miss (every rank releases its pins)
        # a block counts only where every rank holds its part
        return min(a[0] for a in answers), any(a[1] for a in answers)  # type: ignore[index]

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the tokens after ``num_computed_tokens`` the
        store holds in full blocks, leaving the last token to vLLM; asynchronous when any is
        below DRAM. ``None`` while the worker side has not answered yet (vLLM asks again next
        step); no answer within ``lookup_timeout_s`` is a miss."""
        if self.settings.role == "kv_producer":
            return 0, False  # a prefill engine computes; it only saves
        req_id = request.request_id
        bs = self.block_size
        local = num_computed_tokens // bs
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        announced = 0 if req_id in self._waited_out else min(self._announced(request), usable)
        asking = self._asking.get(req_id)
        if asking is not None and (asking.local_blocks, asking.usable_blocks) != (local, usable):
            del self._asking[req_id]  # asked about other blocks: that answer is of no use
            self._release(req_id, asking.sequence)
            asking = None
        wait = 0.0
        if asking is None:
            self._forget_lookup(req_id)
            if usable <= local:
                return 0, False
            awaiting = self._awaiting.get(req_id)
            if awaiting is not None and time.monotonic() < awaiting[1]:
                return None, False  # a producer's blocks are on their way: look again soon
            asking = self._start_lookup(request, local, usable)
            # a request still waiting for a producer takes its answer next step: its lookups
            # never hold this step
            wait = 0.0 if awaiting is not None else FIRST_WAIT_S
        try:
            answer = asking.answer.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            if time.monotonic() < asking.deadline:
                return None, False
            answer = None
            log.info("tpusync vllm: no lookup answer for %s in time: a miss", req_id)
        except Exception as error:  # a lookup that failed is a miss, never a scheduler crash
            answer = None
            log.warning("tpusync vllm: the lookup of %s failed (a miss): %s", req_id, error)
        del self._asking[req_id]
        short = answer is None or local + answer[0] < announced
        if announced > local and short and self._keep_waiting(req_id):
            self._release(req_id, asking.sequence)  # what it found is looked up again
            return None, False
        self._awaiting.pop(req_id, None)
        if answer is None:  # a miss; whatever it pinned (or pins later) is released
            self._release(req_id, asking.sequence)
            return 0, False
        blocks, is_async = answer
        if not blocks:  # some rank may still have pinned blocks the others lack
            self._release(req_id, asking.sequence)
            return 0, False
        self._lookups[req_id] = _Lookup(asking.sequence, local, blocks, is_async)
        return blocks * bs, is_async

    def _announced(self, request: Any) -> int:
        """The blocks a producer saved for ``request``, as its ``kv_transfer_params`` say
        (``{"tpusync": {"blocks": n}}``, what :meth:`finished` returns on the producer); 0 when
        they say nothing of it, or nothing valid (a client's own params never stall a
        request)."""
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get("tpusync") if isinstance(params, dict) else None
        if ours is None:
            return 0
        blocks = ours.get("blocks") if isinstance(ours, dict) else None
        if type(blocks) is not int or blocks < 0:
            log.warning(
                'tpusync vllm: %s: kv_transfer_params["tpusync"] is not {"blocks": n}; '
                "ignored (%.100r)",
                request.request_id,
                ours,
            )
            return 0
        return blocks

    def _keep_waiting(self, req_id: str) -> bool:
        """Whether a request whose announced blocks are not all in the store yet waits on (and
        when it looks again), or has waited ``remote_wait_s`` and computes the rest."""
        now = time.monotonic()
        since = self._awaiting.get(req_id, (now, now))[0]
        if now - since >= self.settings.remote_wait_s:
            self._waited_out.add(req_id)  # asked again (preempted, no room): no second wait
            log.warning(
                "tpusync vllm: %s: the producer's blocks did not all reach the store within "
                "remote_wait_s (%g s); the rest is computed",
                req_id,
                self.settings.remote_wait_s,
            )
            return False
        self._awaiting[req_id] = (since, now + REMOTE_RETRY_S)
        return True

    def _start_lookup(self, request: Any, local: int, usable: int) -> _Asking:
        req_id = request.request_id
        sequence = next(self._sequence)
        self._issued[req_id] = sequence
        hashes = [bytes(h) for h in request.block_hashes[local:usable]]
        now = self._answer_from_dram(req_id, sequence, hashes)
        if now is None:
            answer = self._asker.submit(self._ask, req_id, sequence, hashes)
        else:
            answer = concurrent.futures.Future()
            answer.set_result(now)
        asking = _Asking(
            sequence, local, usable, answer, time.monotonic() + self.settings.lookup_timeout_s
        )
        self._asking[req_id] = asking
        return asking

    def _answer_from_dram(
        self, req_id: str, sequence: int, hashes: list[bytes]
    ) -> tuple[int, bool] | None:
        """In one process, the answer of a lookup DRAM's index settles (it waits for no other
        lookup): the hop to the asker thread and back costs more than such a lookup. ``None``
        otherwise, also when it fails: the asker then looks in every tier."""
        worker = local_worker(self.settings.engine_id)
        if worker is None:
            return None
        try:
            return worker.answer_from_dram(req_id, sequence, hashes)
        except Exception as error:  # never an exception into vLLM's scheduler
            log.warning("tpusync vllm: the DRAM lookup of %s failed: %s", req_id, error)
            return None

    def _forget_lookup(self, req_id: str) -> None:
        old = self._lookups.pop(req_id, None)
        if old is not None:
            self._release(req_id, old.sequence)

    def _release(self, req_id: str, sequence: int) -> None:
        """Releases ``req_id``'s lookups up to ``sequence``: at once in one process, else with
        the next step's metadata (in order with its loads)."""
        worker = local_worker(self.settings.engine_id)
        if worker is not None:
            worker.release(req_id, sequence)
        else:
            self._releases.append((req_id, sequence))

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the blocks to load the hit into."""
        req_id = request.request_id
        self._tracked.setdefault(req_id, _Tracked(request))
        lookup = self._lookups.pop(req_id, None)
        if lookup is None:
            return
        n = min(num_external_tokens // self.block_size, lookup.blocks)
        if n <= 0:
            self._release(req_id, lookup.sequence)
            return
        hit = list(blocks.blocks[0][lookup.local_blocks : lookup.local_blocks + n])
        # a sliding window's blocks before it are vLLM's null block: a leading run, not loaded
        skip = next((i for i, block in enumerate(hit) if not block.is_null), len(hit))
        if skip:
            self.null_block_id = hit[0].block_id
        ids = [block.block_id for block in hit[skip:]]
        sequence = lookup.sequence
        if any(block.is_null for block in hit[skip:]):  # never seen: fail the load, not guess
            log.error("tpusync vllm: %s: a null block after a real one; the load fails", req_id)
            self._release(req_id, sequence)
            sequence = -1  # pins nothing: the worker reports every block as a load error
        self._loads.append(LoadSpec(req_id, sequence, ids, lookup.is_async, skip))
        self._hits[req_id] = (lookup.local_blocks, lookup.is_async)
        tracked = self._tracked[req_id]
        tracked.block_ids = list(blocks.get_block_ids()[0])  # invalid_blocks looks here
        tracked.loaded = range(lookup.local_blocks, lookup.local_blocks + n)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's ``get_external_cache_hit_sources``: the hit's tokens by the tier they come
        from. Exact in one process (the worker's pins say each block's tier); across
        processes a hit DRAM holds whole is ``host`` and one below DRAM is named by the store's
        lower tiers (``disk``, ``p2p``, or ``external_unspecified`` where they are of several
        kinds): the lookup's answer carries no per-block tiers."""
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return {}
        worker = local_worker(self.settings.engine_id)
        tiers = worker.pinned_tiers(request.request_id) if worker is not None else None
        if tiers is not None and hit is not None:
            return hit_sources(tiers, self._sources, self.block_size, num_external_tokens)
        if hit is not None and not hit[1]:
            return {CacheHitSource.HOST: num_external_tokens}
        return {self._lower_source: num_external_tokens}

    def reset_store(self) -> bool:
        """Drops the store's blocks of this engine's namespace (vLLM's connector reset); False
        where the worker side runs in another process."""
        worker = local_worker(self.settings.engine_id)
        store = worker.store if worker is not None else None
        if store is None:
            log.warning(
                "tpusync vllm: a connector reset reaches the store only with the worker in "
                "this process; nothing was dropped"
            )
            return False
        dropped = store.purge()
        log.info("tpusync vllm: connector reset: %d blocks dropped from the store", dropped)
        return True

    def build_meta(self, scheduler_output: Any) -> TpuSyncMetadata:
        """vLLM's ``build_connector_meta``: this step's loads, releases, and the saves of the
        blocks its forward fills."""
        meta = TpuSyncMetadata(
            loads=self._loads,
            releases=self._releases,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._loads, self._releases = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            # vLLM computes what failed to load: only blocks before that came from the store
            valid = new.num_computed_tokens // self.block_size
            tracked.loaded = range(tracked.loaded.start, min(tracked.loaded.stop, valid))
            self._add_save(
                meta, new.req_id, tracked, new.num_computed_tokens + scheduled[new.req_id]
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: all of its blocks
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._add_save(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _add_save(
        self, meta: TpuSyncMetadata, req_id: str, tracked: _Tracked, computed: int
    ) -> None:
        if self.settings.role == "kv_consumer":
            return  # a decode engine loads; it saves nothing
        hashes = tracked.request.block_hashes
        # newer vLLM hashes blocks it does not let anyone publish yet (lookahead): never saved
        publishable = getattr(tracked.request, "num_publishable_block_hashes", None)
        if not isinstance(publishable, int):  # vLLM 0.32-0.34: every hash is publishable
            publishable = len(hashes)
        full = min(computed // self.block_size, publishable, len(hashes), len(tracked.block_ids))
        if full <= tracked.saved_blocks:
            return
        first, bs = tracked.saved_blocks, self.block_size
        tokens = tracked.request.all_token_ids
        skip = tracked.loaded  # the store holds them: it just served them
        for lo, hi in self._real_runs(tracked.block_ids, first, full, skip):
            meta.saves.append(
                SaveSpec(
                    req_id,
                    [bytes(h) for h in hashes[lo:hi]],
                    tracked.block_ids[lo:hi],
                    parent_hash=bytes(hashes[lo - 1]) if lo else None,
                    token_ids=[list(tokens[i * bs : (i + 1) * bs]) for i in range(lo, hi)],
                )
            )
        tracked.saved_blocks = full

    def _real_runs(
        self, block_ids: list[int], first: int, full: int, loaded: range
    ) -> list[tuple[int, int]]:
        """The runs of blocks ``first`` to ``full`` to save: not ``loaded`` and not vLLM's null
        block (a sliding window's dropped blocks hold no KV of theirs)."""
        runs: list[tuple[int, int]] = []
        start = None
        for i in range(first, full + 1):
            keep = i < full and i not in loaded and block_ids[i] != self.null_block_id
            if keep and start is None:
                start = i
            elif not keep and start is not None:
                runs.append((start, i))
                start = None
        return runs

    def worker_output(self, connector_output: Any) -> None:
        """vLLM's ``update_connector_output``: blocks that failed to load, the worker's
        events."""
        self.invalid_blocks(set(connector_output.invalid_block_ids or ()))
        self._events.extend(as_list(connector_output.kv_cache_events))

    def take_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events

    def invalid_blocks(self, block_ids: set[int]) -> None:
        """Blocks that failed to load: vLLM recomputes them, so they are saved again after."""
        if not block_ids:
            return
        for tracked in self._tracked.values():
            bad = [i for i, b in enumerate(tracked.block_ids) if b in block_ids]
            if bad:
                tracked.saved_blocks = min(tracked.saved_blocks, bad[0])
                tracked.loaded = range(0)  # what failed to load is saved once recomputed

    def finished(self, request: Any) -> dict[str, Any] | None:
        """vLLM's ``request_finished``: forget the request (its saves are already copied out
        of its blocks: the worker waits for that within the step). A producer returns the
        request's ``kv_transfer_params``: how many of its leading blocks it saved."""
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        self._awaiting.pop(req_id, None)
        self._waited_out.discard(req_id)
        self._lookups.pop(req_id, None)
        self._asking.pop(req_id, None)
        self._hits.pop(req_id, None)
        last = self._issued.pop(req_id, None)
        if last is not None:  # every lookup of it, also one that answers late
            self._release(req_id, last)
        if self.settings.role != "kv_producer":
            return None
        return {"tpusync": {"blocks": tracked.saved_blocks if tracked is not None else 0}}

    def close(self) -> None:
        self._asker.shutdown(wait=True, cancel_futures=True)  # its lookup waits for its ranks'
        if self._rank_askers is not None:
            self._rank_askers.shutdown(wait=True, cancel_futures=True)
        for client in self._clients:
            client.close()

"""A minimal serving loop of the test model over a KV cache store (for tests, demo, benchmarks).

:class:`ToyEngine` owns the model's paged KV pools as :class:`~tpusync.DevicePool`, a block
allocator, and optionally a :class:`~tpusync.kv.KVCacheStore`. A request looks its prompt up,
loads the cached prefix into freshly allocated blocks, prefills the rest in chunks, samples
greedily, saves the prompt's full blocks, and frees its blocks once the save released them —
the loop of an engine connector, without the engine.

Exactness: a warm run with ``C`` cached tokens prefills ``[C, len)``; the cold reference with
``boundary=C`` prefills ``[0, C)`` and then ``[C, len)`` with the same chunking, so both compute
the same floats in the same order: equal greedy tokens, logits equal bit for bit.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.results import LoadResult
from tpusync._src.kv.store import KVCacheStore
from tpusync._src.memory.device_pool import DevicePool, lock_of, wait_for_readers
from tpusync._src.testing import model as M
from tpusync.errors import TierFullError


@dataclass(frozen=True)
class Request:
    """One generation: its tokens, the first token's logits, and where the time went."""

    tokens: np.ndarray
    prefill_logits: np.ndarray
    ttft_s: float  # request start to first token known (lookup + load + prefill)
    cached_tokens: int  # tokens whose KV came from the store
    load: LoadResult | None
    lookup_tiers: tuple[str, ...]
    kv_tokens: np.ndarray  # the tokens whose KV the request's blocks hold (prompt + out[:-1])
    blocks: tuple[int, ...] = ()  # the request's device blocks, when kept (keep_blocks=True)


class ToyEngine:
    """The test model served with (or without) a KV cache store.

    Args:
      config: the model's configuration.
      store_config: None for no store; else the store's configuration (its ``block_size`` must
        be ``config.block_size``).
      params: the weights (default: :func:`~tpusync.testing.model.init_params` of ``config``).
    """

    def __init__(
        self,
        config: M.ModelConfig,
        store_config: KVStoreConfig | None = None,
        *,
        params: M.Params | None = None,
    ) -> None:
        if store_config is not None and store_config.block_size != config.block_size:
            raise ValueError(
                f"store_config.block_size ({store_config.block_size}) must equal the model's "
                f"block_size ({config.block_size})"
            )
        self.config = config
        self.params = params if params is not None else M.init_params(config)
        self.kv = [
            DevicePool(array, name=f"kv{i}", donated_steps=True)  # its steps donate the KV
            for i, array in enumerate(M.init_kv_pools(config))
        ]
        self.store = KVCacheStore(store_config, self.kv) if store_config is not None else None
        self._free = list(range(config.num_blocks - 1, -1, -1))
        self._saves: list[Any] = []  # save futures not yet checked (wait_saves)

    # --- blocks ----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"the device pool has {len(self._free)} free blocks, {n} needed")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def _arrays(self) -> list[jax.Array]:
        return [pool.array for pool in self.kv]

    def _update(self, arrays: list[jax.Array]) -> None:
        for pool, array in zip(self.kv, arrays, strict=True):
            pool.update(array)

    # --- requests --------------------------------------------------------------------------

    def generate(
        self,
        prompt: Any,
        n_new: int = 1,
        *,
        use_cache: bool = True,
        save: bool = True,
        boundary: int | None = None,
        chunk: int | None = None,
        keep_blocks: bool = False,
    ) -> Request:
        """Serves one prompt greedily for ``n_new`` tokens.

        With ``use_cache`` the cached prefix is looked up and loaded (on a full hit the last
        token is recomputed); without it, ``boundary`` (if given) splits the cold prefill at
        that position, to reproduce a warm run's chunking. ``save`` saves the prompt's full
        blocks afterwards. With ``keep_blocks`` the request's device blocks are returned instead
        of freed (for a session offload)."""
        prompt = np.asarray(prompt, dtype=np.int32)
        n_new = max(int(n_new), 1)
        total = len(prompt) + n_new - 1
        blocks = self.allocate(M.blocks_needed(self.config, total))
        try:
            table = np.asarray(blocks, dtype=np.int32)
            load = None
            tiers: tuple[str, ...] = ()
            start = time.perf_counter()
            cached = 0
            if self.store is not None and use_cache:
                try:
                    with self.store.lookup(prompt) as hit:  # released unless loaded
                        tiers = hit.tiers
                        if hit.num_blocks:
                            load = self.store.load(hit, blocks[: hit.num_blocks])
                            cached = min(load.loaded_tokens, len(prompt) - 1)
                except TierFullError:  # no DRAM room to stage the hit: serve it cold
                    load, cached = None, 0
            elif boundary:
                _, pools = M.prefill(
                    self.params, self.config, self._arrays(), prompt[:boundary], table, 0
                )
                self._update(pools)
                cached = boundary
            first = M.generate_greedy(
                self.params,
                self.config,
                self._arrays(),
                prompt,
                table,
                1,
                chunk=chunk,
                cached_len=cached,
            )
            self._update(first.kv_pools)
            ttft = time.perf_counter() - start
            out = self._decode(int(first.tokens[0]), table, len(prompt), n_new)
            if save and self.store is not None:
                saving = self.store.save_async(prompt, blocks)
                saving.released.result()
                self._saves.append(saving)
        except BaseException:
            self.free(blocks)  # a failed request leaks no device blocks
            raise
        if not keep_blocks:
            self.free(blocks)
        return Request(
            np.asarray(out, np.int32),
            first.prefill_logits,
            ttft,
            cached if use_cache else 0,
            load,
            tiers,
            np.concatenate([prompt, np.asarray(out[:-1], np.int32)]),
            tuple(blocks) if keep_blocks else (),
        )

    def _decode(self, first: int, table: np.ndarray, pos: int, n_new: int) -> list[int]:
        out = [first]
        for _ in range(n_new - 1):
            logits, pools = M.decode_step(
                self.params, self.config, self._arrays(), out[-1], table, pos
            )
            self._update(pools)
            out.append(int(jnp.argmax(logits)))
            pos += 1
        return out

    # --- agent sessions --------------------------------------------------------------------

    def pause(self, session_id: str, request: Request) -> float:
        """Offloads a request kept with ``keep_blocks`` as a session and frees its device
        blocks; returns the seconds until the blocks were released."""
        assert self.store is not None and request.blocks, "generate(..., keep_blocks=True) first"
        start = time.perf_counter()
        future = self.store.offload_session_async(
            session_id, request.kv_tokens, list(request.blocks)
        )
        future.released.result()
        released = time.perf_counter() - start
        self.free(list(request.blocks))
        future.result()
        return released

    def resume(self, session_id: str, next_token: int, n_new: int) -> Request:
        """Restores a paused session into new blocks and decodes ``n_new`` more tokens, the
        first being the one after ``next_token`` (the paused request's last output)."""
        assert self.store is not None
        start = time.perf_counter()
        tokens = self.store.session_tokens(session_id)  # SessionNotFoundError: none
        blocks = self.allocate(M.blocks_needed(self.config, len(tokens) + n_new))
        table = np.asarray(blocks, dtype=np.int32)
        try:
            restored = self.store.restore_session(session_id, blocks)
        except BaseException:
            self.free(blocks)
            raise
        tokens = restored.tokens.astype(np.int32)
        if restored.loaded_tokens < len(tokens):  # lost blocks: recompute their KV
            _, pools = M.prefill(
                self.params,
                self.config,
                self._arrays(),
                tokens[restored.loaded_tokens :],
                table,
                restored.loaded_tokens,
            )
            self._update(pools)
        logits, pools = M.decode_step(
            self.params, self.config, self._arrays(), next_token, table, len(tokens)
        )
        self._update(pools)
        first = int(jnp.argmax(logits))
        ttft = time.perf_counter() - start
        out = self._decode(first, table, len(tokens) + 1, n_new)
        self.free(blocks)
        return Request(
            np.asarray(out, np.int32),
            np.asarray(logits),
            ttft,
            restored.loaded_tokens,
            None,
            ("session",),
            np.concatenate([tokens, [next_token], np.asarray(out[:-1], np.int32)]),
        )

    def warmup(self, prompt_len: int, n_new: int = 1, *, cold: bool = True) -> None:
        """Compiles what a request of ``prompt_len`` tokens runs, so timings exclude compilation:
        with ``cold`` the whole cold path (a throwaway prompt prefilled with a boundary at its
        last token, which also covers the warm path), else only the warm path (the last token
        and the decode steps over whatever KV the blocks hold; the results are discarded)."""
        dummy = (np.arange(prompt_len, dtype=np.int64) * 7919 % self.config.vocab_size).astype(
            np.int32
        )
        if self.store is not None:
            self.store.warmup()  # plans its moves, compiles the pools' donated identity step
        else:
            with contextlib.ExitStack() as locks:  # compiles the pools' donated identity step
                for pool in self.kv:
                    locks.enter_context(lock_of(pool))
                wait_for_readers(self.kv)
        if cold:
            self.generate(dummy, n_new, use_cache=False, save=False, boundary=prompt_len - 1)
            return
        blocks = self.allocate(M.blocks_needed(self.config, prompt_len + max(n_new, 1) - 1))
        table = np.asarray(blocks, dtype=np.int32)
        first = M.generate_greedy(
            self.params, self.config, self._arrays(), dummy, table, 1, cached_len=prompt_len - 1
        )
        self._update(first.kv_pools)
        self._decode(int(first.tokens[0]), table, prompt_len, n_new)
        self.free(blocks)

    def block_bytes(self) -> int:
        """KV bytes of one block across all pools."""
        return sum(int(np.prod(p.shape[1:])) * p.dtype.itemsize for p in self.kv)

    def wait_saves(self) -> None:
        """Waits for the saves started so far and raises the first one's error."""
        saves, self._saves = self._saves, []
        for future in saves:
            future.result()

    def close(self) -> None:
        if self.store is not None:
            try:
                self.wait_saves()
            finally:
                self.store.close()

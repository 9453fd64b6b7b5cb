"""SGLang's host KV pool seen as tpusync blocks: one page of the pool is one block.

Each layout of SGLang's host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``)
stores a page as one or more contiguous regions of its ``kv_buffer``; here each region becomes
a view ``[page_num, page_size, rest]`` (page axis 0, token axis 1) that the store copies pages
out of and into natively, with no torch copy. The regions come in the order of SGLang's flat
page (``get_data_page(flat=True)``: all of K, then all of V), so a flat page is the regions'
parts of one page, concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync.errors import InvalidArgumentError

__all__ = ["HostPages", "host_pages", "page_ids"]

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


@dataclass(frozen=True)
class HostPages:
    """The pages of one SGLang host pool.

    Attributes:
      layout: the pool's layout (``--hicache-mem-layout``).
      page_size: tokens per page.
      page_num: pages in the pool.
      regions: per region of a page, a view ``[page_num, page_size, rest]`` of ``kv_buffer``.
      dtype: the pool's torch dtype.
    """

    layout: str
    page_size: int
    page_num: int
    regions: tuple[Any, ...]
    dtype: Any

    @property
    def page_elements(self) -> int:
        """Elements of one flat page (every region's part)."""
        return sum(int(r.shape[1]) * int(r.shape[2]) for r in self.regions)

    def split_flat(self, flat: Any) -> list[Any]:
        """``flat`` (rows of flat pages, ``[n, page_elements]``) as views of each region's part
        of those pages, ``[n, page_size, rest]``."""
        parts, at = [], 0
        for region in self.regions:
            size = int(region.shape[1]) * int(region.shape[2])
            parts.append(flat[:, at : at + size].view(flat.shape[0], self.page_size, -1))
            at += size
        return parts


def _pages(tensor: Any, page_num: int, page_size: int) -> Any:
    """``tensor`` (contiguous, ``page_num`` pages' worth on axis 0 after reshaping) as
    ``[page_num, page_size, rest]``."""
    return tensor.view(page_num, page_size, -1)


def host_pages(pool: Any, *, is_mla: bool) -> HostPages:
    """The pages of SGLang host pool ``pool`` (refused, saying why, where this build does not
    know its layout)."""
    layout = getattr(pool, "layout", None)
    buffer = getattr(pool, "kv_buffer", None)
    page_size = getattr(pool, "page_size", None)
    kind = "MLA" if is_mla else "MHA"
    known = MLA_LAYOUTS if is_mla else MHA_LAYOUTS
    # exactly these classes: a subclass may keep part of a page elsewhere (MXFP8's scales,
    # K-only pools, asymmetric K and V), which a copy of kv_buffer's pages would leave stale
    wanted = "MLATokenToKVPoolHost" if is_mla else "MHATokenToKVPoolHost"
    if type(pool).__name__ != wanted:
        raise InvalidArgumentError(
            f"mem_pool_host: {type(pool).__name__} is not supported; tpusync's backend serves "
            f"SGLang's {wanted} for {kind} models (hybrid, K-only, asymmetric and quantized-"
            "scale pools not yet)"
        )
    if not hasattr(buffer, "is_contiguous") or not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgumentError(
            f"mem_pool_host: {type(pool).__name__} has no kv_buffer tensor and page size"
        )
    if layout not in known:
        raise InvalidArgumentError(
            f"mem_pool_host: the {kind} host pool's layout {layout!r} is not supported; use "
            f"--hicache-mem-layout {' or '.join(known)}"
        )
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise InvalidArgumentError(
            f"mem_pool_host: the host pool's kv_buffer must be contiguous CPU memory, got "
            f"{buffer.device} (contiguous: {buffer.is_contiguous()})"
        )
    shape = tuple(buffer.shape)
    size = getattr(pool, "size", None)
    if not isinstance(size, int) or size < page_size or size % page_size:
        raise InvalidArgumentError(
            f"mem_pool_host: the host pool's size ({size!r} tokens) is not whole pages of "
            f"{page_size}"
        )
    page_num = size // page_size
    per_token = getattr(pool, "get_size_per_token", lambda: -1)()
    if per_token * size != buffer.numel() * buffer.element_size():
        raise InvalidArgumentError(
            f"mem_pool_host: kv_buffer holds {buffer.numel() * buffer.element_size()} bytes, "
            f"not the pool's {size} tokens of {per_token} bytes: part of a page lives "
            "elsewhere, which this backend would not store"
        )
    if layout == "page_unified" and getattr(pool, "head_group_num", 1) != 1:
        raise InvalidArgumentError(
            "mem_pool_host: page_unified pages of more than one head group are not supported "
            "yet; use head_group_num=1 or another --hicache-mem-layout"
        )
    regions: list[Any]
    try:
        regions = _regions(buffer, shape, layout, is_mla, page_num, page_size)
    except RuntimeError as error:  # a buffer of another size than the pool says
        raise InvalidArgumentError(
            f"mem_pool_host: kv_buffer {shape} is not {page_num} pages of {page_size} tokens "
            f"in the {layout} layout ({error})"
        ) from None
    return HostPages(layout, page_size, page_num, tuple(regions), buffer.dtype)


def _regions(
    buffer: Any, shape: tuple[int, ...], layout: str, is_mla: bool, page_num: int, page_size: int
) -> list[Any]:
    if is_mla:
        if layout == "layer_first":  # [L, tokens, 1, W]
            return [_pages(buffer[layer], page_num, page_size) for layer in range(shape[0])]
        # page_first [tokens, L, 1, W]; page_first_direct [pages, L, page, 1, W];
        # page_unified [pages, L, page, W]
        return [_pages(buffer, page_num, page_size)]
    if layout == "page_unified":  # [pages, ...]: a page is one contiguous block
        return [_pages(buffer, page_num, page_size)]
    if layout == "layer_first":  # [2, L, tokens, H, D]: K of each layer, then V
        return [_pages(buffer[kv, layer], page_num, page_size)
                for kv in range(2) for layer in range(shape[1])]  # fmt: skip
    # page_first [2, tokens, L, H, D]; page_first_direct, page_head [2, pages, ...]
    return [_pages(buffer[kv], page_num, page_size) for kv in range(2)]


def page_ids(host_indices: Any, page_size: int, pages: int, page_num: int) -> np.ndarray:
    """The page of each of ``pages`` keys from SGLang's ``host_indices`` (token slots, a page's
    ``page_size`` of them in a row); refuses indices that are not whole pages of the pool."""
    try:
        indices = np.asarray(host_indices.cpu().numpy() if hasattr(host_indices, "cpu")
                             else host_indices, dtype=np.int64).reshape(-1)  # fmt: skip
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"host_indices: not token slots ({error})") from None
    if len(indices) < pages * page_size:
        raise InvalidArgumentError(
            f"host_indices: {len(indices)} token slots for {pages} pages of {page_size} tokens"
        )
    slots = indices[: pages * page_size].reshape(pages, page_size)
    firsts = slots[:, 0]
    if pages and (
        (firsts % page_size).any()
        or firsts.min() < 0
        or firsts.max() >= page_num * page_size
        or (slots - firsts[:, None] != np.arange(page_size)).any()
    ):
        raise InvalidArgumentError(
            f"host_indices: each page must be {page_size} slots in a row, starting at a "
            f"multiple of {page_size} inside the pool's {page_num * page_size} slots"
        )
    return firsts // page_size

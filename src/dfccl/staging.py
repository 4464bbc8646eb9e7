"""Staging memory of one rank's arena: FIFOs of the ring path, copies of the
staged direct path, all-to-all split tables.  Two parts: reserved *blocks*
of one size, one for every tag that can have collectives pending at once
(the minimum FIFO any message loops through), and a shared part handed out
first fit to whoever asks (larger FIFOs while they are free)."""

from __future__ import annotations

import bisect

__all__ = ["StagingPool"]

ALIGN = 256


class StagingPool:
    """Offsets [base, base + size): ``blocks`` blocks of ``block_bytes``
    first, then a first-fit allocator over the rest whose adjacent free
    ranges are merged."""

    def __init__(self, base: int, size: int, *, block_bytes: int = 0, blocks: int = 0):
        self.base = base
        self.size = size
        self.block_bytes = block_bytes
        self.blocks = blocks
        self._blocks_end = base + block_bytes * blocks
        if self._blocks_end > base + size or block_bytes % ALIGN:
            raise ValueError(f"{blocks} blocks of {block_bytes} bytes do not fit {size} bytes of staging")
        # Free blocks, lowest offset last (handed out lowest first).
        self._free_blocks = [base + i * block_bytes for i in reversed(range(blocks))]
        shared = base + size - self._blocks_end
        self._starts: list[int] = [self._blocks_end] if shared else []
        self._lengths: list[int] = [shared] if shared else []
        self.in_use = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def alloc(self, nbytes: int) -> int | None:
        """``nbytes`` from the shared part, or None when no free range holds them."""
        n = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        for i, length in enumerate(self._lengths):
            if length >= n:
                off = self._starts[i]
                if length == n:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                self.in_use += n
                return off
        return None

    def alloc_block(self) -> int | None:
        """One reserved block (``block_bytes``), or None when all are taken."""
        if not self._free_blocks:
            return None
        self.in_use += self.block_bytes
        return self._free_blocks.pop()

    def free(self, offset: int, nbytes: int) -> None:
        """Gives back what alloc() or alloc_block() handed out."""
        if offset < self._blocks_end:
            self.in_use -= self.block_bytes
            self._free_blocks.append(offset)
            return
        n = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.in_use -= n
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._lengths.insert(i, n)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == self._starts[i]:
            self._lengths[i - 1] += self._lengths[i]
            del self._starts[i], self._lengths[i]

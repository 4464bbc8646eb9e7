"""Staging memory of the ring path: FIFO space in one rank's arena, handed out
per collective instance and returned when it completes."""

from __future__ import annotations

import bisect

__all__ = ["StagingPool"]

ALIGN = 256


class StagingPool:
    """First-fit allocator over offsets [base, base + size); adjacent free
    ranges are merged."""

    def __init__(self, base: int, size: int):
        self.base = base
        self.size = size
        self._starts: list[int] = [base]
        self._lengths: list[int] = [size]
        self.in_use = 0

    def alloc(self, nbytes: int) -> int | None:
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

    def free(self, offset: int, nbytes: int) -> None:
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

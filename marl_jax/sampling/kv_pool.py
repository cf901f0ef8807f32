"""The K/V block manager: which page of the pool holds what (host bookkeeping, as vLLM's).

The pool's arrays live on the device (`paged_runner.init_pool`); this module only decides which
pages a request uses. Page 0 is scratch (the writes of padding land there and nothing reads
it); pages 1 .. N - 1 are, at any time, one of:

  free     on the free list;
  in use   referenced by one or more running requests (`refs > 0`); a page of a shared prompt
           block is referenced by every request that reads it;
  cached   unreferenced but holding a registered block: reusable by a later request with the
           same prefix, and evicted least recently used first when free pages run out.

Prefix cache. A block is `page_size` tokens at a page-aligned offset of a request's tokens
(prompt, then generated). Its keys/values depend on every token before it and on the LoRA
adapter, so a block is identified by (the block before it, its own tokens), the first block's
predecessor being its adapter row. The table maps these identities to pages exactly: keys are
compared by value (tuples of token ids), and the block before is named by a serial number unique
to each registration, so two different prefixes never share an entry. A block is registered when
its page is allocated and becomes `ready` once the call that writes it has run; a request whose
next block is registered but not ready waits for it instead of computing it again. New weights
invalidate every block (`clear`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

Key = tuple[int, tuple[int, ...]]  # (serial of the block before, this block's tokens)


def root(adapter: int) -> int:
  """The serial standing for 'the start of a sequence' under LoRA adapter row `adapter`."""
  return -1 - adapter


class KVPool:
  """Pages, reference counts, the prefix table and its LRU order (see the module docstring)."""

  def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages}; expected >= 2 (page 0 is scratch)")
    self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
    self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
    self._refs = [0] * num_pages
    self._ready = [False] * num_pages
    self._table: dict[Key, int] = {}  # block identity -> page
    self._block: dict[int, tuple[Key, int]] = {}  # page -> (its identity, its serial)
    self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached pages
    self._serial = 0
    self.evictions = 0

  @property
  def usable_pages(self) -> int:
    return self.num_pages - 1

  @property
  def available(self) -> int:
    """Pages `allocate` can hand out now: free ones and cached ones it may evict."""
    return len(self._free) + len(self._lru)

  @property
  def in_use(self) -> int:
    return self.usable_pages - self.available

  def lookup(self, tokens: Sequence[int], adapter: int, max_blocks: int
             ) -> tuple[list[int], list[int], bool]:
    """The longest cached, ready prefix of `tokens`' first `max_blocks` full blocks: (its pages,
    their serials, whether the next block is registered but not ready yet: its prefill is in
    flight, so the caller should wait for it rather than compute it twice)."""
    pages, serials = [], []
    if not self.prefix_cache:
      return pages, serials, False
    parent, size = root(adapter), self.page_size
    for j in range(max_blocks):
      page = self._table.get((parent, tuple(tokens[j * size:(j + 1) * size])))
      if page is None:
        return pages, serials, False
      if not self._ready[page]:
        return pages, serials, True
      parent = self._block[page][1]
      pages.append(page)
      serials.append(parent)
    return pages, serials, False

  def acquire(self, pages: Sequence[int]) -> None:
    """One more reference to each of `pages` (cached pages leave the LRU order)."""
    for page in pages:
      self._refs[page] += 1
      self._lru.pop(page, None)

  def allocate(self, n: int) -> list[int] | None:
    """n pages for one request (referenced once, not ready), evicting the least recently used
    cached pages when the free list runs out; None (nothing taken) when fewer than n exist."""
    if n > self.available:
      return None
    out = []
    for _ in range(n):
      if self._free:
        page = self._free.pop()
      else:
        page, _ = self._lru.popitem(last=False)
        self._forget(page)
        self.evictions += 1
      self._refs[page], self._ready[page] = 1, False
      out.append(page)
    return out

  def register(self, page: int, parent: int, tokens: Sequence[int]) -> int:
    """Records that `page` holds the block `tokens` after the block with serial `parent`;
    returns the block's serial (an already registered equal block keeps its page and serial:
    this page then stays private)."""
    if not self.prefix_cache:
      return 0
    key = (parent, tuple(tokens))
    known = self._table.get(key)
    if known is not None:
      return self._block[known][1]
    self._serial += 1
    self._table[key] = page
    self._block[page] = (key, self._serial)
    return self._serial

  def mark_ready(self, pages: Sequence[int]) -> None:
    """The call that writes these pages has run: their blocks can be read by others."""
    for page in pages:
      self._ready[page] = True

  def release(self, pages: Sequence[int]) -> None:
    """Drops one reference to each page. An unreferenced page that holds a ready block is
    cached (most recently used); any other goes back to the free list."""
    for page in pages:
      self._refs[page] -= 1
      if self._refs[page] < 0:
        raise RuntimeError(f"page {page} released more often than referenced")
      if self._refs[page]:
        continue
      if page in self._block and self._ready[page]:
        self._lru[page] = None
      else:
        self._forget(page)
        self._free.append(page)

  def clear(self) -> None:
    """Forgets every block (new weights): cached pages return to the free list, pages in use
    stay with their requests but are no longer shared with new ones."""
    for page in list(self._lru):
      self._forget(page)
      self._free.append(page)
    self._lru.clear()
    self._table.clear()
    self._block.clear()

  def _forget(self, page: int) -> None:
    entry = self._block.pop(page, None)
    if entry is not None and self._table.get(entry[0]) == page:
      del self._table[entry[0]]

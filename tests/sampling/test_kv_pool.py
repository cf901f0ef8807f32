"""The K/V block manager on its own (host bookkeeping, no device): allocation, reference counts,
the prefix table, LRU eviction and back-pressure."""

from __future__ import annotations

import pytest

from marl_jax.sampling.kv_pool import KVPool, root


def test_allocate_and_release_return_pages_to_the_free_list():
  pool = KVPool(num_pages=5, page_size=4)  # page 0 scratch, pages 1..4 usable
  assert pool.usable_pages == 4 and pool.available == 4
  a = pool.allocate(3)
  assert sorted(a) == [1, 2, 3] and 0 not in a and pool.available == 1 and pool.in_use == 3
  assert pool.allocate(2) is None and pool.available == 1  # back-pressure takes nothing
  pool.release(a)
  assert pool.available == 4 and pool.in_use == 0
  with pytest.raises(RuntimeError, match="released more often"):
    pool.release(a[:1])


def test_shared_blocks_are_referenced_once_per_reader_and_cached_when_unreferenced():
  pool = KVPool(num_pages=6, page_size=2)
  tokens = [1, 2, 3, 4, 5]
  pages = pool.allocate(3)
  serial = root(0)
  for j, page in enumerate(pages[:2]):  # two full blocks: [1, 2], [3, 4]
    serial = pool.register(page, serial, tokens[2 * j:2 * j + 2])
  # Registered but not written yet: a reader must wait for the writer.
  hit, _, wait = pool.lookup(tokens, 0, 2)
  assert hit == [] and wait
  pool.mark_ready(pages[:2])
  hit, serials, wait = pool.lookup(tokens + [9], 0, 2)
  assert hit == pages[:2] and not wait and len(set(serials)) == 2
  pool.acquire(hit)  # a second reader
  pool.release(pages)  # the writer finishes: its shared blocks stay referenced by the reader
  assert pool.in_use == 2
  pool.release(hit)  # the reader finishes: the two blocks are cached, the third page is free
  assert pool.in_use == 0 and pool.available == 5
  assert pool.lookup(tokens, 0, 2)[0] == pages[:2]  # still reusable after both finished


def test_lookup_distinguishes_adapters_and_prefixes():
  pool = KVPool(num_pages=8, page_size=2)
  a = pool.allocate(2)
  s = pool.register(a[0], root(0), [1, 2])
  pool.register(a[1], s, [3, 4])
  pool.mark_ready(a)
  assert pool.lookup([1, 2, 3, 4], 0, 2)[0] == a
  assert pool.lookup([1, 2, 3, 4], 1, 2)[0] == []  # another LoRA adapter: other keys/values
  assert pool.lookup([7, 7, 3, 4], 0, 2)[0] == []  # same second block after another first one
  assert pool.lookup([1, 2, 3, 9], 0, 2)[0] == a[:1]  # the longest matching prefix
  assert pool.lookup([1, 2, 3, 4], 0, 1)[0] == a[:1]  # at most max_blocks


def test_eviction_takes_the_least_recently_used_cached_page():
  pool = KVPool(num_pages=4, page_size=1)  # 3 usable pages
  first, second = pool.allocate(1), pool.allocate(1)
  pool.register(first[0], root(0), [10])
  pool.register(second[0], root(0), [20])
  pool.mark_ready(first + second)
  pool.release(first)  # cached first (least recently used)
  pool.release(second)
  pool.acquire(pool.lookup([20], 0, 1)[0])  # reading [20] takes it out of the LRU order
  pool.release(second)  # ... and back in as the most recently used
  taken = pool.allocate(2)  # the free page, then an eviction: [10], the least recently used
  assert first[0] in taken and second[0] not in taken and pool.evictions == 1
  assert pool.lookup([10], 0, 1)[0] == [] and pool.lookup([20], 0, 1)[0] == second


def test_a_page_released_before_its_block_was_written_is_forgotten():
  """A writer preempted mid-prefill: its unwritten blocks must not be waited for forever."""
  pool = KVPool(num_pages=4, page_size=2)
  page = pool.allocate(1)
  pool.register(page[0], root(0), [1, 2])
  assert pool.lookup([1, 2, 3], 0, 1)[2]  # a reader would wait
  pool.release(page)
  assert pool.lookup([1, 2, 3], 0, 1) == ([], [], False) and pool.available == 3


def test_clear_forgets_every_block_for_new_weights():
  pool = KVPool(num_pages=4, page_size=1)
  held, cached = pool.allocate(1), pool.allocate(1)
  pool.register(held[0], root(0), [1])
  pool.register(cached[0], root(0), [2])
  pool.mark_ready(held + cached)
  pool.release(cached)
  pool.clear()
  assert pool.lookup([1], 0, 1)[0] == [] and pool.lookup([2], 0, 1)[0] == []
  assert pool.available == 2  # the cached page is free; the held one stays with its reader
  pool.release(held)
  assert pool.available == 3


def test_a_block_registered_twice_keeps_its_first_page():
  pool = KVPool(num_pages=4, page_size=2)
  a, b = pool.allocate(1), pool.allocate(1)
  sa = pool.register(a[0], root(0), [5, 6])
  assert pool.register(b[0], root(0), [5, 6]) == sa  # same identity, same serial
  pool.mark_ready(a + b)
  assert pool.lookup([5, 6, 0], 0, 1)[0] == a
  pool.release(b)  # the duplicate was never shared: it goes back to the free list
  pool.release(a)  # the registered one is cached
  assert pool.available == 3 and pool.lookup([5, 6, 0], 0, 1)[0] == a
  assert a[0] not in pool.allocate(2)  # free pages go first; the cached block survives
  assert pool.lookup([5, 6, 0], 0, 1)[0] == a


def test_no_prefix_cache_never_shares():
  pool = KVPool(num_pages=4, page_size=1, prefix_cache=False)
  a = pool.allocate(1)
  pool.register(a[0], root(0), [1])
  pool.mark_ready(a)
  assert pool.lookup([1, 2], 0, 1)[0] == []
  pool.release(a)
  assert pool.available == 3

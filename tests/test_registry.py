"""The one registry mechanism: lookup, lazy "module:attribute" entries, one-line errors."""

import types

import pytest

from marl_jax.registry import Registry


def test_lookup_and_names():
  r = Registry("colour")
  r.register("red", 1)
  r.register("blue", 2)
  assert r.get("red") == 1 and r.get("blue") == 2
  assert r.names() == ("blue", "red") and "red" in r and "green" not in r and len(r) == 2


def test_lazy_entry_is_imported_on_first_use():
  r = Registry("function")
  r.register("join", "os.path:join")
  assert r.get("join")("a", "b") in ("a/b", "a\\b")


def test_unknown_name_lists_the_known_ones():
  r = Registry("estimator")
  r.register("grpo", object())
  with pytest.raises(ValueError, match=r"unknown estimator 'gpro'; expected one of \['grpo'\]"):
    r.get("gpro")


def test_second_entry_needs_replace():
  r = Registry("replayer")
  r.register("math", 1)
  r.register("math", 1)  # the same entry again is fine
  with pytest.raises(ValueError, match="already registered"):
    r.register("math", 2)
  r.register("math", 2, replace=True)
  assert r.get("math") == 2
  with pytest.raises(ValueError, match="non-empty string"):
    r.register("", 3)


def test_having_names_the_entries_with_an_attribute_set():
  r = Registry("loss")
  r.register("b", types.SimpleNamespace(ratio=True))
  r.register("a", types.SimpleNamespace(ratio=True))
  r.register("c", types.SimpleNamespace(ratio=False))
  assert r.having("ratio") == ["a", "b"]

"""top-k / top-p over a bounded candidate set, against a full-vocabulary sort in NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.sampling.logits import truncated_candidates


def np_nucleus(scaled, top_k, top_p):
  """Token ids kept by top-k then top-p (renormalised), most likely first, by a full sort."""
  order = np.argsort(-scaled, kind="stable")
  if top_k:
    order = order[:top_k]
  probs = np.exp(scaled[order] - scaled[order].max())
  probs /= probs.sum()
  before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
  return order[before < top_p]


def run(scaled, top_k, top_p, candidates):
  scaled = jnp.asarray(scaled, jnp.float32)
  ids, kept = truncated_candidates(scaled, jax.nn.log_softmax(scaled, axis=-1), jnp.int32(top_k),
                                   jnp.float32(top_p), candidates)
  return np.asarray(ids), np.asarray(kept)


def peaked_logits(rows, vocab, seed):
  """Logits whose nucleus at top_p <= 0.9 has a few to a few dozen tokens."""
  return np.random.default_rng(seed).normal(size=(rows, vocab)) * 6.0


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (20, 0.9), (64, 1.0), (7, 0.3)])
def test_exact_when_the_nucleus_fits(top_k, top_p):
  scaled = peaked_logits(16, 3000, seed=top_k)
  ids, kept = run(scaled, top_k, top_p, candidates=64)
  for row in range(len(scaled)):
    expected = np_nucleus(scaled[row], top_k, top_p)
    assert len(expected) <= 64  # the precondition of exactness holds in this test
    got = ids[row][np.isfinite(kept[row])]
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(kept[row][np.isfinite(kept[row])], scaled[row][expected],
                               rtol=1e-6)
  assert len({len(np_nucleus(s, top_k, top_p)) for s in scaled}) > 1 or top_k == 64


def test_bounded_when_the_nucleus_does_not_fit():
  """All C candidates are kept: the C most likely tokens, sampled in proportion to their
  probabilities, a subset of the exact nucleus with total variation 1 - mass(C) / mass(nucleus)."""
  rng = np.random.default_rng(1)
  scaled = rng.normal(size=(8, 500)) * 0.3  # flat: the 0.95-nucleus has hundreds of tokens
  C, top_p = 16, 0.95
  ids, kept = run(scaled, 0, top_p, candidates=C)
  for row in range(len(scaled)):
    nucleus = np_nucleus(scaled[row], 0, top_p)
    assert len(nucleus) > C
    np.testing.assert_array_equal(ids[row], nucleus[:C])
    assert np.all(np.isfinite(kept[row]))
    p = np.exp(scaled[row] - scaled[row].max())
    p /= p.sum()
    exact = np.zeros(500)
    exact[nucleus] = p[nucleus] / p[nucleus].sum()
    ours = np.zeros(500)
    ours[ids[row]] = np.exp(kept[row] - kept[row].max()) / np.exp(kept[row] - kept[row].max()).sum()
    tv = 0.5 * np.abs(exact - ours).sum()
    np.testing.assert_allclose(tv, 1 - p[nucleus[:C]].sum() / p[nucleus].sum(), rtol=1e-4)


def test_most_likely_token_always_kept():
  scaled = peaked_logits(4, 100, seed=3)
  ids, kept = run(scaled, 0, 1e-6, candidates=8)
  np.testing.assert_array_equal(ids[:, 0], scaled.argmax(-1))
  assert np.all(np.isfinite(kept[:, 0])) and np.all(~np.isfinite(kept[:, 1:]))

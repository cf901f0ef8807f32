"""`tag` on text whose lower-case form has another length (a reply can be anything)."""

from __future__ import annotations

import re

import pytest

from marl_jax.envs.search import env as search_env


@pytest.mark.parametrize("prefix", ["İİİİ", "İ<ANSWER>x</ANSWER>İ", "\u212a" * 5, ""])
def test_tag_slices_the_original_text(prefix):  # 'İ'.lower() has 2 chars; Kelvin 'K' folds to 'k'
  reply = f"{prefix} so <answer>Paris</answer>"
  assert search_env.tag(reply, "answer") == "Paris"
  assert search_env.tag(reply.replace("answer>", "ANSWER>"), "answer") == "Paris"


def test_tag_matches_a_regex_reference_on_mixed_text():
  reply = "İx <Verify>no</VERIFY> İİ <verify> yes </verify> tail"
  want = re.findall(r"<verify>(.*?)</verify>", reply, flags=re.IGNORECASE | re.ASCII)[-1].strip()
  assert search_env.tag(reply, "verify") == want == "yes"
  assert search_env.route("İİİİ<verify>no</verify>") == "search"

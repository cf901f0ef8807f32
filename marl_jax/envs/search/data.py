"""Search data: questions {"question", "answers": [str, ...]} and a corpus [{"id", "title",
"text"}], from local files (Search-R1 layouts) or a seeded invented multi-hop world.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np

from marl_jax.envs.data import read_records


@functools.lru_cache(maxsize=16)
def _load_questions_cached(path: str) -> tuple[dict[str, Any], ...]:
  out = []
  for row in read_records(path):
    answers = row.get("golden_answers", row.get("answers", row.get("answer")))
    answers = [answers] if isinstance(answers, str) else list(answers or [])
    if not answers:
      raise ValueError(f"{path}: question without answers: {row.get('question', '')[:80]!r}")
    out.append({"question": row["question"], "answers": [str(a) for a in answers]})
  return tuple(out)


def search_questions(path: str) -> list[dict[str, Any]]:
  """Questions with gold answers from `golden_answers` (Search-R1), `answers` or `answer`; a file
  is read once however many envs are built from it."""
  return list(_load_questions_cached(str(path)))


def search_corpus(path: str) -> list[dict[str, str]]:
  """Passages from `title` + `text`, or Search-R1's `contents` ("title"\\ntext)."""
  out = []
  for i, row in enumerate(read_records(path)):
    if "contents" in row:
      title, _, text = row["contents"].partition("\n")
      title = title.strip().strip('"')
    else:
      title, text = row.get("title", ""), row["text"]
    out.append({"id": str(row.get("id", i)), "title": title, "text": text})
  return out


# ------------------------------------------------------------------------ generated multi-hop world

_SYLLABLES = ("ka", "lo", "ve", "ri", "zan", "tor", "mel", "qui", "dra", "sen", "bo", "fu", "nix",
              "pel", "gar", "wyn", "tha", "jor", "lis", "mek", "ost", "rua", "vex", "yol")
_PROFESSIONS = ("painter", "engineer", "chemist", "novelist", "architect", "violinist", "chef")


def _names(rng: random.Random, count: int, parts: int, used: set[str]) -> list[str]:
  out = []
  while len(out) < count:
    word = " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
                    for _ in range(parts))
    if word.lower() not in used:
      used.add(word.lower())
      out.append(word)
  return out


@functools.lru_cache(maxsize=8)
def generate_world(seed: int, num_people: int = 24) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
  """(corpus, questions) of a seeded invented world. Questions carry `hops`: the query that finds
  each needed passage and the entity it yields (scripted policies and tests use them)."""
  rng = random.Random(seed)
  used: set[str] = set()
  countries = _names(rng, 5, 1, used)
  cities = _names(rng, 10, 1, used)
  companies = [f"{n} Works" for n in _names(rng, 8, 1, used)]
  people = _names(rng, num_people, 2, used)
  country_of = {c: rng.choice(countries) for c in cities}
  hq_of = {c: rng.choice(cities) for c in companies}
  corpus = []
  for country in countries:
    capital = next((c for c in cities if country_of[c] == country), rng.choice(cities))
    corpus.append({"title": country, "text": f"{country} is a country; its best known city is "
                                             f"{capital}."})
  for city in cities:
    corpus.append({"title": city, "text": f"{city} is a city located in the country of "
                                          f"{country_of[city]}."})
  for company in companies:
    corpus.append({"title": company, "text": f"{company} is a company headquartered in the city "
                                             f"of {hq_of[company]}."})
  questions = []
  for person in people:
    city, company = rng.choice(cities), rng.choice(companies)
    corpus.append({"title": person, "text": f"{person} is a {rng.choice(_PROFESSIONS)} born in "
                                            f"{city} who works for {company}."})
    born = {"query": f"{person} born", "entity": city}
    works = {"query": f"{person} works for company", "entity": company}
    options = [
        (f"In which city was {person} born?", [born]),
        (f"In which country was {person} born?",
         [born, {"query": f"{city} city country", "entity": country_of[city]}]),
        (f"In which city is the company that {person} works for headquartered?",
         [works, {"query": f"{company} headquartered city", "entity": hq_of[company]}]),
        (f"In which country is the headquarters of the company {person} works for?",
         [works, {"query": f"{company} headquartered city", "entity": hq_of[company]},
          {"query": f"{hq_of[company]} city country", "entity": country_of[hq_of[company]]}]),
    ]
    text, hops = options[rng.randrange(len(options))]
    questions.append({"question": text, "answers": [hops[-1]["entity"]], "hops": hops})
  order = np.random.default_rng(seed).permutation(len(corpus))
  corpus = [dict(corpus[i], id=str(n)) for n, i in enumerate(order)]
  return tuple(corpus), tuple(questions)

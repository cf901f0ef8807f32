"""Math problems {"question": str, "answer": str}: file rows (GSM8K, MATH, plain) and seeded
arithmetic word problems.
"""

from __future__ import annotations

import fractions
import functools
import random
from typing import Any

from marl_jax.envs.data import read_records
from marl_jax.envs.math import answers as math_answers

MATH_FORMATS = ("auto", "gsm8k", "math", "plain")


def math_record(row: dict[str, Any], fmt: str = "auto") -> dict[str, str]:
  """One math row -> {"question", "answer"}: GSM8K (`#### x` in `answer`), MATH (`\\boxed` in
  `solution`, or its `answer` field) or plain (`problem`/`question` + `answer`, e.g. AIME)."""
  if fmt not in MATH_FORMATS:
    raise ValueError(f"unknown math format {fmt!r}; expected one of {MATH_FORMATS}")
  question = row.get("question", row.get("problem", row.get("Problem")))
  if not isinstance(question, str):
    raise ValueError(f"math row has no question/problem text: keys {sorted(row)}")
  answer = row.get("answer", row.get("Answer"))
  if fmt == "gsm8k" or (fmt == "auto" and isinstance(answer, str) and "####" in answer):
    answer = math_answers.gsm8k_answer(answer or "")
  elif fmt == "math" or (fmt == "auto" and answer is None and "solution" in row):
    answer = answer if answer is not None else math_answers.last_boxed(row.get("solution", ""))
  if answer is None:
    raise ValueError(f"math row without an extractable answer (format {fmt!r}): {question[:80]!r}")
  return {"question": question, "answer": str(answer).strip()}


@functools.lru_cache(maxsize=16)
def _load_math_cached(path: str, fmt: str) -> tuple[dict[str, str], ...]:
  return tuple(math_record(row, fmt) for row in read_records(path))


def load_math(path: str, fmt: str = "auto") -> list[dict[str, str]]:
  return list(_load_math_cached(str(path), fmt))


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira",
          "Liam", "Maya", "Noah", "Olga", "Pablo")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")


def format_number(value: fractions.Fraction) -> str:
  if value.denominator == 1:
    return str(value.numerator)
  return f"{value.numerator}/{value.denominator}"


LEVELS = ("multi_step", "one_step", "equation")


def arithmetic_problem(seed: int, level: str = "multi_step") -> dict[str, str]:
  """A seeded arithmetic word problem with its exact answer (int or fraction) and a one-line
  worked solution (the supervised warm-start's demonstration, `training/sft.py`).

  `level` "multi_step": two or three operations, fractions included; "one_step": one addition,
  subtraction or multiplication of small whole numbers, which a warm-started 135M team gets
  right about half the time, so a second attempt can change the outcome (learned orchestration
  at CPU scale, RESULTS.md); "equation": an unknown whole number x with a * x + b = c, whose
  row also holds that equation (`check`), so a candidate answer can be verified by
  substituting it, the way public tests check code, without knowing the answer."""
  if level not in LEVELS:
    raise ValueError(f"unknown arithmetic level {level!r}; expected one of {LEVELS}")
  rng = random.Random(seed)
  name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
  if level == "one_step":
    return _one_step_problem(rng, name, item)
  if level == "equation":
    return _equation_problem(rng, name, item)
  kind = rng.randrange(5)
  if kind == 0:
    a, b, c = rng.randint(5, 60), rng.randint(2, 9), rng.randint(2, 12)
    d = rng.randint(1, a + b * c)
    q = (f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack, then gives "
         f"away {d} {item}. How many {item} does {name} have now?")
    ans = fractions.Fraction(a + b * c - d)
    steps = f"{a} + {b} * {c} - {d} = {a + b * c - d}"
  elif kind == 1:
    a, b, c, d = (rng.randint(3, 40), rng.randint(2, 9), rng.randint(3, 40), rng.randint(2, 9))
    q = (f"{name} reads {a} pages a day for {b} days, then {c} pages a day for {d} days. How "
         f"many pages does {name} read in total?")
    ans = fractions.Fraction(a * b + c * d)
    steps = f"{a} * {b} + {c} * {d} = {a * b} + {c * d} = {a * b + c * d}"
  elif kind == 2:
    friends, each, extra = rng.randint(2, 9), rng.randint(2, 15), rng.randint(0, 30)
    q = (f"{name} has {friends * each + extra} {item}, keeps {extra} and shares the rest equally "
         f"among {friends} friends. How many {item} does each friend get?")
    ans = fractions.Fraction(each)
    steps = (f"({friends * each + extra} - {extra}) / {friends} = {friends * each} / {friends} = "
             f"{each}")
  elif kind == 3:
    den = rng.choice((2, 3, 4, 5, 8))
    num = rng.randint(1, den - 1)
    money = den * rng.randint(4, 40)
    lunch = rng.randint(1, money - money * num // den)
    q = (f"{name} has ${money}, spends {num}/{den} of it on {item} and then ${lunch} on lunch. "
         f"How many dollars does {name} have left?")
    ans = fractions.Fraction(money) * (1 - fractions.Fraction(num, den)) - lunch
    spent = fractions.Fraction(money * num, den)
    steps = (f"{money} - {num}/{den} * {money} - {lunch} = {money} - {format_number(spent)} - "
             f"{lunch} = {format_number(ans)}")
  else:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    parts = rng.randint(2, 12)
    q = (f"{name} mixes {a} liters of juice with {b} liters of water and pours the mix equally "
         f"into {parts} bottles. How many liters are in each bottle?")
    ans = fractions.Fraction(a + b, parts)
    steps = f"({a} + {b}) / {parts} = {a + b}/{parts} = {format_number(ans)}"
  return {"question": q, "answer": format_number(ans), "solution": steps}


def _one_step_problem(rng: random.Random, name: str, item: str) -> dict[str, str]:
  kind = rng.randrange(3)
  if kind == 0:
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    ans, steps = a + b, f"{a} + {b} = {a + b}"
  elif kind == 1:
    a = rng.randint(10, 60)
    b = rng.randint(1, a - 1)
    q = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
    ans, steps = a - b, f"{a} - {b} = {a - b}"
  else:
    a, b = rng.randint(2, 9), rng.randint(2, 10)
    q = f"{name} buys {a} packs with {b} {item} in each pack. How many {item} does {name} buy?"
    ans, steps = a * b, f"{a} * {b} = {a * b}"
  return {"question": q, "answer": str(ans), "solution": steps}


def _equation_problem(rng: random.Random, name: str, item: str) -> dict[str, str]:
  x, a, b = rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 30)
  c = a * x + b
  q = (f"{name} buys {a} boxes with the same number of {item} in each box, then gets {b} more "
       f"{item}, and now has {c} {item}. How many {item} are in each box?")
  return {"question": q, "answer": str(x), "solution": f"({c} - {b}) / {a} = {c - b} / {a} = {x}",
          "check": f"{a} * x + {b} == {c}"}

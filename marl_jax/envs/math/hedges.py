r"""One answer or none: the filter in front of math-verify (`grading.MathVerifyGrader`).

math-verify grants some answers two readings, so a reply can hedge between values (measured with
math-verify 0.9.0 on `\boxed{}` answers):
  `200\%`        a percent is compared both as x and as x/100: equal to 200 and to 2 (`2\%`: to 2
                 and to 0.02);
  `1 \quad 2`    two numbers side by side are read as their sum: equal to 3 (so is `1\ 2`, `1 2`);
  `5\mathrm{e}`  an upright e is dropped as a unit: equal to 5;
  `10\,000`      a thin-space thousands separator is read as a product: equal to 0.
The project's checker (`answers.is_equiv`) reads each of them one way, and this filter gives
math-verify that one reading or nothing: a percent sign is dropped (`200\%` is 200, as the
checker's normalisation reads it); an upright `e` or `i` is the constant (`5\mathrm{e}` is 5e);
thin-space thousands groups are joined (`10\,000` is 10000); two numbers separated only by
spacing are two answers, refused (None, graded False). Both sides of a comparison pass through
it: the gold role also holds another agent's answer (`MathProblem.equivalent`).
"""

from __future__ import annotations

import re

_PERCENT = re.compile(r"\\?%")
_UPRIGHT = re.compile(r"\\(?:mathrm|text|textrm|mbox|operatorname)\s*\{\s*([ei])\s*\}")
_THOUSANDS = re.compile(r"(?<![0-9.])[0-9]{1,3}(?:\\,[0-9]{3})+(?![0-9.])")
# LaTeX spacing: \quad, \qquad, \enspace, \thinspace, \hspace{...}, \ , \, \; \: \! and ~.
_SPACING = re.compile(r"\\(?:q?quad|enspace|thinspace|hspace\*?\s*\{[^{}]*\})(?![a-zA-Z])"
                      r"|\\[ ,;:!]|~")
_SIDE_BY_SIDE = re.compile(r"[0-9]\s+[.]?[0-9]")


def one_answer(answer: str) -> str | None:
  """`answer` in the one reading of the module doc, or None when it holds two numbers side by
  side."""
  answer = _THOUSANDS.sub(lambda m: m.group().replace("\\,", ""), answer)
  answer = _UPRIGHT.sub(r"\1", _PERCENT.sub("", answer))
  if _SIDE_BY_SIDE.search(_SPACING.sub(" ", answer)):
    return None
  return answer

"""The grader cross-check (experiments.grader_agreement): its renderings of an answer are the
values they claim, its counts add up, and a small run reports both stated sets."""

from __future__ import annotations

from experiments import grader_agreement as ga


def test_renderings_of_a_fraction_are_what_they_claim():
  got = {kind: (text, same) for kind, text, same in ga.renderings("75/2")}
  assert got["latex_frac"] == ("\\frac{75}{2}", True)
  assert got["mixed_number"] == ("37\\frac{1}{2}", True)
  assert got["decimal"] == ("37.5", True)
  assert got["unreduced"] == ("150/4", True)
  assert got["reciprocal"] == ("2/75", False)
  assert got["wrong_plus_one"] == ("77/2", False)
  assert got["wrong_sign"] == ("-75/2", False)
  assert "rounded" not in got  # 37.5 terminates
  thirds = {kind: (text, same) for kind, text, same in ga.renderings("22/7")}
  assert thirds["rounded"] == ("3.143", False) and "decimal" not in thirds


def test_renderings_of_a_whole_number():
  got = {kind: (text, same) for kind, text, same in ga.renderings("1234")}
  assert got["thousands"] == ("1,234", True)
  assert got["trailing_zero"] == ("1234.0", True)
  assert got["doubled_fraction"] == ("\\frac{2468}{2}", True)
  assert got["scientific"] == ("123.4 \\times 10^{1}", True)
  assert got["approx"] == ("\\approx 1234", True)
  assert "latex_frac" not in got
  assert "thousands" not in {kind for kind, _, _ in ga.renderings("12")}


def test_renderings_include_the_hedges_math_verify_read_two_ways():
  got = {kind: (text, same) for kind, text, same in ga.renderings("54")}
  assert got["percent"] == ("54\\%", True)
  assert got["percent_hundredfold"] == ("5400\\%", False)  # math-verify: 54 and 5400
  assert got["side_by_side"] == ("53 \\quad 1", False)  # math-verify: 53 + 1
  assert got["upright_e"] == ("54\\mathrm{e}", False)  # math-verify: 54, the e dropped
  zero = {kind for kind, _, _ in ga.renderings("0")}
  assert "percent" in zero and not zero & {"percent_hundredfold", "side_by_side", "upright_e"}


def test_compare_counts_and_examples():
  pairs = [("exact", "5", "5", True), ("approx", "\\approx 5", "5", True),
           ("unit", "5 \\text{ cm}", "5", True), ("wrong", "6", "5", False)]
  # A stand-in for math-verify that accepts only identical strings: builtin alone accepts the
  # trailing unit, neither accepts \approx or the wrong value.
  report = ga.compare(iter(pairs), lambda pred, gold: pred == gold, examples=1)
  assert {k: report[k] for k in ("pairs", "both_true", "both_false", "builtin_only",
                                 "math_verify_only", "math_verify_refused")} == {
      "pairs": 4, "both_true": 1, "both_false": 2, "builtin_only": 1, "math_verify_only": 0,
      "math_verify_refused": 0}
  assert report["by_kind"]["approx"] == {"pairs": 1, "builtin_wrong": 1,
                                         "math_verify_wrong": 1, "disagree": 0}
  assert report["examples"]["builtin_only"] == [
      {"kind": "unit", "answer": "5 \\text{ cm}", "gold": "5", "intended": True}]
  hedged = ga.compare(iter([("side_by_side", "4 \\quad 1", "5", False), ("exact", "5", "5", True)]),
                      lambda pred, gold: pred == gold, examples=3)
  assert hedged["math_verify_refused"] == 1
  assert hedged["examples"]["math_verify_refused"] == [
      {"kind": "side_by_side", "answer": "4 \\quad 1", "gold": "5", "intended": False}]


def test_small_run_reports_both_sets():
  report = ga.main(["--problems=1", "--fuzz=2"])
  assert set(report) == {"generated", "fuzz"}
  for result in report.values():
    assert result["pairs"] == sum(result[k] for k in ("both_true", "both_false", "builtin_only",
                                                      "math_verify_only"))
  assert report["fuzz"]["pairs"] == 4  # two replies, each against both golds
  assert report["generated"]["by_kind"]["exact"] == {"pairs": 3, "builtin_wrong": 0,
                                                     "math_verify_wrong": 0, "disagree": 0}
  kinds = report["generated"]["by_kind"]
  for hedge in ("percent", "percent_hundredfold", "side_by_side", "upright_e"):
    assert kinds[hedge]["pairs"] > 0 and kinds[hedge]["math_verify_wrong"] == 0, hedge
  assert report["generated"]["math_verify_refused"] == kinds["side_by_side"]["pairs"]

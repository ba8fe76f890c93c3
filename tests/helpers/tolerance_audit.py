"""How close every passing numerical check comes to its tolerance: a development tool for the suite's portability.

A tolerance must hold on any CPU (kernel choice, MKL's summation order and the thread count move the last bits), so
a check whose figure sits near its bound on one machine may fail on the next. With ``POET_TOLERANCE_AUDIT=<file>``
set, the suite records, for every passing check, ``figure / bound`` (1 would be the edge of failure):

- ``assert a <= b`` / ``a < b`` (and ``>``, ``>=``, reversed) in the test files, read from pytest's passing-assert
  hook, which needs assertion rewriting with the hook on (``-o enable_assertion_pass_hook=true``, and no stale
  ``__pycache__`` of the tests: ``PYTHONDONTWRITEBYTECODE=1`` and ``find tests -name __pycache__ -exec rm -r {} +``);
- ``torch.testing.assert_close`` and ``torch.allclose``: the largest ``|actual − expected| / (atol + rtol·|expected|)``.

A comparison counts as a tolerance check when it is written with a numeric literal; comparisons of two measured figures
(``loss_after < loss_before``) are recorded too, marked ``"literal": false``. ``python tests/helpers/tolerance_audit.py
<file> ...`` prints the checks with the largest ratio over all the files given."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

AUDIT_ENV = "POET_TOLERANCE_AUDIT"
_LITERAL = re.compile(r"(?<![\w.])(\d+\.?\d*[eE][-+]?\d+|\d*\.\d+)(?![\w.])")
_OPERATORS = ("<=", ">=", "<", ">")


def audit_file() -> str | None:
    return os.environ.get(AUDIT_ENV) or None


def record(entry: dict[str, Any]) -> None:
    with open(audit_file(), "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def _top_level_split(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside brackets."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        char = text[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + len(separator)
            i = start
            continue
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _strip_parens(text: str) -> str:
    text = text.strip()
    while text.startswith("(") and text.endswith(")") and len(_top_level_split(text[1:-1], ")(")) == 1:
        inner = text[1:-1]
        depth = 0
        balanced = True
        for char in inner:
            depth += char in "([{"
            depth -= char in ")]}"
            if depth < 0:
                balanced = False
                break
        if not balanced:
            break
        text = inner.strip()
    return text


def _comparison(text: str) -> tuple[str, str, str] | None:
    for operator in _OPERATORS:
        sides = _top_level_split(text, f" {operator} ")
        if len(sides) == 2:
            return sides[0], operator, sides[1]
    return None


def _number(text: str) -> float | None:
    def tensor(value: Any, *args: Any, **kwargs: Any) -> Any:
        return value

    try:
        value = eval(text, {"__builtins__": {}}, {"tensor": tensor, "inf": math.inf, "nan": math.nan})
    except Exception:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def ratio_of(left: float, operator: str, right: float) -> float | None:
    """How near a passing comparison is to failing: the smaller side over the larger (``figure / bound`` for an
    upper bound, ``bound / figure`` for a lower one)."""
    small, large = (left, right) if operator in ("<", "<=") else (right, left)
    if large == 0 or math.isnan(small) or math.isnan(large):
        return None
    return abs(small) / abs(large)


def pytest_assertion_pass(item, lineno: int, orig: str, expl: str) -> None:
    if not audit_file():
        return
    source_parts = _top_level_split(_strip_parens(orig), " and ")
    shown_parts = _top_level_split(_strip_parens(expl.splitlines()[0]), " and ")
    if len(source_parts) != len(shown_parts):
        source_parts = [orig] * len(shown_parts)
    for source, shown in zip(source_parts, shown_parts, strict=True):
        shown_cmp = _comparison(_strip_parens(shown))
        if shown_cmp is None:
            continue
        left, operator, right = _number(shown_cmp[0]), shown_cmp[1], _number(shown_cmp[2])
        if left is None or right is None:
            continue
        ratio = ratio_of(left, operator, right)
        if ratio is None:
            continue
        record(
            {
                "test": item.nodeid,
                "line": lineno,
                "check": source.strip(),
                "ratio": ratio,
                "literal": bool(_LITERAL.search(source)),
                "left": left,
                "op": operator,
                "right": right,
            }
        )


def _closeness_ratio(actual: Any, expected: Any, rtol: float | None, atol: float | None) -> float | None:
    import torch
    from torch.testing._comparison import default_tolerances

    if not (torch.is_tensor(actual) and torch.is_tensor(expected)) or not actual.dtype.is_floating_point:
        return None
    if rtol is None or atol is None:
        default_rtol, default_atol = default_tolerances(actual, expected)
        rtol = default_rtol if rtol is None else rtol
        atol = default_atol if atol is None else atol
    a, e = actual.detach().double(), expected.detach().to(actual.device).double()
    difference = (a - e).abs()
    allowed = atol + rtol * e.abs()
    if difference.numel() == 0:
        return None
    ratios = torch.where(
        allowed > 0, difference / allowed.clamp_min(1e-300), torch.where(difference > 0, math.inf, 0.0)
    )
    return float(ratios.max())


def install(current_test: Any) -> None:
    """Wrap ``torch.testing.assert_close`` and ``torch.allclose`` to record their ratios (``current_test()`` names
    the running test)."""
    import torch

    original_assert_close = torch.testing.assert_close
    original_allclose = torch.allclose

    def assert_close(actual, expected, *args: Any, rtol=None, atol=None, **kwargs: Any):
        original_assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)
        ratio = _closeness_ratio(actual, expected, rtol, atol)
        if ratio is not None:
            record(
                {
                    "test": current_test(),
                    "line": _caller_line(),
                    "check": "assert_close",
                    "ratio": ratio,
                    "literal": rtol is not None or atol is not None,
                }
            )

    def allclose(input, other, rtol=1e-5, atol=1e-8, equal_nan=False):
        result = original_allclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan)
        ratio = _closeness_ratio(input, other, rtol, atol)
        if ratio is not None:
            record(
                {
                    "test": current_test(),
                    "line": _caller_line(),
                    "check": "allclose",
                    "ratio": ratio,
                    "literal": True,
                    "passed": bool(result),
                }
            )
        return result

    torch.testing.assert_close = assert_close
    torch.allclose = allclose


def _caller_line() -> int:
    frame = sys._getframe(2)
    return frame.f_lineno


def summarize(paths: list[str], top: int = 25) -> None:
    """The tolerance checks with the largest ``figure / bound`` over every audit file (one per setting)."""
    worst: dict[tuple, tuple[float, str]] = {}
    for path in paths:
        for line in open(path):
            entry = json.loads(line)
            if not entry["literal"] or entry.get("passed") is False:
                continue
            key = (entry["test"], entry["line"], entry["check"])
            if key not in worst or entry["ratio"] > worst[key][0]:
                worst[key] = (entry["ratio"], path)
    ranked = sorted(worst.items(), key=lambda kv: -kv[1][0])
    print(f"{len(worst)} tolerance checks; the largest figure / bound over {len(paths)} settings:")
    for (test, line, check), (ratio, path) in ranked[:top]:
        print(f"{ratio:10.3g}  {test}:{line}  {check[:90]}  [{os.path.basename(path)}]")


if __name__ == "__main__":
    summarize(sys.argv[1:])

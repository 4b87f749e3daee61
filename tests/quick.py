"""The quick subset (`./scripts/test --quick`, i.e. `pytest -m "not slow"`): each module's core tests in a few
minutes. A test is marked `slow` where it runs a whole model, real tuning processes or many interpret-mode kernels;
a parametrized family keeps a representative few of its cases in the quick subset (`slow_except`), the whole
suite runs them all. test_packaging, test_resume_selection and test_shape_serving have no quick test: each of theirs
builds and installs a wheel, kills and resumes a tuning job, or serves a whole model."""
from __future__ import annotations

from typing import Any, Iterable

import pytest

ParameterSet = type(pytest.param())  # what pytest.param makes (its class is not public)


def _case_id(values: tuple) -> str | None:
    """pytest's own id for a case of plain values ("llama-forward"), else None (pytest numbers it)."""
    if all(isinstance(v, (str, int, float, bool)) for v in values):
        return "-".join(str(v) for v in values)
    return None


def slow_except(cases: Iterable[Any], *quick: str) -> list:
    """`cases` for `pytest.mark.parametrize`, every one marked `slow` but those whose id is in `quick`. A case is a
    `pytest.param`, a tuple of one case's values, or a single value. Ids are kept as pytest would make them; an id
    in `quick` that no case has is an error (a renamed case must not leave the quick subset silently)."""
    out, seen = [], set()
    for case in cases:
        if isinstance(case, ParameterSet):
            values, marks, case_id = tuple(case.values), list(case.marks), case.id
        else:
            values, marks, case_id = (case if isinstance(case, tuple) else (case,)), [], None
        case_id = case_id if case_id is not None else _case_id(values)
        if case_id in quick:
            seen.add(case_id)
        else:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(*values, marks=marks, id=case_id))
    missing = set(quick) - seen
    if missing:
        raise ValueError(f"slow_except: no case has the id {sorted(missing)}")
    return out

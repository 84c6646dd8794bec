"""The fuzz layer: schemathesis over the whole front's OpenAPI description, on fakes as the
unit layer is, but about a minute of generated requests; apart so that `pytest tests/unit`
stays under one. The unit layer's guard holds here too (tests/unit/conftest.py)."""

from tests.unit.conftest import (
    pytest_make_collect_report,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)

__all__ = ["pytest_make_collect_report", "pytest_runtest_call", "pytest_runtest_setup",
           "pytest_runtest_teardown"]

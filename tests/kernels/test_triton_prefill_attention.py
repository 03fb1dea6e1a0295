"""Triton paged_prefill_attention against the torch reference (see harness.py for how cases run)."""

import pytest

from tests.kernels.harness import check_case, module_results
from tests.kernels.kernel_cases import PREFILL_CASES

NAMES = list(PREFILL_CASES)


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return module_results(request, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_paged_prefill_attention(name: str, results: dict[str, str | None]) -> None:
    check_case(name, results)

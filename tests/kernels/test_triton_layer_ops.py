"""TritonLayerOps against TorchLayerOps (see harness.py for how cases run)."""

import pytest

from tests.kernels.harness import check_case, module_results
from tests.kernels.kernel_cases import LAYER_OPS_CASES

NAMES = list(LAYER_OPS_CASES)


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return module_results(request, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_triton_layer_ops(name: str, results: dict[str, str | None]) -> None:
    check_case(name, results)

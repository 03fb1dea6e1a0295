"""TritonLayerOps against TorchLayerOps, and tiny models run with it against HF (see harness.py
for how cases run)."""

import pytest

from tests.kernels.harness import check_case, json_cases, module_results
from tests.kernels.kernel_cases import LAYER_OPS_CASES
from tests.kernels.layer_ops_model_cases import MODELS

NAMES = list(LAYER_OPS_CASES)


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict[str, str | None]:
    return module_results(request, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_triton_layer_ops(name: str, results: dict[str, str | None]) -> None:
    check_case(name, results)


def test_tiny_models_with_triton_layer_ops_match_hf() -> None:
    results = json_cases("tests.kernels.layer_ops_model_cases")
    assert set(results) == set(MODELS)
    for name in MODELS:
        assert results[name]["error"] is None, results[name]["error"]

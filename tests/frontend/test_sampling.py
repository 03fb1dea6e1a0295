import pytest
from pydantic import ValidationError

from services.common.packing import unpack_float32, unpack_int32
from services.frontend.errors import ApiError, context_length_exceeded
from services.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.frontend.openai.sampling import check_limits, sampling_params
from services.frontend.settings import FrontendSettings

MESSAGES = [{"role": "user", "content": "hi"}]


def test_openai_defaults_map_to_engine_defaults() -> None:
    body = ChatCompletionRequest(model="m", messages=MESSAGES)
    params = sampling_params(body, max_tokens=10, logprobs=None, prompt_logprobs=None,
                             seed=None)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == \
        (1.0, 1.0, 0, 1.0)
    assert params.logprobs is None and params.seed is None and params.max_tokens == 10


def test_vllm_extras_and_logit_bias_are_packed() -> None:
    body = CompletionRequest(model="m", prompt="x", top_k=-1, min_tokens=50,
                             stop_token_ids=[5, 6], logit_bias={"7": -100, "9": 2.5})
    params = sampling_params(body, max_tokens=10, logprobs=2, prompt_logprobs=None, seed=3)
    assert params.top_k == 0 and params.min_tokens == 10  # capped by max_tokens
    assert unpack_int32(params.stop_token_ids).tolist() == [5, 6]
    assert unpack_int32(params.logit_bias_token_ids).tolist() == [7, 9]
    assert unpack_float32(params.logit_bias_values).tolist() == [-100.0, 2.5]
    bad = CompletionRequest(model="m", prompt="x", logit_bias={"word": 1})
    with pytest.raises(ApiError):
        sampling_params(bad, max_tokens=1, logprobs=None, prompt_logprobs=None, seed=None)


@pytest.mark.parametrize("field", [{"temperature": -0.1}, {"top_p": 0}, {"n": 0},
                                   {"presence_penalty": 3}, {"stop": [""]}, {"max_tokens": 0}])
def test_out_of_range_fields_are_refused(field: dict) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", **field)


def test_gateway_limits() -> None:
    settings = FrontendSettings(max_n=4, max_logprobs=5, max_stop_strings=2)
    for body, logprobs in [(CompletionRequest(model="m", prompt="x", n=5), None),
                           (CompletionRequest(model="m", prompt="x"), 6),
                           (CompletionRequest(model="m", prompt="x", stop=["a", "b", "c"]), None),
                           (CompletionRequest(model="m", prompt="x",
                                              stream_options={"include_usage": True}), None)]:
        with pytest.raises(ApiError) as info:
            check_limits(body, settings, logprobs)
        assert info.value.status == 400


def test_context_length_error_keeps_vllms_wording() -> None:
    error = context_length_exceeded(2048, 2000, 100, "max_tokens").body()["error"]
    assert error["message"].startswith("This model's maximum context length is 2048 tokens. "
                                       "However, you requested 2100 tokens")
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"

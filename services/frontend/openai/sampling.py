"""OpenAI request fields -> wire sampling and detokenization parameters, with the checks
that need the gateway's limits (pydantic checks the simple ranges)."""

from __future__ import annotations

from services.common import wire
from services.common.packing import pack_float32, pack_int32
from services.frontend.errors import invalid
from services.frontend.openai.protocol import SamplingFields
from services.frontend.settings import FrontendSettings


def check_limits(request: SamplingFields, settings: FrontendSettings,
                 num_logprobs: int | None) -> None:
    if request.n > settings.max_n:
        raise invalid(f"n must be at most {settings.max_n}", param="n")
    if num_logprobs is not None and num_logprobs > settings.max_logprobs:
        raise invalid(f"at most {settings.max_logprobs} logprobs may be requested",
                      param="logprobs")
    if request.prompt_logprobs is not None and request.prompt_logprobs > settings.max_logprobs:
        raise invalid(f"at most {settings.max_logprobs} prompt logprobs may be requested",
                      param="prompt_logprobs")
    if len(request.stop_list()) > settings.max_stop_strings:
        raise invalid(f"at most {settings.max_stop_strings} stop strings may be set",
                      param="stop")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true",
                      param="stream_options")


def logit_bias_arrays(request: SamplingFields, vocab_limit: int = 2**31 - 1
                      ) -> tuple[bytes, bytes]:
    if not request.logit_bias:
        return b"", b""
    ids, values = [], []
    for key, value in request.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}",
                          param="logit_bias") from None
        if not 0 <= token_id < vocab_limit:
            raise invalid(f"logit_bias token id {token_id} is out of range", param="logit_bias")
        ids.append(token_id)
        values.append(value)
    return pack_int32(ids), pack_float32(values)


def sampling_params(request: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None, seed: int | None) -> wire.SamplingParams:
    bias_ids, bias_values = logit_bias_arrays(request)
    top_k = request.top_k or 0
    return wire.SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if top_k < 0 else top_k,
        min_p=request.min_p or 0.0,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min(request.min_tokens, max_tokens),
        stop_token_ids=pack_int32(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        repetition_penalty=request.repetition_penalty or 1.0,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias_token_ids=bias_ids,
        logit_bias_values=bias_values,
    )


def detokenize_params(request: SamplingFields, gateway_id: str, engine_id: str,
                      wants_token_strings: bool) -> wire.DetokenizeParams:
    return wire.DetokenizeParams(
        stop=request.stop_list(), include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, gateway_id=gateway_id,
        engine_id=engine_id, return_token_strings=wants_token_strings,
        min_tokens=request.min_tokens)

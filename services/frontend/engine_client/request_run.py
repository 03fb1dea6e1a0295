"""One HTTP request's run through the mesh (RequestRun), from what its handler asks
(RequestPlan): pick an engine, encode each prompt, check the context length, submit every
choice (a Generation each), then hand out their text deltas until all have finished.
Whatever way the HTTP request ends, `close()` aborts the choices still running."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog

from services.common import wire
from services.common.mm_inputs import mm_spans
from services.common.packing import unpack_int32
from services.frontend.engine_client.disaggregation import (
    as_prefill,
    prefill_remotely,
    prefill_request_id,
)
from services.frontend.engine_client.generation import Generation, TextDelta
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import EngineView, MeshView, least_loaded
from services.frontend.engine_client.request_stats import RequestTimer
from services.frontend.errors import (
    ApiError,
    context_length_exceeded,
    deadline_exceeded,
    invalid,
    unavailable,
)
from services.frontend.openai.grammar_request import GrammarRequest
from services.frontend.openai.lora_registry import LoraRegistry
from services.frontend.router.engine_router import EngineRouter, Route
from services.frontend.tenancy.auth import Tenant

log = structlog.get_logger(__name__)

DEADLINE_GRACE_S = 2.0
ENGINE_WAIT_POLL_S = 0.1   # how often a request waiting for a ready engine looks again


@dataclass
class PromptInput:
    """What to encode for one prompt: the EncodeRequest fields of its `input` oneof."""
    prompt: str | None = None
    chat: wire.ChatMessages | None = None
    token_ids: bytes | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = True
    chat_template: str = ""
    chat_template_kwargs_json: str = ""
    tools_json: str = ""


@dataclass
class EncodedPrompt:
    token_ids: bytes
    num_tokens: int
    tokenizer_id: str
    request_ids: list[str]
    detokenize: wire.DetokenizeParams | None = None
    grammar: wire.GrammarSpec | None = None     # as the engine enforces it (the tokenizer's)
    mm_items: list[wire.MultiModalItem] = field(default_factory=list)   # its images


@dataclass
class RequestPlan:
    """What an endpoint's handler asks of the run: the prompts, and how to sample each."""
    model: str
    prompts: list[PromptInput]
    n: int
    max_tokens: int | None                       # None: up to the context length
    make_sampling: Callable[[int, int | None], wire.SamplingParams]  # (max_tokens, seed)
    make_detokenize: Callable[[str], wire.DetokenizeParams]         # (engine id)
    seed: int | None
    priority: int = 0
    cache_salt: str = ""
    max_tokens_param: str = "max_tokens"
    grammar: GrammarRequest | None = None          # structured outputs
    deadline_s: float = 0.0                        # from arrival; 0: none
    session_id: str = ""                           # prompt_cache_key or x-session-id


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass
class RequestRun:
    """One HTTP request's choices in the mesh (vLLM's AsyncLLM.generate for n choices)."""
    client: MeshClient
    view: MeshView
    request_id: str
    request_timeout_s: float
    timer: RequestTimer
    router: EngineRouter | None = None
    engine_wait_s: float = 0.0                    # how long to wait for a ready engine
    loras: LoraRegistry | None = None             # adapters served by model name
    lora: wire.LoraRequest | None = None          # the request's adapter (None: the base)
    engine: EngineView | None = None
    route: Route | None = None                    # the router's decision, until prefill ends
    prefill_engine: EngineView | None = None      # P/D: a producer prefills each prompt first
    prompts: list[EncodedPrompt] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    started_at: float = field(default_factory=time.monotonic)
    deadline_at: float | None = None              # monotonic; set from the plan's deadline
    _queue: asyncio.Queue[TextDelta] = field(default_factory=asyncio.Queue)
    _num_tokens: dict[int, int] = field(default_factory=dict)   # choice index -> tokens
    _num_finished: int = 0                        # choices whose finish was handed out
    _last_delta_at: float = field(default_factory=time.monotonic)
    _n: int = 1

    async def start(self, plan: RequestPlan, tenant: Tenant | None = None) -> None:
        """Encodes, routes, checks and submits every choice. A tenant (the API key's) salts
        the prefix cache and pays for prompt + max_tokens from its token bucket (429 if
        empty)."""
        self._n = plan.n
        if plan.deadline_s > 0:
            self.deadline_at = self.started_at + plan.deadline_s
        if tenant is not None:
            plan.cache_salt = tenant.cache_salt(plan.cache_salt)
            self.timer.key_id = tenant.key_id
        plan.model = await self._resolve_adapter(plan.model)
        await self._wait_for_an_engine(plan.model)   # 404 / 503 before any tokenizer work
        self.prefill_engine = self.view.pick_prefill_engine(plan.model)
        started = time.perf_counter()
        encoded = await asyncio.gather(*(self._encode(plan, p, i)
                                         for i, p in enumerate(plan.prompts)),
                                       return_exceptions=True)
        self.timer.tokenized(time.perf_counter() - started)
        self.prompts = [e for e in encoded if isinstance(e, EncodedPrompt)]
        errors = [e for e in encoded if isinstance(e, BaseException)]
        if errors:
            await self._release_all()
            raise errors[0]
        try:
            self.engine = self._route(plan)
        except ApiError:
            await self._release_all()
            raise
        # NOTE: counted as in flight on the engine from the pick, not only once submitted:
        # requests arriving together would all pick the same idle engine.
        reserved = plan.n * len(plan.prompts)
        self.view.track(self.engine.engine_id, +reserved)
        try:
            await self._submit_all(plan, tenant)
        finally:
            self.view.track(self.engine.engine_id, -reserved)

    def adopt(self, generation: Generation) -> None:
        """Takes over a generation another gateway started (its request and streamed tokens
        rebuilt from what that gateway stored); a move then places it (migration.py)."""
        assert generation.request is not None
        generation.queue = self._queue
        self.generations = [generation]
        prompt = generation.request.prompt_token_ids
        self.prompts = [EncodedPrompt(prompt, len(prompt) // 4, generation.tokenizer_id,
                                      [generation.request_id])]
        self._num_tokens[0] = len(generation.output_token_ids)

    def _route(self, plan: RequestPlan) -> EngineView:
        """The engine for every choice (they share their prompts' blocks): by the router
        from the first prompt's tokens, the least loaded without one."""
        engines = self._candidates(plan.model)
        if self.router is None:
            engine = least_loaded(engines)
        else:
            self.route = self.router.route(engines, unpack_int32(self.prompts[0].token_ids),
                                           plan.cache_salt, plan.session_id,
                                           self.lora.lora_id if self.lora else 0,
                                           mm_spans(self.prompts[0].mm_items))
            engine = self.route.engine
            self.timer.routed(self.route.reason, self.route.num_predicted_cached_tokens,
                              plan.session_id)
        for prompt in self.prompts:
            if prompt.detokenize is not None:
                prompt.detokenize.engine_id = engine.engine_id
        return engine

    async def _submit_all(self, plan: RequestPlan, tenant: Tenant | None) -> None:
        try:
            requests = self._generate_requests(plan)
            if tenant is not None:
                await tenant.charge(sum(r.sampling.max_tokens + len(r.prompt_token_ids) // 4
                                  for r in requests))
        except ApiError:
            await self._release_all()
            raise
        if self.prefill_engine is not None:
            first = {r.request_id: r for r in requests}
            await prefill_remotely(self.client, self.prefill_engine, plan.model, [
                as_prefill(first[p.request_ids[0]], prefill_request_id(self.request_id, i))
                for i, p in enumerate(self.prompts)], self.request_timeout_s)
        detokenize = {rid: p.detokenize for p in self.prompts for rid in p.request_ids}
        results = await asyncio.gather(
            *(self._submit(plan.model, request, index, detokenize[request.request_id])
              for index, request in enumerate(requests)), return_exceptions=True)
        self.generations = [r for r in results if isinstance(r, Generation)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.close()
            await self._release_all()
            raise failures[0]

    async def _submit(self, model: str, request: wire.GenerateRequest, index: int,
                      detokenize: wire.DetokenizeParams | None) -> Generation:
        """Submits to the chosen engine; an engine that is gone, not ready or full hands the
        request to the next least-loaded one (it has not started anywhere yet)."""
        assert self.engine is not None
        engine, tried = self.engine, set()
        while True:
            try:
                return await self.client.submit(engine, request, index, self._queue,
                                                model=model, detokenize=detokenize)
            except ApiError as exc:
                if exc.status != 503:
                    raise
                tried.add(engine.engine_id)
                others = [e for e in self._with_lora(self.view.ready_engines(model))
                          if e.engine_id not in tried]
                if not others:
                    raise
                log.info("engine refused a request; submitting to another",
                         request_id=request.request_id, engine=engine.engine_id,
                         code=exc.code, error=exc.message)
                engine = least_loaded(others)

    def _with_lora(self, engines: list[EngineView]) -> list[EngineView]:
        """For an adapter's request: the engines serving LoRA, those holding the adapter
        first while one of them can start it at once; 400 when none serves LoRA."""
        if self.lora is None or not engines:
            return engines
        capable = [e for e in engines if e.max_loras]
        if not capable:
            raise invalid(f"the engines of model {engines[0].model} serve no LoRA adapters "
                          f"(start them with --enable-lora)", param="model")
        holding = [e for e in capable if self.lora.lora_id in e.lora_ids]
        return holding if any(e.can_start_another for e in holding) else capable

    async def _wait_for_an_engine(self, model: str | None) -> None:
        """Returns once an engine can take the request; 404 at once for a model no engine
        serves, 503 after `engine_wait_s` while none is ready (a restart or a late heartbeat
        then costs the client a wait, not an error)."""
        deadline = time.monotonic() + self.engine_wait_s
        while True:
            try:
                self._candidates(model)
                return
            except ApiError as exc:
                if exc.code != "engine_unavailable" or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(ENGINE_WAIT_POLL_S)

    async def _resolve_adapter(self, model: str) -> str:
        """The base model of a request naming a LoRA adapter (then self.lora), else
        `model`. An adapter without a base_model_name runs on the one model served."""
        if self.loras is None or model not in self.loras:
            return model
        if not self.view.models():
            await self._wait_for_an_engine(None)
        base, self.lora = self.loras.resolve(model, list(self.view.models()))
        return base

    def _candidates(self, model: str | None) -> list[EngineView]:
        engines = self._with_lora(self.view.candidate_engines(model))
        if engines:
            return engines
        if self.view.models():
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        raise unavailable("no engine is ready yet; retry shortly", code="engine_unavailable")

    async def _encode(self, plan: RequestPlan, prompt: PromptInput,
                      prompt_index: int) -> EncodedPrompt:
        child_ids = [f"{self.request_id}-{prompt_index}-{i}" for i in range(plan.n)]
        # The engine is chosen once the prompt's tokens are known (_route) and named then.
        detokenize = plan.make_detokenize("")
        request = wire.EncodeRequest(
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            add_special_tokens=prompt.add_special_tokens, chat_template=prompt.chat_template,
            chat_template_kwargs_json=prompt.chat_template_kwargs_json,
            tools_json=prompt.tools_json, detokenize=detokenize,
            request_ids=child_ids + self._prefill_ids(prompt_index))
        if prompt.chat is not None:
            request.chat = prompt.chat
        elif prompt.token_ids is not None:
            request.prompt_token_ids = prompt.token_ids
        else:
            request.prompt = prompt.prompt or ""
        if plan.grammar is not None:     # compiled by the tokenizer: a 400 before any engine
            request.grammar = plan.grammar.spec
        reply = await self.client.encode(request)
        if reply.grammar_error:
            assert plan.grammar is not None
            raise invalid(reply.grammar_error, param=plan.grammar.param)
        grammar = None
        if plan.grammar is not None:   # the tokenizer's copy has the reasoning markers' ids
            grammar = (reply.grammar if reply.grammar.kind != wire.GrammarKind.NONE
                       else plan.grammar.spec)
        return EncodedPrompt(reply.token_ids, len(reply.token_ids) // 4, reply.tokenizer_id,
                             child_ids, detokenize, grammar, list(reply.mm_items))

    def _prefill_ids(self, prompt_index: int) -> list[str]:
        """P/D: the prompt's prefill request, registered with the tokenizer beside its choices
        so its finish comes back here."""
        if self.prefill_engine is None:
            return []
        return [prefill_request_id(self.request_id, prompt_index)]

    def _generate_requests(self, plan: RequestPlan) -> list[wire.GenerateRequest]:
        assert self.engine is not None
        max_len = self.engine.max_model_len
        requests = []
        for prompt in self.prompts:
            if prompt.num_tokens == 0:
                raise ApiError(400, "the prompt is empty", param="prompt")
            max_tokens = plan.max_tokens
            if max_tokens is None:
                max_tokens = max_len - prompt.num_tokens
            if max_tokens < 1 or prompt.num_tokens + max_tokens > max_len:
                raise context_length_exceeded(max_len, prompt.num_tokens, max(max_tokens, 1),
                                              plan.max_tokens_param)
            for i, child_id in enumerate(prompt.request_ids):
                seed = None if plan.seed is None else plan.seed + i
                sampling = plan.make_sampling(max_tokens, seed)
                if prompt.grammar is not None:
                    sampling.grammar = prompt.grammar
                requests.append(wire.GenerateRequest(
                    request_id=child_id, prompt_token_ids=prompt.token_ids,
                    sampling=sampling, priority=plan.priority,
                    cache_salt=plan.cache_salt, tokenizer_id=prompt.tokenizer_id,
                    arrival_time=time.time(), deadline_s=self._deadline_left(),
                    lora=self.lora, mm_items=prompt.mm_items))
        return requests

    def _deadline_left(self) -> float:
        """Seconds left of the request's deadline, as the engine takes it (0: none)."""
        if self.deadline_at is None:
            return 0.0
        return max(self.deadline_at - time.monotonic(), 1e-3)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Every choice's deltas, in arrival order, until all have finished."""
        while self._num_finished < len(self.generations):
            delta = await self._next_delta(0.0)
            assert delta is not None
            yield delta

    async def deltas_or_idle(self, idle_s: float) -> AsyncIterator[TextDelta | None]:
        """As deltas(), and None each time none arrived for `idle_s` (0: never): the tick a
        stream sends its keep-alives on."""
        while self._num_finished < len(self.generations):
            yield await self._next_delta(idle_s)

    async def _next_delta(self, idle_s: float) -> TextDelta | None:
        """The next delta of any choice, or None after `idle_s` (> 0) without one. Past
        --request-timeout-s without one, or the deadline, it raises."""
        wait_s = self._last_delta_at + self.request_timeout_s - time.monotonic()
        if self.deadline_at is not None:
            # NOTE: the engine ends the request at its deadline; this grace covers an
            # engine that went silent, so the client hears by the deadline + grace.
            wait_s = min(wait_s, self.deadline_at + DEADLINE_GRACE_S - time.monotonic())
        is_tick = 0 < idle_s < wait_s
        try:
            # NOTE: a timed-out Queue.get() loses no item: the tick is safe to take.
            delta = await asyncio.wait_for(self._queue.get(),
                                           idle_s if is_tick else max(wait_s, 0.0))
        except asyncio.TimeoutError:
            if is_tick:
                return None
            if self.deadline_at is not None and time.monotonic() >= self.deadline_at:
                raise deadline_exceeded() from None
            raise unavailable(f"no output for {self.request_timeout_s:.0f} s; the request "
                              f"was aborted", code="timeout") from None
        self._last_delta_at = time.monotonic()
        self._account(delta)
        return delta

    def _account(self, delta: TextDelta) -> None:
        index = delta.index
        self._num_tokens[index] = self._num_tokens.get(index, 0) + delta.num_new_tokens
        generation = self.generations[index]
        self.timer.on_output(index, delta.num_new_tokens, generation.engine_id)
        self._settle_route()
        if delta.finish is not None:
            self._num_finished += 1
            if self.router is not None and index == 0:
                self.router.observe_cached(delta.finish.num_cached_tokens)
            self.timer.on_finished(index, generation.request_id, delta.finish,
                                   self._num_tokens[index], generation.engine_id,
                                   count_prompt=index % self._n == 0,
                                   num_moves=generation.num_moves)

    def prompt_token_ids(self, prompt_index: int) -> list[int]:
        return unpack_int32(self.prompts[prompt_index].token_ids).tolist()

    @property
    def num_prompt_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prompts)

    def _settle_route(self) -> None:
        # NOTE: runs on every delta; only the first one settles.
        if self.router is not None and self.route is not None and not self.route.settled:
            self.router.settle(self.route)

    async def close(self) -> None:
        """Aborts every choice still running (client gone, error, timeout)."""
        if self.router is not None and self.route is not None:
            # NOTE: a move may have placed the choices elsewhere; the first says where.
            ended_on = self.generations[0].engine_id if self.generations else ""
            self.router.release(self.route, sum(self._num_tokens.values()), ended_on)
        for generation in self.generations:
            if not generation.finished:
                self.timer.on_aborted(generation.index, generation.request_id,
                                      self._num_tokens.get(generation.index, 0),
                                      generation.engine_id)
        await self.client.abort(self.generations)

    async def _release_all(self) -> None:
        for index, prompt in enumerate(self.prompts):
            await self.client.release(prompt.tokenizer_id,
                                      prompt.request_ids + self._prefill_ids(index))

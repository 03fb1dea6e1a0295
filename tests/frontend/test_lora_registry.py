"""The gateway's LoRA adapters by model name: --lora-modules forms, ids every replica
derives alike, the base model an adapter runs on, and the engine a request for it prefers
(one holding the adapter while it can start the request at once; one serving LoRA at all)."""

from __future__ import annotations

import pytest

from services.common import wire
from services.frontend.engine_client.mesh_view import EngineView
from services.frontend.engine_client.request_run import RequestRun
from services.frontend.errors import ApiError
from services.frontend.openai.lora_registry import LoraModule, LoraRegistry, parse_lora_module


def test_both_flag_forms_parse_and_bad_ones_say_what_is_expected() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoraModule("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == \
        LoraModule("sql", "/a", "m")
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_module("sql")
    with pytest.raises(ValueError, match="JSON object with name and path"):
        parse_lora_module('{"name": "sql"}')


def test_ids_are_stable_positive_int32_and_differ_by_name_and_path() -> None:
    ids = {LoraModule(n, p).lora_id for n in ("a", "b") for p in ("/x", "/y")}
    assert len(ids) == 4 and all(0 < i < 2**31 for i in ids)
    assert LoraModule("a", "/x").lora_id == LoraModule("a", "/x", "base").lora_id


def test_resolve_gives_the_base_model_and_the_adapter() -> None:
    registry = LoraRegistry.from_specs(["sql=/a", '{"name": "t", "path": "/b", '
                                                  '"base_model_name": "m2"}'])
    assert registry.resolve("m1", ["m1"]) == ("m1", None)
    base, lora = registry.resolve("sql", ["m1"])
    assert base == "m1" and lora == wire.LoraRequest(lora_id=LoraModule("sql", "/a").lora_id,
                                                     name="sql", path="/a")
    assert registry.resolve("t", ["m1", "m2"])[0] == "m2"
    with pytest.raises(ApiError, match="give the adapter 'sql' a base_model_name"):
        registry.resolve("sql", ["m1", "m2"])
    with pytest.raises(ApiError, match="already been loaded"):
        registry.add(LoraModule("sql", "/c"))
    registry.remove("sql")
    assert "sql" not in registry and [m.name for m in registry] == ["t"]
    with pytest.raises(ApiError) as missing:
        registry.remove("sql")
    assert missing.value.status == 404


def _engine(engine_id: str, max_loras: int, lora_ids: set[int] = frozenset(),
            num_waiting: int = 0) -> EngineView:
    return EngineView(engine_id, f"s-{engine_id}", "m", 2048, num_running=1,
                      num_waiting=num_waiting, kv_cache_usage=0.1, max_loras=max_loras,
                      lora_ids=frozenset(lora_ids))


def test_a_request_prefers_engines_holding_its_adapter_while_they_have_room() -> None:
    run = RequestRun(None, None, "r", 60.0, None)   # type: ignore[arg-type]
    plain, cold, holder = _engine("plain", 0), _engine("cold", 2), _engine("holder", 2, {5})
    assert run._with_lora([plain, cold]) == [plain, cold]        # no adapter: all
    run.lora = wire.LoraRequest(lora_id=5, name="a", path="/a")
    assert run._with_lora([plain, cold, holder]) == [holder]
    queued = _engine("holder", 2, {5}, num_waiting=3)
    assert run._with_lora([plain, cold, queued]) == [cold, queued]
    with pytest.raises(ApiError, match="--enable-lora"):
        run._with_lora([plain])

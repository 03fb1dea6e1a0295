"""The engine core's FinishReason (pure: no wire types) and the wire's are two enums for one
thing. The scheduler service hands a core reason on by its value
(services/scheduler/delta_publisher.py), so they must agree member for member."""

from __future__ import annotations

from services.common import wire
from services.scheduler.core import FinishReason


def test_every_core_reason_is_the_wire_reason_of_the_same_value_and_name() -> None:
    for reason in FinishReason:
        assert wire.FinishReason(reason.value).name == reason.name


def test_the_wire_has_no_reason_the_core_lacks_but_none() -> None:
    core = {reason.name for reason in FinishReason}
    assert {reason.name for reason in wire.FinishReason} - core == {"NONE"}
    assert wire.FinishReason.NONE.value not in {reason.value for reason in FinishReason}

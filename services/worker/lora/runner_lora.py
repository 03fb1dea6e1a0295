"""The model runner's LoRA hooks: register the adapters new requests name, map each step's
rows to their adapters before the forward pass, and report requests whose adapter could
not be loaded (they end with a 400, the rest of the step runs).

A request names its adapter by id and path (wire_pb.LoraRequest): the worker reads the PEFT
directory the first time it sees the id, or a new path for it, so no control message has
to reach every worker before a request may use an adapter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import structlog

from services.common import wire_pb
from services.worker.lora.adapter import LoraError
from services.worker.lora.lora_manager import BASE_LORA_ID, LoraManager
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.step_batch import StepBatch
from services.worker.runner.step_hooks import StepHooks
from services.worker.runner.step_output import add_rejections

log = structlog.get_logger(__name__)


class RunnerLora(StepHooks):
    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager
        self._rejections: dict[int, str] = {}   # handle -> why; sent with the next output

    def add_requests(self, input_batch: InputBatch, step: wire_pb.StepInput) -> None:
        """Registers the adapters of the step's new requests (already in the batch); a
        request whose adapter cannot be loaded runs this step as the base model and is
        reported rejected, so the scheduler ends it."""
        for new in step.new_requests:
            lora = new.lora   # unset: lora_id 0, the base model
            if lora.lora_id == BASE_LORA_ID or self._register(new.handle, lora):
                continue
            input_batch.lora_ids[input_batch.handle_to_row[new.handle]] = BASE_LORA_ID

    def prepare_forward(self, batch: StepBatch, input_batch: InputBatch) -> None:
        self.manager.prepare_step(input_batch.lora_ids[batch.rows],
                                  np.diff(batch.attn.query_start_loc_cpu))

    def report(self, out: wire_pb.StepOutput) -> None:
        """Adds the requests refused since the last output to its rejected ones."""
        add_rejections(out, self._rejections)
        self._rejections.clear()

    def _register(self, handle: int, lora: wire_pb.LoraRequest) -> bool:
        path = Path(lora.path)
        if self.manager.lora_id_to_path.get(lora.lora_id) == path:
            return True
        try:
            self.manager.add_adapter(lora.lora_id, path)
        except (LoraError, OSError, ValueError, KeyError) as exc:
            log.warning("LoRA adapter refused", name=lora.name, path=lora.path, error=str(exc))
            self._rejections[handle] = (f"the LoRA adapter {lora.name!r} could not be loaded "
                                        f"from {lora.path}: {exc}")
            return False
        log.info("LoRA adapter loaded", name=lora.name, lora_id=lora.lora_id, path=lora.path)
        return True

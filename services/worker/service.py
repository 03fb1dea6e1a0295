"""The worker service: one per accelerator. It holds the model weights and KV tensors and
runs the steps its scheduler sends (services/worker/runner/model_runner.py does the work)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

from services.common import wire, wire_pb
from services.common.kv_data_plane import client_tls
from services.common.metrics import EncoderCacheMetrics, GrammarMetrics
from services.common.mm_inputs import MultiModalInputs
from services.common.model_files import resolve_model
from services.common.packing import pack_int32
from services.common.service import Service
from services.common.startup import StartupPhases
from services.common.step_channel import StepChannelServer, host_identity
from services.worker.kv.connector import WorkerKVConnector
from services.worker.kv.transfer import KVTransferThread
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from services.worker.runner.sleep_mode import SleepMode, SleepModeError
from services.worker.runner.warm_up import warm_up
from services.worker.runner.weight_update import WeightUpdateError, WeightUpdates
from services.worker.settings import WorkerSettings

GIL_SWITCH_INTERVAL_S = 0.0002
T = TypeVar("T")


class WorkerService(Service):
    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.settings: WorkerSettings = settings
        # NOTE: the step thread takes the GIL back between ~400 torch calls a step, and
        # waits for it each time another thread holds it (the KV transfer thread packing
        # saves, the event loop) for up to the switch interval: at Python's 5 ms, steps of
        # 35 ms took 1-2 s beside write-through saves (benchmarks.md section 10).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.runner: ModelRunner | None = None
        # One thread runs every step in order; the event loop stays free for heartbeats.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        self._incarnation = time.time_ns() & 0x7FFF_FFFF_FFFF_FFFF
        self._steps_in_flight = 0
        # With the local step channel, the executor's thread serves it for good, and steps
        # that come over NATS run there too (step_channel.py says why one thread).
        self._step_channel: StepChannelServer | None = None
        self._mm_inputs: MultiModalInputs | None = None   # vision models: preprocessed images
        self.sleep_mode: SleepMode | None = None   # with --enable-sleep-mode
        self.weight_updates: WeightUpdates | None = None
        self._weights_lock = asyncio.Lock()        # one weight command at a time

    async def setup(self) -> None:
        if self.settings.enable_sleep_mode and (self.settings.tensor_parallel_size > 1
                                                or self.settings.enable_lora):
            # NOTE: other ranks' processes hold their shards; adapters are set into the model.
            raise ValueError("--enable-sleep-mode works with one rank and no LoRA (not with "
                             "--tensor-parallel-size > 1 or --enable-lora)")
        with self.startup.phase("model files"):
            files = await asyncio.to_thread(resolve_model, self.settings.model)
        self.log.info("loading model", model=str(files.source), dtype=self.settings.dtype)
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(
            self._executor, partial(_load_runner, RunnerConfig.from_settings(self.settings, files.hf_dir),
                                    GrammarMetrics(self.registry), self.startup,
                                    EncoderCacheMetrics(self.registry)))
        with self.startup.phase("KV connector and grammar warm-up"):
            if self.runner.hybrid is not None:
                # NOTE: the kvstore holds attention blocks only, never a recurrent state.
                self.log.warning("the KV connector (kvstore offload, P/D) is off for a hybrid "
                                 "model: the kvstore does not carry its recurrent state")
            elif self.runner.parallel is None:
                self.runner.attach_kv_connector(self._kv_connector(self.runner))
            else:
                # NOTE: the kvstore holds whole blocks; each rank holds some heads of them.
                self.log.warning("the KV connector (kvstore offload) is off under tensor "
                                 "parallelism", tensor_parallel_size=self.settings
                                 .tensor_parallel_size)
            self.runner.structured_outputs.warm()   # the first grammar must not wait for it
        self._served_name = self.settings.served_model_name or files.served_name
        bus = self.connected_bus
        if self.runner.multimodal is not None:
            self._mm_inputs = await MultiModalInputs.open(
                bus.client.jetstream(), self.subjects, self.settings.jetstream_replicas)
        await bus.serve(self.subjects.worker_step(self.settings.engine_id), wire_pb.StepInput,
                        self.on_step)
        if self.settings.step_transport == "auto":
            self._open_step_channel(asyncio.get_running_loop())
        await bus.serve(self.subjects.worker_info(self.settings.engine_id),
                        wire.WorkerInfoRequest, self.on_info_request)
        if self.settings.enable_sleep_mode:
            self.sleep_mode = SleepMode(self.runner)
            await bus.serve(self.subjects.worker_sleep(self.settings.engine_id),
                            wire.SleepRequest, self.on_sleep)
            await bus.serve(self.subjects.worker_wake_up(self.settings.engine_id),
                            wire.WakeUpRequest, self.on_wake_up)
        self.weight_updates = WeightUpdates(self.runner)
        await bus.serve(self.subjects.worker_weights(self.settings.engine_id),
                        wire.WeightUpdateRequest, self.on_weights, concurrent=True)
        await bus.publish(self.subjects.worker_hello(self.settings.engine_id), self.worker_info())

    def _open_step_channel(self, loop: asyncio.AbstractEventLoop) -> None:
        name = self.subjects.worker_step_channel(self.settings.engine_id, self._incarnation)
        try:
            self._step_channel = StepChannelServer(name)
        except OSError as exc:
            self.log.warning("local step channel unavailable; steps come over NATS",
                             error=str(exc))
            return
        serving = self._executor.submit(self._step_channel.serve,
                                        partial(self._on_local_step, loop))
        serving.add_done_callback(self._on_channel_closed)

    def _on_channel_closed(self, serving: Future[None]) -> None:
        if not serving.cancelled() and (exc := serving.exception()) is not None:
            # NOTE: never expected; the scheduler's reconnect then finds NATS.
            self.log.error("the local step channel failed; steps come over NATS",
                           error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        self._step_channel = None

    def _on_local_step(self, loop: asyncio.AbstractEventLoop, frame: bytes) -> bytes:
        """A step from the local channel, in the step thread: no event loop on the way."""
        received_at = time.perf_counter()
        try:
            step = wire_pb.StepInput.FromString(frame)
            if self._needs_images(step):
                asyncio.run_coroutine_threadsafe(self._fetch_images(step), loop).result()
        except Exception as exc:  # noqa: BLE001 - the step fails, the channel goes on
            out = wire_pb.StepOutput(error=f"{type(exc).__name__}: {exc}")
        else:
            out = self._run_step(step)
        out.worker_received_at, out.worker_sent_at = received_at, time.perf_counter()
        return out.SerializeToString()

    def _run_step(self, step: wire_pb.StepInput) -> wire_pb.StepOutput:
        assert self.runner is not None
        self._steps_in_flight += 1
        try:
            return self.runner.execute(step)
        finally:
            self._steps_in_flight -= 1

    def _kv_connector(self, runner: ModelRunner) -> WorkerKVConnector:
        s = self.settings
        transfer = KVTransferThread(runner.kv_fingerprint, runner.kv_spec.bytes_per_block,
                                    s.kv_load_timeout_s, s.kv_save_timeout_s,
                                    s.kv_save_buffer_bytes, tls=client_tls(s))
        return WorkerKVConnector(runner.kv_caches, runner.kv_spec, runner.device, transfer)

    def worker_info(self) -> wire.WorkerInfo:
        assert self.runner is not None
        info = self.runner.info
        return wire.WorkerInfo(
            engine_id=self.settings.engine_id, worker_id=self.instance_id,
            num_blocks=info.num_blocks, block_size=info.block_size,
            max_model_len=info.max_model_len, model=self._served_name,
            vocab_size=info.vocab_size, eos_token_ids=pack_int32(info.eos_token_ids),
            incarnation=self._incarnation, host_id=host_identity(),
            step_channel=self._step_channel.name if self._step_channel is not None else "",
            # An empty fingerprint turns the scheduler's side of the KV connector off.
            kv_fingerprint=self.runner.kv_fingerprint if self.runner.kv_connector else "",
            max_loras=self.runner.lora.manager.max_loras if self.runner.lora else 0,
            max_cpu_loras=self.runner.lora.manager.max_cpu_loras if self.runner.lora else 0,
            weight_version=self.weight_updates.version if self.weight_updates else "",
            has_recurrent_state=self.runner.hybrid is not None,
            num_state_checkpoints=self.runner.hybrid.num_checkpoints if self.runner.hybrid else 0)

    def readiness(self) -> tuple[bool, str]:
        return (True, "") if self.runner is not None else (False, "loading model")

    def fill_heartbeat(self, heartbeat: wire.Heartbeat) -> None:
        heartbeat.engine_id = self.settings.engine_id

    async def on_info_request(self, _: wire.WorkerInfoRequest) -> wire.WorkerInfo:
        return self.worker_info()

    async def on_step(self, step: wire_pb.StepInput) -> wire_pb.StepOutput:
        """A step over NATS: a scheduler on another host, or one told not to use the local
        channel."""
        if self._needs_images(step):
            await self._fetch_images(step)
        return await self._in_step_thread(partial(self._run_step, step))

    async def _in_step_thread(self, call: Callable[[], T]) -> T:
        """Runs `call` where steps run, in order with them."""
        if self._step_channel is not None:
            return await asyncio.wrap_future(self._step_channel.call(call))
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    # ---- sleep mode (--enable-sleep-mode): its scheduler sends no step meanwhile

    async def on_sleep(self, message: wire.SleepRequest) -> wire.SleepReply:
        assert self.sleep_mode is not None
        return await self._sleep_mode_call(partial(self.sleep_mode.sleep, message.level))

    async def on_wake_up(self, message: wire.WakeUpRequest) -> wire.SleepReply:
        assert self.sleep_mode is not None
        return await self._sleep_mode_call(partial(self.sleep_mode.wake_up, message.tags))

    async def _sleep_mode_call(self, call: Callable[[], float]) -> wire.SleepReply:
        assert self.sleep_mode is not None
        reply = wire.SleepReply()
        try:
            reply.seconds = await self._in_step_thread(call)
        except SleepModeError as exc:
            reply.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - the caller learns why; the worker stays
            self.log.exception("sleep mode call failed")
            reply.error = f"{type(exc).__name__}: {exc}"
        reply.sleeping_tags = sorted(self.sleep_mode.sleeping)
        return reply

    # ---- weight updates (runner/weight_update.py): loads run beside steps, commits between

    async def on_weights(self, message: wire.WeightUpdateRequest) -> wire.WeightUpdateReply:
        assert self.weight_updates is not None and self.runner is not None
        updates = self.weight_updates
        reply = wire.WeightUpdateReply()
        async with self._weights_lock:
            try:
                reply.seconds = await self._weights_call(updates, message)
            except WeightUpdateError as exc:
                reply.error, reply.http_status = str(exc), 400
            except Exception as exc:  # noqa: BLE001 - the caller learns why; the worker stays
                self.log.exception("weight update failed", command=message.command)
                reply.error, reply.http_status = f"{type(exc).__name__}: {exc}", 503
        reply.weight_version = updates.version
        reply.kv_fingerprint = self.runner.kv_fingerprint if self.runner.kv_connector else ""
        return reply

    async def _weights_call(self, updates: WeightUpdates,
                            message: wire.WeightUpdateRequest) -> float:
        if message.command == "load":
            if self.sleep_mode is not None and "weights" in self.sleep_mode.sleeping:
                raise WeightUpdateError("the weights sleep: POST /wake_up?tags=weights first")
            return await asyncio.to_thread(updates.load, Path(message.model_path),
                                           message.weight_version)
        if message.command == "commit":
            return await self._in_step_thread(updates.commit)
        if message.command == "discard":
            updates.discard()
            return 0.0
        raise WeightUpdateError(f"unknown weight command {message.command!r}")

    def _needs_images(self, step: wire_pb.StepInput) -> bool:
        return self._mm_inputs is not None and any(new.mm_items for new in step.new_requests)

    async def _fetch_images(self, step: wire_pb.StepInput) -> None:
        """Hands the runner the preprocessed images the step's new requests bring, unless it
        holds them or has them encoded. One that cannot be fetched is left out: the runner
        rejects its request with the reason, and the rest of the step runs."""
        multimodal = self.runner.multimodal if self.runner is not None else None
        if multimodal is None or self._mm_inputs is None:
            return
        store = self._mm_inputs
        keys = {item.data_key for new in step.new_requests for item in new.mm_items
                if multimodal.needs_payload(item)}

        async def fetch(key: str) -> None:
            try:
                multimodal.add_payload(key, await store.get(key))
            except Exception as exc:  # noqa: BLE001 - its request is rejected, not the step
                self.log.warning("preprocessed image not fetched", data_key=key,
                                 error=f"{type(exc).__name__}: {exc}")

        async with asyncio.TaskGroup() as tasks:
            for key in keys:
                tasks.create_task(fetch(key))

    async def drain(self) -> None:
        # The scheduler drives steps; finish the one in flight, if any.
        while self._steps_in_flight:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._step_channel is not None:
            self._step_channel.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.runner is not None:
            self.runner.close()


def _load_runner(config: RunnerConfig, grammar_metrics: GrammarMetrics, startup: StartupPhases,
                 encoder_cache_metrics: EncoderCacheMetrics) -> ModelRunner:
    """Loads the model runner and warms it up before the worker says hello: in the step
    thread, where every step runs."""
    runner = ModelRunner(config, grammar_metrics, startup, encoder_cache_metrics)
    with startup.phase("warm-up"):
        warm_up(runner)
    return runner

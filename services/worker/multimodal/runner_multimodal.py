"""The model runner's image hooks (issue 19): keep each live request's images, encode them
(once per content hash: the encoder cache), put their embeddings in place of the placeholder
tokens' and, for Qwen2-VL, hand the model M-RoPE positions.

Lifecycle of an image:
1. the service fetches its preprocessed tensors (services/common/mm_inputs.py) before the
   step that brings its request, unless held or encoded already (needs_payload), and hands
   them over with add_payload;
2. that step's add_requests() resolves the request's images: the encoder cache by content hash,
   else the vision tower over the payload (then cached); the payload is dropped. An image
   that cannot be resolved (payload gone, bad tensors) rejects its request with the reason:
   the request runs this step on its placeholders' text embeddings and the scheduler ends it;
3. each step, prepare_inputs() scatters the slice of embeddings a row's scheduled positions
   cover (a prefill chunk may split an image's run; is_embed picks the positions that take
   embeddings, in order) and builds the positions: [3, T] where an image's request runs;
4. an image's embeddings are dropped once its run is computed; a request resumed after
   preemption arrives as a new request and resolves again (most likely from the cache).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import structlog
import torch

from services.common import wire_pb
from services.common.metrics import EncoderCacheMetrics
from services.common.packing import unpack_int32
from services.worker.models.config import ModelConfig, UnsupportedModelError
from services.worker.models.vision.encoder_cache import EncoderCache
from services.worker.models.vision.mrope import mrope_positions
from services.worker.models.vision.qwen2_vl_grid import Grid
from services.worker.models.vision.registry import load_vision_encoder
from services.worker.models.weights import WeightSource
from services.worker.multimodal.mm_request import MultiModalRequest
from services.worker.runner.config import RunnerConfig
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.step_batch import StepBatch
from services.worker.runner.step_hooks import StepHooks
from services.worker.runner.step_output import add_rejections

log = structlog.get_logger(__name__)

Payload = dict[str, np.ndarray]


class RunnerMultiModal(StepHooks):
    def __init__(self, config: RunnerConfig, model_config: ModelConfig, device: torch.device,
                 metrics: EncoderCacheMetrics | None = None):
        hf = json.loads((config.model_dir / "config.json").read_text())
        weights = WeightSource(config.model_dir, config.torch_dtype, device)
        self.encoder = load_vision_encoder(hf, weights, config.torch_dtype, device)
        self.dtype = config.torch_dtype
        self.cache = EncoderCache(config.encoder_cache_size)
        self.metrics = metrics
        self.image_token_id = int(hf["image_token_id"])
        self.uses_mrope = model_config.mrope_section is not None
        self.spatial_merge_size = (hf.get("vision_config") or {}).get("spatial_merge_size", 2)
        self._payloads: dict[str, Payload] = {}
        # Content hash -> the image's grid (Qwen2-VL; None for Idefics3), kept while the
        # cache holds its embeddings: M-RoPE needs the grid of a cached image too.
        self._grids: dict[str, Grid | None] = {}
        self._requests: dict[int, MultiModalRequest] = {}
        self._rejections: dict[int, str] = {}   # handle -> why; sent with the next output

    # --- payloads (the service's side) ---

    def needs_payload(self, item: wire_pb.MultiModalItem) -> bool:
        """Whether the image's tensors must be fetched: not held, and not encoded already."""
        return item.data_key not in self._payloads and item.content_hash not in self._grids

    def add_payload(self, data_key: str, tensors: Payload) -> None:
        self._payloads[data_key] = tensors

    # --- step hooks ---

    def add_requests(self, _input_batch: InputBatch, step: wire_pb.StepInput) -> None:
        """Applies the step's diffs: drops finished requests, resolves new ones' images."""
        if step.reset:
            self._requests.clear()
        for handle in unpack_int32(step.finished_handles).tolist():
            self._requests.pop(handle, None)
        for new in step.new_requests:
            self._requests.pop(new.handle, None)   # resumed under the same handle
            if new.mm_items:
                self._add_request(new)

    def prepare_inputs(self, batch: StepBatch, embed: Callable[[torch.Tensor], torch.Tensor]
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's input embeddings (None: no image position is scheduled) and positions."""
        if not self._requests:
            return None, batch.positions
        qsl = batch.attn.query_start_loc_cpu
        starts = batch.seq_lens - np.diff(qsl)
        token_index: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        deltas = np.zeros(batch.num_tokens, dtype=np.int64)   # M-RoPE past the prompts
        prompt_positions: list[tuple[int, torch.Tensor]] = []   # M-RoPE in the prompts
        for i, handle in enumerate(batch.handles.tolist()):
            req = self._requests.get(handle)
            if req is None:
                continue
            start, end = int(starts[i]), int(batch.seq_lens[i])
            for index, selected in req.scheduled_embeds(start, end):
                if req.embeds[index] is None:   # released, its run computed: scheduled again
                    self._resolve(req, index)
                embeds = req.embeds[index]
                assert embeds is not None
                token_index.append(qsl[i] + req.positions[index][selected] - start)
                rows.append(embeds[torch.from_numpy(selected)])
            if req.mrope is not None:
                deltas[qsl[i]:qsl[i + 1]] = req.mrope_delta
                if start < req.num_prompt_tokens:
                    prompt_positions.append((int(qsl[i]), req.step_positions(start, end)))
            req.release_computed(end)
        inputs_embeds = None
        if rows:
            inputs_embeds = embed(batch.input_ids)
            index = torch.from_numpy(np.concatenate(token_index)).to(inputs_embeds.device)
            inputs_embeds[index] = torch.cat(rows).to(inputs_embeds.dtype)
        return inputs_embeds, _mrope_positions(batch.positions, deltas, prompt_positions)

    def report(self, out: wire_pb.StepOutput) -> None:
        """Adds the requests refused since the last output to its rejected ones."""
        add_rejections(out, self._rejections)
        self._rejections.clear()

    # --- internals ---

    def _add_request(self, new: wire_pb.NewRequestData) -> None:
        try:
            req = MultiModalRequest.of(new)
            # NOTE: an image wholly inside the computed prefix (a prefix-cache hit) is not
            # encoded; M-RoPE still needs its grid.
            grids = [self._grid(req.items[index])
                     if req.is_computed(index, new.num_computed_tokens)
                     else self._resolve(req, index) for index in range(len(req.items))]
            if self.uses_mrope:
                prompt = unpack_int32(new.token_ids)[:new.num_prompt_tokens].tolist()
                req.mrope, req.mrope_delta = mrope_positions(
                    prompt, self.image_token_id, grids, self.spatial_merge_size)
        except (KeyError, ValueError, RuntimeError) as exc:   # its images, not the step
            log.warning("request with images refused", request_id=new.request_id,
                        error=str(exc))
            self._rejections[new.handle] = f"its images could not be run: {exc}"
            return
        finally:
            for item in new.mm_items:
                self._payloads.pop(item.data_key, None)
        self._requests[new.handle] = req

    def _resolve(self, req: MultiModalRequest, index: int) -> Grid | None:
        """Puts the item's embeddings in req (cached, else encoded); returns its grid."""
        item = req.items[index]
        embeds = self.cache.get(item.content_hash)
        grid = self._grids.get(item.content_hash)
        if self.metrics is not None:
            self.metrics.queries.inc()
            if embeds is not None:
                self.metrics.hits.inc()
        if embeds is None:
            embeds, grid = self._encode(self._payload(item))
            if self.cache.put(item.content_hash, embeds):
                self._grids[item.content_hash] = grid
                self._grids = {h: g for h, g in self._grids.items() if h in self.cache}
        if embeds.shape[0] != len(req.positions[index]):
            raise ValueError(f"the image makes {embeds.shape[0]} embeddings for "
                             f"{len(req.positions[index])} placeholder positions")
        req.embeds[index] = embeds
        return grid

    def _payload(self, item: wire_pb.MultiModalItem) -> Payload:
        payload = self._payloads.get(item.data_key)
        if payload is None:
            raise KeyError(f"the preprocessed image {item.data_key!r} is missing (expired "
                           f"from the mm inputs store?)")
        return payload

    def _grid(self, item: wire_pb.MultiModalItem) -> Grid | None:
        """The image's grid without encoding it (None where M-RoPE needs none)."""
        if not self.uses_mrope:
            return None
        if item.content_hash in self._grids:
            return self._grids[item.content_hash]
        return _payload_grid(self._payload(item))

    @torch.inference_mode()
    def _encode(self, payload: Payload) -> tuple[torch.Tensor, Grid | None]:
        """An image's embeddings [num_embeds, hidden] and (Qwen2-VL) its grid."""
        pixel_values = torch.from_numpy(payload["pixel_values"]).to(self.dtype)
        grid = _payload_grid(payload)
        if grid is not None:
            return torch.cat(self.encoder.encode(pixel_values, [grid])), grid
        mask = payload.get("pixel_attention_mask")
        return torch.cat(self.encoder.encode(
            pixel_values, None if mask is None else torch.from_numpy(mask))), None


def _mrope_positions(positions: torch.Tensor, deltas: np.ndarray,
                     prompt_positions: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The step's positions [T] (no M-RoPE row), else [3, T]: each token's index plus its
    request's delta in all three rows, then the prompt chunks' positions (one copy)."""
    if not prompt_positions and not deltas.any():
        return positions
    out = (positions + torch.from_numpy(deltas).to(positions.device)).expand(3, -1).clone()
    if prompt_positions:
        index = torch.cat([torch.arange(first, first + rows.shape[1])
                           for first, rows in prompt_positions])
        out[:, index.to(out.device)] = torch.cat(
            [rows for _, rows in prompt_positions], dim=1).to(out.device)
    return out


def _payload_grid(payload: Payload) -> Grid | None:
    """Qwen2-VL's image_grid_thw [1, 3] as (t, h, w); None for other processors."""
    if "image_grid_thw" not in payload:
        return None
    grids = payload["image_grid_thw"].reshape(-1, 3).tolist()
    if len(grids) != 1:
        raise ValueError(f"one image a payload, got {len(grids)} grids")
    t, h, w = grids[0]
    return int(t), int(h), int(w)


def enable_multimodal(config: RunnerConfig, model_config: ModelConfig, device: torch.device,
                      is_parallel: bool, metrics: EncoderCacheMetrics | None
                      ) -> RunnerMultiModal | None:
    """The image hooks of a vision-language checkpoint (None for a text model)."""
    if model_config.vision_model_type is None:
        return None
    if is_parallel:
        raise UnsupportedModelError("vision-language models do not run under tensor "
                                    "parallelism yet")
    return RunnerMultiModal(config, model_config, device, metrics)

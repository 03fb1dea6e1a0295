"""Vision encoders: images -> embeddings that replace a prompt's image placeholder tokens.

- registry.py: load_vision_encoder(config.json, tensors, dtype, device) for qwen2_vl,
  qwen2_5_vl, idefics3 and smolvlm; each encoder's encode() returns one [num_image_tokens,
  text hidden] tensor per image (per sub-image for Idefics3).
- mrope.py: Qwen2-VL's 3-row positions for a prompt with images, and the rope that reads them.
- encoder_cache.py: an LRU of embeddings by image content hash.
"""

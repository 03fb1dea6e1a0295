"""Time to first token of a chat request with an image (issue 19), three ways, on one mesh in
one run: cold (an image the mesh has never seen), with the encoder cache (an image seen
before, after other text: no prefix block is shared, the worker re-uses its embeddings) and
with the prefix cache (the same request again: the image's blocks are cached).

    python -m benchmarks.make_smolvlm /tmp/smolvlm
    python -m benchmarks.multimodal_ttft --model /tmp/smolvlm --repeat 5

Each request streams one token (max_tokens 1); TTFT is measured at the client (the openai
client over HTTP), medians over --repeat fresh images.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from benchmarks.harness import REPO_ROOT, mesh_up, print_preamble

QUESTION = "Describe the picture in one word."


def image_url(seed: int, size: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ttft_s(client: openai.OpenAI, model: str, parts: list[dict]) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(model=model, max_tokens=1, temperature=0,
                                            stream=True,
                                            messages=[{"role": "user", "content": parts}])
    for chunk in stream:
        # NOTE: the first chunk names the role with empty content before any token exists;
        # the token is the first with text, or the finish (a token that decodes to nothing).
        if chunk.choices and (chunk.choices[0].delta.content
                              or chunk.choices[0].finish_reason is not None):
            elapsed = time.perf_counter() - started
            break
    else:
        raise RuntimeError("the stream ended without a token")
    for _ in stream:   # drain: the connection goes back to the pool
        pass
    return elapsed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a vision-language model dir")
    parser.add_argument("--repeat", type=int, default=5, help="fresh images per case")
    parser.add_argument("--image-size", type=int, default=512, help="pixels per side")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results")
    args = parser.parse_args(argv)
    print_preamble()
    args.out.mkdir(parents=True, exist_ok=True)
    with mesh_up(["--model", str(args.model)], args.out / "multimodal_ttft.mesh.log") as mesh:
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        ttft_s(client, model, [{"type": "text", "text": "Warm up."}])
        cases: dict[str, list[float]] = {"cold": [], "encoder cache": [], "prefix cache": []}
        for i in range(args.repeat):
            image = {"type": "image_url", "image_url": {"url": image_url(i, args.image_size)}}
            text = {"type": "text", "text": QUESTION}
            cases["cold"].append(ttft_s(client, model, [image, text]))
            cases["prefix cache"].append(ttft_s(client, model, [image, text]))
            other = {"type": "text", "text": f"Case {i}: look closely."}
            cases["encoder cache"].append(ttft_s(client, model, [other, image, text]))
    cold = statistics.median(cases["cold"])
    print(f"\n{args.image_size} px images, {args.repeat} each, TTFT median (ms):")
    for name, samples in cases.items():
        median = statistics.median(samples)
        print(f"  {name:14s} {1e3 * median:8.1f}   ({cold / median:.1f}x faster than cold; "
              f"all: {', '.join(f'{1e3 * s:.0f}' for s in samples)})")


if __name__ == "__main__":
    main()

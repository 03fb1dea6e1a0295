"""Trains a small EAGLE-3 head for the embedded model (SmolLM2-135M-Instruct) on its own
greedy chat answers on CPU (31 min on 2 shared cores, two thirds of it the target's answers
and states, which later runs reuse), and writes it in vLLM's checkpoint layout.

    python -m benchmarks.train_eagle3 --out bench-results/eagle3-smollm2

1. Chat prompts from templates x topics (built in; nothing downloads); a few topics are held
   out and written to `<out>/chat_eval.jsonl` ({"messages": ...} lines for `llm-mesh bench
   serve --workload dataset --endpoint chat`).
2. The target answers each training prompt greedily (the mesh's own model runner, fp32);
   one HF forward pass over each answer keeps the residual stream entering layers 2, L // 2
   and L - 3 and the target's argmax at every position (the labels). Kept in
   `<out>/target_data-<max new tokens>.pt`, which a later run reuses (delete to redo).
3. The head learns with teacher forcing over `--ttt-steps` steps of its own rollout
   (EAGLE-3's training-time test): step 0 reads the target's states; step j reads step
   j - 1's pre-norm output one position back and attends to step 0's keys up to j positions
   back plus its own diagonal, exactly what the worker's chain of drafts sees.
4. `<out>/head/`: config.json (architectures LlamaForCausalLMEagle3, draft_vocab_size,
   eagle_config), model.safetensors (fc, layers.0.*, norm, lm_head, d2t, t2d): the target's
   token embeddings are shared, not saved. Serve it with `--speculative-config
   '{"method": "eagle3", "model": "<out>/head", "num_speculative_tokens": 3}'`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

TEMPLATES = (
    "What is {}?", "Explain {} to a ten-year-old.", "Give me three facts about {}.",
    "Write a short poem about {}.", "Why does {} matter?", "Describe {} in two sentences.",
    "What are the pros and cons of {}?", "How would you teach someone about {}?",
    "Tell me a short story involving {}.", "What is a common misconception about {}?",
)
TOPICS = (
    "photosynthesis", "the moon", "volcanoes", "recycling", "the internet", "honey bees",
    "black holes", "the Roman Empire", "climate change", "electric cars", "chess",
    "the water cycle", "vaccines", "rainbows", "gravity", "coffee", "the ocean tides",
    "democracy", "dinosaurs", "solar panels", "sleep", "music theory", "the human heart",
    "earthquakes", "bread baking", "the stock market", "origami", "penguins", "glaciers",
    "the printing press", "friendship", "exercise", "robots", "time zones", "the alphabet",
    "mountains", "deserts", "plastic", "clouds", "the immune system", "bicycles", "trees",
    "lightning", "the pyramids", "mathematics", "libraries", "birds migrating", "tea",
    "football", "the periodic table", "cooking pasta", "saving money", "the Sahara",
    "spiders", "airplanes", "recipes for soup", "kindness", "the solar system",
    "learning a language", "writing an email", "public speaking", "gardening", "snow",
)
NUM_EVAL_TOPICS = 8   # the last topics: never trained on


def chat_prompts() -> tuple[list[str], list[str]]:
    """(training prompts, held-out evaluation prompts)."""
    train_topics, eval_topics = TOPICS[:-NUM_EVAL_TOPICS], TOPICS[-NUM_EVAL_TOPICS:]
    return ([t.format(x) for x in train_topics for t in TEMPLATES],
            [t.format(x) for x in eval_topics for t in TEMPLATES])


TargetData = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]   # vLLM's default for EAGLE-3


class Eagle3Draft(nn.Module):
    """The head as trained; the worker's eagle3_head.py runs the same weights."""

    def __init__(self, target_config: dict, draft_token_ids: torch.Tensor,
                 embed_tokens: torch.Tensor, aux_layer_ids: Sequence[int]) -> None:
        super().__init__()
        c = target_config
        hidden, self.eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.num_heads, self.num_kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or hidden // self.num_heads
        self.rope_theta = float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0))
        self.target_config, self.aux_layer_ids = c, list(aux_layer_ids)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(2 * hidden, n, bias=False)
                                                 for n in (q, kv, kv))
        self.o_proj = nn.Linear(q, hidden, bias=False)
        inter = c["intermediate_size"]
        self.gate_proj, self.up_proj = (nn.Linear(hidden, inter, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm = (
            nn.Parameter(torch.ones(hidden)) for _ in range(4))
        self.lm_head = nn.Linear(hidden, len(draft_token_ids), bias=False)
        self.register_buffer("draft_token_ids", draft_token_ids)
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """Rotates [B, heads, T, D] by position (HF's rotate_half convention)."""
        half = self.head_dim // 2
        inv_freq = self.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * inv_freq
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def rollout(self, aux: torch.Tensor, input_ids: torch.Tensor,
                num_steps: int) -> list[torch.Tensor]:
        """Normed outputs [B, T, H] of each step. Position p runs token p + 1 (input_ids is
        shifted by the caller) with the target's state at p (step 0) or the last step's
        pre-norm output at p - 1 (step j); step j's query at p sees step 0's keys up to p - j
        and step i's key at p - j + i (i = 1..j)."""
        batch, length = input_ids.shape
        embeds = self._rms(F.embedding(input_ids, self.embed_tokens), self.input_layernorm)
        hidden, keys, values, outputs = self.fc(aux), [], [], []
        positions = torch.arange(length)
        for step in range(num_steps):
            if step:
                hidden = F.pad(prenorm[:, :-1], (0, 0, 1, 0))
            x = torch.cat((embeds, self._rms(hidden, self.hidden_norm)), dim=-1)
            q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
            q, k = self._rope(q), self._rope(k)
            groups = self.num_heads // self.num_kv_heads
            keys.append(k.repeat_interleave(groups, 1))
            values.append(v.repeat_interleave(groups, 1))
            masks = [positions[None, :] <= positions[:, None] - step]
            masks += [positions[None, :] == positions[:, None] - step + i
                      for i in range(1, step + 1)]
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                  attn_mask=torch.cat(masks, 1))
            attn = self.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))
            residual = attn + hidden
            mlp_in = self._rms(residual, self.post_attention_layernorm)
            prenorm = self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
            prenorm = prenorm + residual
            outputs.append(self._rms(prenorm, self.norm))
        return outputs

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        hidden, vocab = self.fc.out_features, self.target_config["vocab_size"]
        tensors = {"fc.weight": self.fc.weight, "norm.weight": self.norm,
                   "lm_head.weight": self.lm_head.weight}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"layers.0.self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"layers.0.mlp.{name}.weight"] = getattr(self, name).weight
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            tensors[f"layers.0.{name}.weight"] = getattr(self, name)
        ids = self.draft_token_ids
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["d2t"] = ids - torch.arange(len(ids))   # target id = draft id + d2t[draft id]
        tensors["t2d"] = t2d
        save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                  directory / "model.safetensors")
        config = {**self.target_config, "architectures": ["LlamaForCausalLMEagle3"],
                  "num_hidden_layers": 1, "draft_vocab_size": len(ids),
                  "target_hidden_size": hidden, "tie_word_embeddings": False,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.aux_layer_ids,
                                   "use_aux_hidden_state": True}}
        config.pop("layer_types", None)   # the target's, one per layer
        (directory / "config.json").write_text(json.dumps(config, indent=2))


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def target_answers(model_dir: Path, prompts: list[list[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """The mesh's own greedy answers (its model runner, fp32, continuous batching), each up
    to its EOS."""
    from services.worker.runner.model_runner import ModelRunner, RunnerConfig
    from tests.worker.driver import StepDriver
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, max_num_seqs=64, max_model_len=1024,
                                      max_num_batched_tokens=2048))
    answers = []
    for start in range(0, len(prompts), 64):   # max_num_seqs at a time
        driver = StepDriver(runner, token_budget=2048)
        handles = [driver.add(p, max_new_tokens) for p in prompts[start:start + 64]]
        outputs = driver.run()
        answers += [outputs[h] for h in handles]
    runner.close()
    return answers


@torch.no_grad()
def target_states(model, sequences: list[tuple[list[int], int]], aux_layer_ids: list[int],
                  batch_size: int = 16) -> list[TargetData]:
    """Per (ids, prompt length): ids [T], aux states [T, 3H] (bf16, to halve their memory),
    the target's argmax at each position [T], prompt length. Batched, right-padded."""
    data = []
    for start in range(0, len(sequences), batch_size):
        group = sequences[start:start + batch_size]
        width = max(len(ids) for ids, _ in group)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in group])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in group])
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
        argmax = out.logits.argmax(-1)
        for row, (seq, prompt_len) in enumerate(group):
            n = len(seq)
            data.append((ids[row, :n], aux[row, :n].bfloat16(), argmax[row, :n], prompt_len))
    return data


def batches(data: list[TargetData], draft_index: torch.Tensor, batch_size: int,
            shuffle: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(aux, shifted input ids, draft-vocab labels or -100) per batch: head position p runs
    token p + 1 with the target's state at p and learns the target's argmax at p + 1, on
    positions from the answer's start on."""
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        random.shuffle(groups)
    for group in groups:
        length = max(len(data[i][0]) for i in group) - 1
        aux = torch.zeros(len(group), length, data[group[0]][1].shape[-1])
        ids = torch.zeros(len(group), length, dtype=torch.long)
        labels = torch.full((len(group), length), -100, dtype=torch.long)
        for row, i in enumerate(group):
            seq, states, argmax, prompt_len = data[i]
            n = len(seq) - 1
            aux[row, :n], ids[row, :n] = states[:n].float(), seq[1:]
            target = draft_index[argmax[1:]]
            target[:max(prompt_len - 2, 0)] = -100
            labels[row, :n] = target
        yield aux, ids, labels


def run_epoch(head: Eagle3Draft, data: list[TargetData], draft_index: torch.Tensor,
              args: argparse.Namespace, optimizer: torch.optim.Optimizer | None) -> list[float]:
    """Trains (with an optimizer) or evaluates; returns each step's top-1 accuracy."""
    correct, total = torch.zeros(args.ttt_steps), torch.zeros(args.ttt_steps)
    for aux, ids, labels in batches(data, draft_index, args.batch_size, optimizer is not None):
        with torch.set_grad_enabled(optimizer is not None):
            loss = torch.zeros(())
            for step, normed in enumerate(head.rollout(aux, ids, args.ttt_steps)):
                step_labels = labels.clone()
                step_labels[:, :step] = -100   # no state to read there
                logits = head.lm_head(normed)
                loss = loss + 0.8 ** step * F.cross_entropy(logits.flatten(0, 1),
                                                            step_labels.flatten())
                valid = step_labels != -100
                correct[step] += (logits.argmax(-1) == step_labels)[valid].sum()
                total[step] += valid.sum()
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return (correct / total.clamp(min=1)).tolist()


def compare(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]]) -> None:
    """No speculation, n-gram, suffix and the head on the held-out chat prompts
    (benchmarks/spec_compare.py)."""
    from benchmarks.spec_compare import compare as compare_methods
    from services.common.speculative_config import SpeculativeConfig
    methods = {"none": None,
               "ngram": SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4),
               "suffix": SpeculativeConfig("suffix", 4),
               "eagle3": SpeculativeConfig("eagle3", args.num_speculative_tokens,
                                           model=str(args.out / "head"))}
    compare_methods(model_dir, methods, prompts, args.compare_prompts, args.max_new_tokens,
                    args.seed)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/eagle3-smollm2"))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-vocab-size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--ttt-steps", type=int, default=3, help="rollout steps trained")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per update")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="then serve held-out chat prompts with no speculation, n-gram, "
                             "suffix and the head (with --epochs 0: the head already written)")
    parser.add_argument("--compare-prompts", type=int, default=8,
                        help="prompts at concurrency 1 (twice as many at 8)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer   # slow: after --help

    from benchmarks.harness import print_preamble
    from services.common.model_files import resolve_model
    print_preamble()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model_dir = resolve_model("smollm2").hf_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = json.loads((model_dir / "config.json").read_text())
    aux_layer_ids = default_aux_layer_ids(config["num_hidden_layers"])
    train_prompts, eval_prompts = chat_prompts()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "chat_eval.jsonl", "w") as f:
        for prompt in eval_prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")

    eval_ids = [chat_ids(tokenizer, p) for p in eval_prompts]
    if not args.epochs:
        compare(args, model_dir, eval_ids)
        return
    started = time.perf_counter()
    cache = args.out / f"target_data-{args.max_new_tokens}.pt"
    if cache.exists():   # the target's part is deterministic: reuse it to train again
        data = torch.load(cache)
    else:
        prompt_ids = [chat_ids(tokenizer, p) for p in train_prompts + eval_prompts]
        answers = target_answers(model_dir, prompt_ids, args.max_new_tokens)
        print(f"target answers: {time.perf_counter() - started:.0f} s", flush=True)
        data = target_states(model, [(p + a, len(p)) for p, a in zip(prompt_ids, answers,
                                                                     strict=True)],
                             aux_layer_ids)
        torch.save(data, cache)
    train, held_out = data[:len(train_prompts)], data[len(train_prompts):]
    print(f"target data: {len(data)} answers, {sum(len(d[0]) for d in data)} tokens, "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    # The draft vocabulary: the labels the training answers use most.
    counts = torch.bincount(torch.cat([d[2][d[3] - 1:] for d in train]),
                            minlength=config["vocab_size"])
    draft_ids = counts.topk(args.draft_vocab_size).indices.sort().values
    draft_index = torch.full((config["vocab_size"],), -100, dtype=torch.long)
    draft_index[draft_ids] = torch.arange(len(draft_ids))
    print(f"draft vocabulary covers {counts[draft_ids].sum() / counts.sum():.1%} of labels")

    embed = model.get_input_embeddings().weight.detach()
    head = Eagle3Draft(config, draft_ids, embed, aux_layer_ids)
    with torch.no_grad():   # start from the target's output layer: its norm and lm_head rows
        head.norm.copy_(model.model.norm.weight)
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[draft_ids])
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    for epoch in range(args.epochs):
        for group in optimizer.param_groups:   # linear decay to a tenth
            group["lr"] = args.lr * (1 - 0.9 * epoch / max(args.epochs - 1, 1))
        train_acc = run_epoch(head, train, draft_index, args, optimizer)
        held_acc = run_epoch(head, held_out, draft_index, args, None)
        print(json.dumps({"epoch": epoch, "seconds": round(time.perf_counter() - started),
                          "train_acc_per_step": [round(a, 3) for a in train_acc],
                          "held_out_acc_per_step": [round(a, 3) for a in held_acc]}),
              flush=True)
    head.save(args.out / "head")
    print(f"wrote {args.out / 'head'} and {args.out / 'chat_eval.jsonl'}")
    if args.compare:
        compare(args, model_dir, eval_ids)


if __name__ == "__main__":
    main()

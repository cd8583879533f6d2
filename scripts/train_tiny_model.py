"""Build the arithmetic task's tokenizer and pre-train the tiny Llama models that ship with bubblespec.

    PYTHONPATH=. python scripts/train_tiny_model.py            # writes bubblespec/tasks/assets/tiny-arith
    PYTHONPATH=. python scripts/train_tiny_model.py --task collatz --steps 3000 --batch-size 16 \
        --label-smoothing 0.002 --threads 2                    # writes bubblespec/tasks/assets/tiny-collatz

Teacher forcing on reference responses (loss on response tokens and ``<eos>`` only, label-smoothed), AdamW,
about ten minutes on one CPU thread. Training is deliberately short: the model should solve only part of the
task, so that reinforcement learning has something to learn. Label smoothing (0.05) leaves the model less
sharp than it could be: its greedy answers (about 60% right on the held-out prompts) are better than its
temperature-1 samples (about 30%), which is the gap GRPO closes visibly in examples/arithmetic.yaml. The shipped
model is this script's output with its default flags; the run is meant to be a pure function of ``--seed`` and the
other flags (thread count included).
At the end it prints greedy and temperature-1 accuracy on 256 unseen prompts (``ArithmeticTask(seed=12345)``)
and the length distribution of the reference responses. Needs ``transformers`` (a dev dependency).

``--task collatz`` trains the model of the long-response task (``bubblespec/tasks/collatz.py``), whose responses
run to 4,000 tokens. Its step needs only the value before it, so an example is the prompt and a window of
``--window`` response tokens cut at a value boundary, with the position ids the window has in the whole response
(the model sees the prompt as far back as it will be when it generates there); the window's first value, whose
predecessor is cut off, carries no loss unless the window starts the response. Its label smoothing is small
(0.002): a response of hundreds of tokens needs a per-token error rate far below the arithmetic model's. Its score
is the task's reward (the share of the trajectory right from the start) and the share of whole trajectories right.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bubblespec.tasks import collatz
from bubblespec.tasks.arithmetic import (
    BOS_TOKEN,
    CONTEXT_LENGTH,
    EOS_TOKEN,
    MAX_DIGITS,
    PAD_TOKEN,
    UNK_TOKEN,
    ArithmeticTask,
    build_tokenizer,
    sample_operands,
)

IGNORE_INDEX = -100  # label of positions that carry no loss (prompt and padding)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["arithmetic", "collatz"], default="arithmetic")
    parser.add_argument("--out", type=Path, default=None, help="default: the task's shipped model folder")
    parser.add_argument("--window", type=int, default=256, help="collatz: response tokens per training example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps (the accuracy knob)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--eval-seed", type=int, default=12345)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--label-smoothing",
        type=float,
        default=0.05,
        help="label smoothing of the cross-entropy on response tokens (0 = plain cross-entropy); a smoothed model "
        "is less sharp, so its temperature-1 samples are worse than its greedy answers",
    )
    return parser.parse_args()


def context_length(task) -> int:
    return collatz.CONTEXT_LENGTH if isinstance(task, collatz.CollatzTask) else CONTEXT_LENGTH


def tiny_llama_config(task) -> LlamaConfig:
    """A ~0.8M-parameter Llama with grouped-query attention (4 query heads share 2 key-value heads)."""
    return LlamaConfig(
        vocab_size=task.vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        max_position_embeddings=context_length(task),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=task.bos_token_id,
        eos_token_id=task.eos_token_id,
        pad_token_id=task.pad_token_id,
    )


def training_batches(task, rng: random.Random, batch_size: int, window: int, batches_per_pool: int = 16):
    """Endless (input_ids_BT, attention_mask_BT, labels_BT, position_ids_BT or None) batches of fresh problems.

    Problems are drawn a pool at a time and sorted by length before batching, so that long-tailed lengths do
    not make every batch as long as its longest member.
    """
    while True:
        if isinstance(task, collatz.CollatzTask):
            numbers = [collatz.sample_number(rng, task.max_digits, task.max_response_tokens)
                       for _ in range(batch_size * batches_per_pool)]  # fmt: skip
            examples = sorted((collatz_window(task, n, rng, window) for n in numbers), key=_total_length)
        else:
            pool = [task.make_prompt(*sample_operands(rng), uid="train") for _ in range(batch_size * batches_per_pool)]
            examples = sorted(((p.token_ids, task.reference_response_ids(p)) for p in pool), key=_total_length)
        chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield collate(chunk, task.pad_token_id)


def collatz_window(task, n: int, rng: random.Random, window: int):
    """(prompt ids, window ids, the window's offset in the response, tokens of it without loss): a window of
    about ``window`` tokens of n's response, starting at a value boundary (at its start in one example of four)."""
    prompt = task.make_prompt(n, uid="train")
    response = task.reference_response_ids(prompt)
    comma = task.encode(",")[0]
    starts = [0] + [i + 1 for i, token in enumerate(response) if token == comma]
    start = 0 if rng.random() < 0.25 else rng.choice(starts)
    ends = [*starts[1:], len(response) - 1]  # where the value after each start begins, or the final <eos>
    unlabelled = 0 if start == 0 else next(end for end in ends if end > start) - start  # the value and its ","
    return prompt.token_ids, response[start : start + window], start, unlabelled


def _total_length(example) -> int:
    return len(example[0]) + len(example[1])


def collate(examples, pad_token_id: int):
    """Right-padded prompt + response sequences; labels only on the response (``<eos>`` included), but for a
    window's leading tokens without loss; position ids where a window sits in its response (else None)."""
    max_length = max(_total_length(e) for e in examples)
    input_ids_BT = torch.full((len(examples), max_length), pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(examples), max_length), dtype=torch.long)
    labels_BT = torch.full((len(examples), max_length), IGNORE_INDEX, dtype=torch.long)
    windowed = len(examples[0]) == 4
    position_ids_BT = torch.arange(max_length).repeat(len(examples), 1) if windowed else None
    for row, example in enumerate(examples):
        prompt_ids, response_ids = example[0], example[1]
        start, unlabelled = (example[2], example[3]) if windowed else (0, 0)
        sequence = [*prompt_ids, *response_ids]
        input_ids_BT[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask_BT[row, : len(sequence)] = 1
        labels_BT[row, len(prompt_ids) + unlabelled : len(sequence)] = torch.tensor(response_ids[unlabelled:])
        if windowed:
            position_ids_BT[row, len(prompt_ids) :] += start
    return input_ids_BT, attention_mask_BT, labels_BT, position_ids_BT


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, task, args: argparse.Namespace) -> None:
    """Teacher-forced pre-training on reference responses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    batches = training_batches(task, random.Random(f"train\x1f{args.seed}"), args.batch_size, args.window)
    model.train()
    start, running_loss = time.perf_counter(), 0.0
    for step in range(args.steps):
        input_ids_BT, attention_mask_BT, labels_BT, position_ids_BT = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        loss = training_loss(model, input_ids_BT, attention_mask_BT, labels_BT, args.label_smoothing, position_ids_BT)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running_loss += loss.item()
        if (step + 1) % 100 == 0:
            elapsed = time.perf_counter() - start
            print(
                f"step {step + 1:5d}  loss {running_loss / 100:.4f}  lr {learning_rate(step, args):.2e}  "
                f"{elapsed:6.0f}s",
                flush=True,
            )
            running_loss = 0.0
    model.eval()


def training_loss(
    model, input_ids_BT, attention_mask_BT, labels_BT, label_smoothing: float, position_ids_BT=None
) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) positions, optionally label-smoothed."""
    inputs = {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT, "position_ids": position_ids_BT}
    if label_smoothing == 0.0:  # the model's own loss
        return model(**inputs, labels=labels_BT).loss
    logits_BTV = model(**inputs).logits.float()
    return torch.nn.functional.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]),
        labels_BT[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
    )


@torch.no_grad()
def generate_responses(model, task, prompts, do_sample: bool, batch_size: int = 64):
    """Response ids (up to and including ``<eos>``) for each prompt, with ``model.generate``."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].token_ids))
    responses: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(order), batch_size):
        indices = order[first : first + batch_size]
        max_prompt = max(len(prompts[i].token_ids) for i in indices)
        input_ids_BT = torch.full((len(indices), max_prompt), task.pad_token_id, dtype=torch.long)
        attention_mask_BT = torch.zeros_like(input_ids_BT)
        for row, i in enumerate(indices):  # left padding, so every response starts at column max_prompt
            ids = prompts[i].token_ids
            input_ids_BT[row, max_prompt - len(ids) :] = torch.tensor(ids)
            attention_mask_BT[row, max_prompt - len(ids) :] = 1
        sampling = (
            {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
        )
        output_BT = model.generate(
            input_ids=input_ids_BT,
            attention_mask=attention_mask_BT,
            max_new_tokens=task.max_new_tokens,
            eos_token_id=task.eos_token_id,
            pad_token_id=task.pad_token_id,
            **sampling,
        )
        for row, i in enumerate(indices):
            responses[i] = _until_eos(output_BT[row, max_prompt:].tolist(), task.eos_token_id)
    return responses


def _until_eos(token_ids: list[int], eos_token_id: int) -> list[int]:
    return token_ids[: token_ids.index(eos_token_id) + 1] if eos_token_id in token_ids else token_ids


def report_accuracy(name: str, task, prompts, responses) -> None:
    """Mean reward, and by the number of digits of the problem (the longer operand's, or the Collatz number's);
    for Collatz also the share of whole trajectories right."""
    rewards = [task(p, r) for p, r in zip(prompts, responses, strict=True)]
    lengths = sorted(map(len, responses))
    exact = ""
    if isinstance(task, collatz.CollatzTask):
        exact = f", whole trajectory right {statistics.fmean(float(r == task.reference_response_ids(p)) for p, r in zip(prompts, responses, strict=True)):.3f}"  # noqa: E501
    print(
        f"{name}: {'reward' if exact else 'accuracy'} {statistics.fmean(rewards):.3f}{exact} on {len(prompts)} "
        f"prompts; response tokens median {statistics.median(lengths)}, max {lengths[-1]}"
    )
    if isinstance(task, collatz.CollatzTask):
        buckets = [(1, 2), (3, 4), (5, 6), (7, collatz.MAX_DIGITS)]
        digits = [len(p.text) - 1 for p in prompts]
    else:
        buckets = [(1, 3), (4, 6), (7, 10), (11, MAX_DIGITS)]
        digits = [max(len(operand) for operand in p.text.rstrip("=").split("+")) for p in prompts]
    by_bucket: dict[tuple[int, int], list[float]] = {bucket: [] for bucket in buckets}
    for num_digits, reward in zip(digits, rewards, strict=True):
        by_bucket[next(b for b in buckets if b[0] <= num_digits <= b[1])].append(reward)
    print(
        "  by digits: "
        + ", ".join(
            f"{low}-{high}: {statistics.fmean(rs):.2f} (n={len(rs)})" for (low, high), rs in by_bucket.items() if rs
        )
    )


def report_reference_lengths(task, num_prompts: int = 2000) -> None:
    """Length distribution (tokens, ``<eos>`` included) of reference responses of the evaluation source."""
    prompts = type(task)(seed=task.seed, prompts_per_step=num_prompts).batch(0)
    lengths = sorted(len(task.reference_response_ids(p)) for p in prompts)
    p95 = lengths[math.ceil(0.95 * len(lengths)) - 1]
    print(
        f"reference response tokens over {num_prompts} prompts: median {statistics.median(lengths)}, "
        f"p95 {p95}, max {lengths[-1]} (bound {task.max_new_tokens})"
    )


def save(model: LlamaForCausalLM, task, out: Path) -> None:
    """Model (float32 safetensors), generation config and a tokenizer loadable by ``tokenizers`` and
    ``transformers`` (4.x and 5.x)."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = task.bos_token_id
    model.generation_config.eos_token_id = task.eos_token_id
    model.generation_config.pad_token_id = task.pad_token_id
    model.generation_config.max_new_tokens = task.max_new_tokens
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only; it ships as package data
    add_top_level_rope_theta(out / "config.json")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), model_max_length=context_length(task), **special
    )
    hf_tokenizer.save_pretrained(out)
    # transformers 5 writes its own class name; the base fast-tokenizer class loads in both 4.x and 5.x.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")


def add_top_level_rope_theta(config_path: Path) -> None:
    """transformers 5 keeps ``rope_theta`` inside ``rope_parameters``; readers written for 4.x (and engines
    that read config.json by hand) look for it at the top level, so write it in both places."""
    config = json.loads(config_path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task_class = collatz.CollatzTask if args.task == "collatz" else ArithmeticTask
    task = task_class(seed=args.eval_seed, prompts_per_step=args.eval_prompts)
    out = args.out or task.model_path()
    model = LlamaForCausalLM(tiny_llama_config(task)).to(torch.float32)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    start = time.perf_counter()
    train(model, task, args)
    print(f"training took {time.perf_counter() - start:.0f}s", flush=True)
    save(model, task, out)
    print(f"saved to {out}")

    prompts = task.batch(0)  # the task with seed eval_seed: not the training stream
    report_accuracy("greedy", task, prompts, generate_responses(model, task, prompts, do_sample=False))
    torch.manual_seed(args.seed)
    report_accuracy("temperature 1.0", task, prompts, generate_responses(model, task, prompts, do_sample=True))
    report_reference_lengths(task)


if __name__ == "__main__":
    main()

"""Fits the ``cpu-tiny`` cost profile of the virtual clock (bubblespec/rollout/clocks.py) on this machine.

Times real forward passes of the built-in engine on the shipped model (1 torch thread) over a grid of batch
sizes, tokens per sequence and context lengths, and fits ``seconds = fixed + a * tokens + b * attention pairs``
by least squares; then times GRPO training steps and fits ``seconds = fixed + c * tokens``; then times keyed
sampling over rows x vocabulary sizes of 19 to 151,936 and fits ``seconds = overhead + d * sampled logits``.
Prints the constants to put in ``_cpu_tiny()`` and how well the fits explain the measurements. Last, it counts
the bytes that keyed sampling's tensor operations read and write per logit, the basis of the GPU profiles'
sampling term (each operation a pass over memory, as in eager execution).

    python benchmarks/calibrate_cpu.py [--sampling-only | --trees | --head | --head-check]

``--trees`` times token-tree passes (several candidates verified at once) of the collatz model against what the
profile charges them, without fitting anything: a check that trees are not cheaper in the model than on the CPU.

``--head`` times draft-head calls (:meth:`~bubblespec.models.draft_head.DraftHead.draft`, an untrained head over the
shipped model, keyed sampling as the torch engine draws) over 1-16 rows, 1-8 steps and 1-64 context pairs, and fits
the profile's head terms, ``seconds - sampling - attention = fixed * steps + a * tokens + b * context pairs`` (the
sampling term the profile's own, the attention term one of the model's layers'); ``--head-check`` times other calls
(the collatz model, given tokens, contexts past the window) against what ``CostProfile.head_seconds`` charges them,
without fitting anything. Both time a call by this process's CPU time; the figures in ``_cpu_tiny()`` were taken
beside another benchmark on the same 2 cores, so they are noisy (the fitted cost per token varied by 1.7x over six
runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.config import TrainerConfig
from bubblespec.core.interfaces import ForwardPass
from bubblespec.models.decoder import KVCache, TokenTree
from bubblespec.models.draft_head import DraftHead
from bubblespec.rl.learner import GRPOLearner, TrainSample
from bubblespec.rollout.clocks import PROFILES
from bubblespec.tasks import ArithmeticTask
from bubblespec.tasks.collatz import CollatzTask
from bubblespec.verify import sampling
from bubblespec.verify.tree import DraftTree


def time_forward(engine: TorchEngine, batch: int, tokens: int, context: int, repeats: int = 7) -> float:
    cache = KVCache(engine.model_config, batch, context + tokens, engine.model.dtype, "cpu")
    token_ids = torch.randint(3, engine.vocab_size, (batch, tokens))
    positions = (context + torch.arange(tokens)).repeat(batch, 1)
    select = torch.arange(tokens).repeat(batch, 1)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            engine.model.forward(token_ids, positions, cache, select)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_tree_forward(
    engine: TorchEngine, batch: int, candidates: int, length: int, context: int, repeats: int = 7
) -> tuple[float, int, int]:
    """A token-tree pass (the torch engine's ``_tree_step``): each row feeds its last token and ``candidates``
    branches of ``length`` tokens that part at the first token, after ``context`` cached positions. Returns the
    median seconds, the fed tokens and the attended (query, key) pairs, as the engine reports them."""
    draft = DraftTree.of([("c", [3 + c] + [3] * (length - 1)) for c in range(candidates)], candidates * length)
    fed = 1 + len(draft)
    cache = KVCache(engine.model_config, batch, context + fed, engine.model.dtype, "cpu")
    token_ids = torch.randint(3, engine.vocab_size, (batch, fed))
    positions = (context + torch.arange(fed)).repeat(batch, 1)
    depths = torch.tensor(draft.chunk_positions(1))
    tree = TokenTree((context + depths).repeat(batch, 1), draft.chunk_visible(1)[None].repeat(batch, 1, 1))
    select = torch.arange(fed).repeat(batch, 1)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            engine.model.forward(token_ids, positions, cache, select, tree)
            samples.append(time.perf_counter() - start)
    pairs = batch * draft.attention_pairs(1, context)
    return statistics.median(samples), batch * fed, pairs


def check_trees(profile_name: str = "cpu-tiny") -> None:
    """Token-tree passes timed against what the virtual clock charges them (its ``forward_seconds`` of the pass's
    tokens and attended pairs): trees of 1-64 tokens at contexts of 16-1,024, batches of 1 and 8."""
    profile = PROFILES[profile_name]
    engine = TorchEngine.from_pretrained(str(CollatzTask.model_path()))
    ratios = []
    print(f"trees against the {profile_name} profile: measured / charged")
    for batch in (1, 8):
        for candidates, length in ((1, 1), (1, 16), (4, 4), (4, 16)):
            for context in (16, 256, 1024):
                seconds, tokens, pairs = time_tree_forward(engine, batch, candidates, length, context)
                charged = profile.forward_seconds(ForwardPass(batch, tokens, batch * (context + tokens), pairs))
                ratios.append(seconds / charged)
                print(f"  batch {batch}, {candidates} x {length} tokens, context {context}: {seconds * 1e3:.2f} ms "
                      f"measured, {charged * 1e3:.2f} ms charged ({seconds / charged:.2f})")  # fmt: skip
    errors = [abs(r - 1) for r in ratios]
    print(f"  median relative error {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(ratios)} shapes")


def head_forward(rows: int, steps: int, context: int, vocab: int, window: int, given: int = 0) -> ForwardPass:
    """The head fields of a pass after one draft-head call (the rest 0): ``rows`` rows of ``context`` pairs each
    drafting ``steps`` tokens, the first ``given`` of them given in every row (no output head nor sampling in
    those steps)."""
    read = min(window, context)
    keys = sum(min(window, read + step) for step in range(steps))
    return ForwardPass(
        0, 0, 0, 0,
        head_steps=steps, head_tokens=rows * steps, head_context_pairs=rows * (read - 1),
        head_attention_pairs=rows * keys, head_sampled_logits=rows * vocab * (steps - given),
    )  # fmt: skip


def time_head_draft(
    head: DraftHead, vocab: int, rows: int, steps: int, context: int, given: int = 0, repeats: int = 11
) -> float:
    """Median seconds of one :meth:`DraftHead.draft` call over ``rows`` rows of ``context`` random pairs, each
    drafted token the keyed sample (temperature 1, no filters) of the head's logits. The seconds are this process's
    CPU time: on a shared machine a call longer than the scheduler's slice (a few ms) otherwise also waits for the
    other processes, which is not the call's cost."""
    generator = torch.Generator().manual_seed(rows * 1000 + steps * 100 + context)
    hidden_BTH = torch.randn(rows, context, head.config.hidden_size, generator=generator).to(head.dtype)
    tokens_BT = torch.randint(3, vocab, (rows, context), generator=generator)
    lengths_B = torch.full((rows,), context)
    first_positions_B = torch.randint(0, 4096, (rows,), generator=generator)
    seeds_B2 = torch.randint(0, 2**32, (rows, 2), generator=generator)
    params = (torch.ones(rows, dtype=torch.float64), torch.zeros(rows, dtype=torch.int64))
    params += (torch.ones(rows, dtype=torch.float64),)

    def sample(logits_B1V: torch.Tensor, positions_B1: torch.Tensor) -> torch.Tensor:
        return sampling.keyed_sample(logits_B1V.float(), seeds_B2, positions_B1, *params)[0]

    given_rows = [[3] * given for _ in range(rows)] if given else None
    head.draft(hidden_BTH, tokens_BT, lengths_B, first_positions_B, steps, sample, given=given_rows)  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        head.draft(hidden_BTH, tokens_BT, lengths_B, first_positions_B, steps, sample, given=given_rows)
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def calibrate_head(profile_name: str = "cpu-tiny", rounds: int = 5) -> None:
    """Fits the head terms of ``profile_name`` (linear: "flops" are seconds) to draft-head calls on the shipped
    model, each call's time the median over ``rounds`` rounds of the grid (another process's bursts pass). Subtracted
    before the fit: the profile's sampling term, and as the attention term one layer's share of the forward fit's
    per pair (too small at these windows to fit)."""
    profile = PROFILES[profile_name]
    engine = TorchEngine.from_pretrained(str(ArithmeticTask.model_path()))
    head = DraftHead(engine.model)
    per_pair = profile.attention_flops_per_pair / engine.model_config.num_layers
    shapes = [(r, s, c) for r in (1, 2, 4, 8, 16) for s in (1, 2, 4, 8) for c in (1, 8, 32, 64)]
    timings = [[time_head_draft(head, engine.vocab_size, *shape) for shape in shapes] for _ in range(rounds)]
    rows, targets, totals = [], [], []
    for shape, seconds in zip(shapes, zip(*timings, strict=True), strict=True):
        forward = head_forward(*shape, engine.vocab_size, head.window)
        total = statistics.median(seconds)
        rows.append([forward.head_steps, forward.head_tokens, forward.head_context_pairs])
        targets.append(
            total - profile.sampling_s_per_logit * forward.head_sampled_logits - per_pair * forward.head_attention_pairs
        )
        totals.append(total)
    # Relative errors matter (times span about 0.6 to 8 ms): each measurement weighted by 1 / its time.
    weighted = [[x / t for x in r] for r, t in zip(rows, totals, strict=True)]
    coefficients = fit(weighted, [t / total for t, total in zip(targets, totals, strict=True)])
    predicted = [sum(c * x for c, x in zip(coefficients, r, strict=True)) for r in rows]
    errors = [abs(p - t) / total for p, t, total in zip(predicted, targets, totals, strict=True)]
    fixed, per_token, per_context = coefficients
    print(f"head: head_fixed_s={fixed:.3e} head_flops_per_token={per_token:.3e} "
          f"head_flops_per_context_pair={per_context:.3e} head_attention_flops_per_pair={per_pair:.3e} "
          "(not fitted)")  # fmt: skip
    print(f"  median relative error {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(rows)} calls")


def check_head(profile_name: str = "cpu-tiny", rounds: int = 3) -> None:
    """Draft-head calls timed against what the virtual clock charges them (``CostProfile.head_seconds``): the
    collatz model, 2-12 rows, 3-6 steps, some of them given, contexts of 16-200 pairs (past the window); each
    call's time the median of ``rounds`` timings."""
    profile = PROFILES[profile_name]
    engine = TorchEngine.from_pretrained(str(CollatzTask.model_path()))
    head = DraftHead(engine.model, seed=1)
    ratios = []
    print(f"head calls against the {profile_name} profile: measured / charged")
    for num_rows in (2, 12):
        for steps, given in ((3, 0), (6, 0), (6, 2)):
            for context in (16, 200):
                shape = (num_rows, steps, context, given)
                seconds = statistics.median(time_head_draft(head, engine.vocab_size, *shape) for _ in range(rounds))
                forward = head_forward(num_rows, steps, context, engine.vocab_size, head.window, given)
                charged = profile.head_seconds(forward)
                ratios.append(seconds / charged)
                print(f"  {num_rows} rows, {steps} steps ({given} given), context {context}: {seconds * 1e3:.2f} ms "
                      f"measured, {charged * 1e3:.2f} ms charged ({seconds / charged:.2f})")  # fmt: skip
    errors = [abs(r - 1) for r in ratios]
    print(f"  median relative error {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(ratios)} calls")


def fit(rows: list[list[float]], targets: list[float]) -> list[float]:
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64))
    return solution.solution.flatten().tolist()


def time_keyed_sample(num_rows: int, vocab: int, repeats: int = 5) -> float:
    generator = torch.Generator().manual_seed(num_rows * vocab)
    logits = torch.randn(num_rows, 1, vocab, generator=generator) * 3
    seeds = torch.randint(0, 2**32, (num_rows, 2), generator=generator)
    positions = torch.randint(0, 4096, (num_rows, 1), generator=generator)
    params = (torch.ones(num_rows, dtype=torch.float64), torch.zeros(num_rows, dtype=torch.int64))
    params += (torch.ones(num_rows, dtype=torch.float64),)
    sampling.keyed_sample(logits, seeds, positions, *params)  # warm-up: hashed token ids are cached per vocabulary
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampling.keyed_sample(logits, seeds, positions, *params)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def calibrate_sampling() -> None:
    rows, targets = [], []
    for vocab in (19, 4096, 32000, 151936):
        for num_rows in (1, 16, 64, 272):
            rows.append([1.0, num_rows * vocab])
            targets.append(time_keyed_sample(num_rows, vocab))
    # Relative errors matter (times span 1 ms to 1 s): each measurement weighted by 1 / its time.
    overhead, per_logit = fit([[x / t for x in r] for r, t in zip(rows, targets, strict=True)], [1.0] * len(rows))
    errors = [abs(overhead + per_logit * r[1] - t) / t for r, t in zip(rows, targets, strict=True)]
    print(f"sampling: sampling_s_per_logit={per_logit:.3e} (per-call overhead {overhead:.3e} s)")
    print(f"  median relative error {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(rows)} shapes")


class _BytesMoved(TorchDispatchMode):
    """Sums the bytes of every tensor an operation reads (its tensor arguments) and writes (its results)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not func.is_view:
            leaves = [*torch.utils._pytree.tree_leaves((args, kwargs)), *torch.utils._pytree.tree_leaves(result)]
            self.bytes += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return result


def sampling_bytes_per_logit(vocab: int = 151936, num_rows: int = 16) -> float:
    """Bytes read and written by keyed sampling's operations per logit, float32 logits, T = 1, no filters."""
    logits = torch.randn(num_rows, 1, vocab) * 3
    seeds, positions = torch.randint(0, 2**32, (num_rows, 2)), torch.zeros(num_rows, 1, dtype=torch.int64)
    params = (torch.ones(num_rows, dtype=torch.float64), torch.zeros(num_rows, dtype=torch.int64))
    params += (torch.ones(num_rows, dtype=torch.float64),)
    sampling.keyed_sample(logits, seeds, positions, *params)  # the hashed token ids are cached, as in a run
    with _BytesMoved() as counter:
        sampling.keyed_sample(logits, seeds, positions, *params)
    return counter.bytes / logits.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description="Fits the cpu-tiny cost profile of the virtual clock.")
    parser.add_argument("--sampling-only", action="store_true", help="only the sampling term and its byte count")
    parser.add_argument("--trees", action="store_true", help="only token-tree passes against the cpu-tiny profile")
    parser.add_argument("--head", action="store_true", help="only the draft head's terms")
    parser.add_argument("--head-check", action="store_true", help="only draft-head calls against the cpu-tiny profile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trees:
        check_trees()
        return
    if args.head:
        calibrate_head()
        return
    if args.head_check:
        check_head()
        return
    calibrate_sampling()
    print(f"sampling: {sampling_bytes_per_logit():.0f} bytes read and written per logit (V = 151936)")
    if args.sampling_only:
        return
    engine = TorchEngine.from_pretrained(str(ArithmeticTask.model_path()))
    rows, targets = [], []
    for batch in (1, 4, 16, 64):
        for tokens in (1, 8, 17, 33):
            for context in (16, 64, 160):
                seconds = time_forward(engine, batch, tokens, context)
                pairs = batch * (tokens * context + tokens * (tokens + 1) // 2)
                rows.append([1.0, batch * tokens, pairs])
                targets.append(seconds)
    fixed, per_token, per_pair = fit(rows, targets)
    predicted = [fixed + per_token * r[1] + per_pair * r[2] for r in rows]
    errors = [abs(p - t) / t for p, t in zip(predicted, targets, strict=True)]
    print(f"forward: fixed_s={fixed:.3e} flops_per_token={per_token:.3e} attention_flops_per_pair={per_pair:.3e}")
    print(f"  median relative error {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(rows)} shapes")

    task = ArithmeticTask(seed=0, prompts_per_step=64)
    learner = GRPOLearner(str(ArithmeticTask.model_path()), "float32", TrainerConfig(), temperature=1.0)
    train_rows, train_targets = [], []
    for num_prompts in (4, 16, 32, 64):
        samples = [
            TrainSample(p.token_ids, tuple(task.reference_response_ids(p)), i // 2, float(i % 2))
            for i, p in enumerate(task.batch(0)[:num_prompts])
        ]
        start = time.perf_counter()
        metrics = learner.step(samples)
        train_rows.append([1.0, metrics["trained_tokens"]])
        train_targets.append(time.perf_counter() - start)
    train_fixed, train_per_token = fit(train_rows, train_targets)
    print(f"train: train_fixed_s={train_fixed:.3e} train_flops_per_token={train_per_token:.3e}")


if __name__ == "__main__":
    main()

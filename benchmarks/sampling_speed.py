"""Times keyed sampling against plain sampling (float32 ``torch.softmax`` + ``torch.multinomial``) on the same logits.

Logits are float32, Gaussian with standard deviation ``--logit-scale`` (a spread of about 25 nats between the
best token and the bulk at the default, as for LLM logits at T = 1). Cases, each timed side by side with the
baseline (alternating, median of ``--repeats``):

- ``decode``: one position per row, T = 1, no filters (the target: ratio <= 1.5).
- ``decode_filtered``: T = 0.7, top-k 50, top-p 0.9 (the baseline samples softmax(z / T) without filters).
- ``decode_top_p``: T = 1, top-p 0.95 only.
- ``decode_greedy``: T = 0 (the baseline is ``torch.argmax``).
- ``verify``: ``--positions`` positions per row (draft tokens + bonus), T = 1.

Prints one JSON object: milliseconds per call and the ratio keyed / baseline for each case.

    python benchmarks/sampling_speed.py --threads 1 --vocab 151936 --batch 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from bubblespec.verify import sampling


def _time_pair(keyed: Callable[[], object], baseline: Callable[[], object], repeats: int) -> dict[str, float]:
    keyed(), baseline()  # warm-up: caches of hashed token ids, allocator
    keyed_s, baseline_s = [], []
    for _ in range(repeats):
        for function, samples in ((keyed, keyed_s), (baseline, baseline_s)):
            start = time.perf_counter()
            function()
            samples.append(time.perf_counter() - start)
    keyed_ms, baseline_ms = 1e3 * statistics.median(keyed_s), 1e3 * statistics.median(baseline_s)
    return {
        "keyed_ms": round(keyed_ms, 3),
        "baseline_ms": round(baseline_ms, 3),
        "ratio": round(keyed_ms / baseline_ms, 3),
    }


def _case(args, num_positions: int, temperature: float, top_k: int, top_p: float) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    batch, vocab = args.batch, args.vocab
    logits_BTV = torch.randn(batch, num_positions, vocab, generator=generator) * args.logit_scale
    seeds_B2 = torch.randint(0, 2**32, (batch, 2), generator=generator)
    positions_BT = torch.randint(0, 4096, (batch, 1), generator=generator) + torch.arange(num_positions)
    params = (
        torch.full((batch,), temperature, dtype=torch.float64),
        torch.full((batch,), top_k, dtype=torch.int64),
        torch.full((batch,), top_p, dtype=torch.float64),
    )
    logits_RV = logits_BTV.reshape(batch * num_positions, vocab)

    def keyed():
        return sampling.keyed_sample(logits_BTV, seeds_B2, positions_BT, *params)

    def baseline():
        if temperature == 0:
            return logits_RV.argmax(-1)
        return torch.multinomial(torch.softmax(logits_RV / temperature, dim=-1), 1)

    return _time_pair(keyed, baseline, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--positions", type=int, default=17, help="positions per row in the verify case")
    parser.add_argument("--logit-scale", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = {
        "decode": (1, 1.0, 0, 1.0),
        "decode_filtered": (1, 0.7, 50, 0.9),
        "decode_top_p": (1, 1.0, 0, 0.95),
        "decode_greedy": (1, 0.0, 0, 1.0),
        "verify": (args.positions, 1.0, 0, 1.0),
    }
    report = {"threads": args.threads, "vocab": args.vocab, "batch": args.batch, "positions": args.positions}
    report |= {name: _case(args, *shape) for name, shape in cases.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

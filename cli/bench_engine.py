"""``bubblespec bench engine``: engine backends measured side by side in one run, on the same requests and drafts.

(a) Hugging Face ``generate()`` against each engine without drafts, tokens/s.
(b) Each engine verifying coupled drafts from one policy step older against the same engine without drafts:
    tokens/s, forward passes (engine steps), decode steps, acceptance length, whether the outputs are identical,
    and how far decode steps with fully accepted drafts are from ceil(L / K) per response.
(c) The exactness table: per backend and dtype (torch: float64, float32, bfloat16; vLLM: float32, bfloat16), the
    share of responses that differ with drafts and without, next to the share that differ between two plain runs
    whose batches differ (another order, half the batch size): the engine's own nondeterminism.
(d) Keyed sampling's share of a decode forward pass at the model's vocabulary.
(e) With ``--vllm-ngram``: vLLM's own n-gram speculative decoding and vLLM on its own sampler without drafts, timed in
    the same interleaving beside the vllm backend's rows (:mod:`bubblespec.cli.bench_engine_ngram`).
(f) With ``--config``: where pi_t+1's responses left pi_t's drafts and what draft tries win back
    (:mod:`bubblespec.cli.bench_engine_tries`), and a draft head learned from pi_t's samples of the policy step
    drafting for pi_t+1 alone and after pi_t's drafts (:mod:`bubblespec.cli.bench_engine_head`).

``--backend torch,vllm`` runs several backends; every backend gets the same requests and the same drafts and
reports the same fields. ``--config CONFIG`` takes the model, the prompts and the sampling from a run config, and
pi_t+1 from one real GRPO step of its trainer on pi_t's own samples and rewards. The requests, the policy step
between the drafting policy pi_t and the verifying policy pi_t+1, and HF ``generate`` are described in
:mod:`bubblespec.cli.bench_engine_requests`; the exactness table and the sampling share in
:mod:`bubblespec.cli.bench_engine_measures`. Drafts are pi_t's keyed samples for exactly
the keys pi_t+1 then generates, as bubble drafting produces them; they come from the torch engine whatever the
backend (keyed sampling picks the same tokens on every backend).

All timings of one batch size run in the same process, interleaved (HF, then each backend without and with
drafts, repeated), with the median of ``repeats`` reported: the ratios are what to read, absolute numbers depend
on the machine and its load.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bubblespec.cli import bench_engine_head as head
from bubblespec.cli import bench_engine_ngram as ngram
from bubblespec.cli import bench_engine_tries as tries
from bubblespec.cli.bench_engine_measures import (
    exactness_summary,
    exactness_table,
    keyed_sampling_share,
    make_engine,
    synchronize,
)
from bubblespec.cli.bench_engine_requests import (
    RANDOM_MAX_NEW_TOKENS,
    RANDOM_PROMPT_LENGTHS,
    ConfigRun,
    Workload,
    config_workload,
    grpo_step,
    hf_generate,
    hf_model,
    perturbation,
    random_workload,
    shipped_config,
    task_workload,
    with_drafts,
)
from bubblespec.cli.bench_tables import print_tables, table
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import GenerationRequest, GenerationResult, acceptance_length

TRIES_BRANCHES_PER_DRAFT = 2
"""Branches drafted per draft (its smallest near-ties) for ``--config``'s decode steps with branches."""

DTYPES_BY_BACKEND = {"torch": ("float32", "bfloat16", "float64"), "vllm": ("float32", "bfloat16")}
"""The backends this benchmark runs and the engine dtypes each offers."""


@dataclass(frozen=True)
class EngineBenchSettings:
    backends: tuple[str, ...] = ("torch",)
    """The engine backends to measure side by side (``--backend torch,vllm``)."""
    model_path: str | None = None
    """A Hugging Face model folder; None: the shipped model on the arithmetic task's prompts (or the config's)."""
    config_path: str | None = None
    """A run config (``--config``): its model, its task's prompts and sampling, and one GRPO step of its trainer
    from pi_t to pi_t+1 (:func:`~bubblespec.cli.bench_engine_requests.grpo_step`)."""
    overrides: tuple[str, ...] = ()
    """``--set`` overrides of the run config."""
    dtype: str = "float32"
    device: str = "cpu"
    """Device of the torch engine, HF generate and drafting; vLLM runs where its build runs."""
    threads: int = 1
    repeats: int = 3
    quick: bool = False
    """A smoke run: batch sizes 1 and 16, one repetition, one request at batch 1; shorter responses and fewer
    exactness requests on a model folder."""
    batch_sizes: tuple[int, ...] = (1, 16, 32)
    max_new_tokens: int = RANDOM_MAX_NEW_TOKENS
    """Response limit on a model folder (the shipped model uses its task's)."""
    prompt_lengths: tuple[int, int] = RANDOM_PROMPT_LENGTHS
    weight_noise: float = 1e-3
    """Relative RMS change of every weight tensor from pi_t to pi_t+1 on a model folder."""
    learning_rate: float = 1e-4
    """Learning rate of the policy step on the shipped model (one step of the run's own GRPO learner)."""
    policy_step_prompts: int = 16
    policy_step_samples: int = 4
    max_draft_tokens_per_step: int = 16
    adaptive_draft_length: bool = True
    """Each engine's ``adaptive_draft_length``: on, as the CPU examples run (a verify pass costs in proportion to
    its tokens on a CPU, so drafts that diverge must shrink)."""
    min_requests: int = 8
    """Requests per row at least: batch size 1 runs this many one at a time (one response is too noisy)."""
    exactness_requests: int | None = None
    """Requests of the exactness table (0: no table); None: 64 on the shipped model, 16 on a model folder."""
    exactness_dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16")
    """The torch engine's dtypes in the exactness table."""
    hf_batch_sizes: tuple[int, ...] | None = None
    """Batch sizes at which HF generate runs; None: every batch size on the shipped model, 16 on a model folder."""
    head_training_steps: int = head.TRAINING_STEPS
    """With ``--config``: AdamW steps of the draft head learned from pi_t's samples of the policy step
    (:mod:`bubblespec.cli.bench_engine_head`; 0: an untrained head)."""
    vllm_ngram: bool = False
    """Also time vLLM's own n-gram drafts (prompt lookup) and vLLM without drafts on its own sampler, beside the vllm
    backend's rows (:mod:`bubblespec.cli.bench_engine_ngram`); needs ``vllm`` among the backends."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("name at least one backend: " + ", ".join(DTYPES_BY_BACKEND))
        for backend in self.backends:
            if backend not in DTYPES_BY_BACKEND:
                raise ConfigError(
                    f"backend {backend!r} is not benchmarked; choose one of {', '.join(DTYPES_BY_BACKEND)}"
                )
            if self.dtype not in DTYPES_BY_BACKEND[backend]:
                choices = ", ".join(DTYPES_BY_BACKEND[backend])
                raise ConfigError(
                    f"dtype {self.dtype!r} is not offered by the {backend} engine; choose one of {choices}"
                )
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError(f"backends {list(self.backends)} name one twice")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ConfigError(f"--model {self.model_path!r} is not a Hugging Face model folder (no config.json there)")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"batch sizes must be integers >= 1, got {list(self.batch_sizes)}")
        low, high = self.prompt_lengths
        if not 1 <= low <= high:
            raise ConfigError(f"prompt lengths must satisfy 1 <= low <= high, got {self.prompt_lengths}")
        for name in ("max_new_tokens", "repeats", "threads", "max_draft_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.head_training_steps < 0:
            raise ConfigError(f"head training steps must be >= 0, got {self.head_training_steps!r}")
        if self.weight_noise < 0:
            raise ConfigError(f"weight noise must be >= 0, got {self.weight_noise!r}")
        if self.config_path is None and self.overrides:
            raise ConfigError("--set overrides a run config: give one with --config")
        if self.vllm_ngram and "vllm" not in self.backends:
            raise ConfigError(
                f"--vllm-ngram times vLLM's own n-gram drafts beside the vllm backend, and --backend "
                f"{','.join(self.backends)} has no vllm: add it (--backend vllm or torch,vllm), or leave out "
                "--vllm-ngram"
            )

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes)

    @property
    def max_model_len(self) -> int | None:
        """vLLM's context length on a model folder: the longest prompt, response and draft chunk fit."""
        if self.model_path is None:
            return None
        return self.prompt_lengths[1] + self.max_new_tokens + self.max_draft_tokens_per_step + 64


def parse_backends(text: str) -> tuple[str, ...]:
    """``"torch,vllm"`` -> ``("torch", "vllm")`` (checked by :class:`EngineBenchSettings`)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"1,16,32"`` -> ``(1, 16, 32)``; anything else is a :class:`ConfigError` quoting it."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--batch-sizes {text!r} is not a comma-separated list of integers, e.g. 1,16,32") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--batch-sizes {text!r}: every batch size must be >= 1")
    return sizes


def resolve(settings: EngineBenchSettings) -> EngineBenchSettings:
    """Fills the defaults that depend on the model (and on ``quick``)."""
    folder = settings.model_path is not None
    if settings.quick:
        settings = replace(settings, batch_sizes=(1, 16), repeats=1, min_requests=1)
        if folder:
            settings = replace(settings, max_new_tokens=min(settings.max_new_tokens, 16))
    if settings.exactness_requests is None:
        settings = replace(settings, exactness_requests=(8 if settings.quick else 16) if folder else 64)
    if settings.hf_batch_sizes is None:
        settings = replace(settings, hf_batch_sizes=(16,) if folder else settings.batch_sizes)
    return replace(settings, model_path=settings.model_path or str(_shipped_model_path()))


def run_engine_bench(settings: EngineBenchSettings) -> dict:
    config = _run_config(settings)
    run = None if config is None else ConfigRun.of(config)  # the config's task, built once
    try:
        return _run_engine_bench(settings, run)
    finally:
        if run is not None:
            run.close()


def _run_engine_bench(settings: EngineBenchSettings, run: ConfigRun | None) -> dict:
    shipped = settings.model_path is None and run is None
    if run is not None:  # the config's model, as a folder
        settings = replace(settings, model_path=run.model_path)
    settings = resolve(settings)
    torch.set_num_threads(settings.threads)
    num_timed = max(settings.max_batch_size, settings.min_requests)
    workload = _workload(settings, shipped, run, max(num_timed, settings.exactness_requests))
    if run is not None:  # vLLM's context: the config's prompts and response limit
        lengths = [len(r.prompt_token_ids) for r in workload.requests]
        response = workload.requests[0].sampling.max_new_tokens
        settings = replace(settings, prompt_lengths=(min(lengths), max(lengths)), max_new_tokens=response)
    timed = workload.requests[:num_timed]
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    engines, new_state, drafts, report = _engines_and_drafts(settings, shipped, run, workload, timed)
    seconds["policies, drafts and sampling share"] = time.perf_counter() - clock
    baselines = None
    if settings.vllm_ngram:
        clock = time.perf_counter()
        baselines = ngram.start_baselines(settings, timed, new_state)
        report["vllm_ngram"] = ngram.empty_report()
        seconds["vLLM n-gram and plain engines"] = time.perf_counter() - clock

    hf = hf_model(settings.model_path, settings.dtype, settings.device, new_state) if settings.hf_batch_sizes else None
    drafted = with_drafts(timed, drafts)
    for batch_size in settings.batch_sizes:
        clock = time.perf_counter()
        count = max(batch_size, settings.min_requests)
        results = _measure_row(
            report, engines, hf, workload, timed[:count], drafted[:count], batch_size, settings, baselines
        )
        seconds[f"batch {batch_size}"] = time.perf_counter() - clock
    del hf
    for backend, (plain, speculative) in results.items():
        report["backends"][backend] |= _draft_summary(plain, speculative, settings.max_draft_tokens_per_step)
    clock = time.perf_counter()
    exactness_requests = workload.requests[: settings.exactness_requests]
    table = exactness_table(settings, engines, new_state, exactness_requests) if exactness_requests else {}
    report["exactness"] = table
    report |= exactness_summary(report["exactness"])
    seconds["exactness"] = time.perf_counter() - clock
    report["draft_tries"] = report["draft_head"] = None
    if run is not None:  # where a real policy step left the drafts, and what draft tries win back
        clock = time.perf_counter()
        report["draft_tries"] = _draft_tries(settings, new_state, timed[: settings.max_batch_size])
        seconds["draft tries"] = time.perf_counter() - clock
        clock = time.perf_counter()  # a head learned from pi_t's samples, drafting for pi_t+1
        report["draft_head"] = head.measure_config_step(settings, run, new_state, timed[: settings.max_batch_size])
        seconds["draft head"] = time.perf_counter() - clock
    report["benchmark_seconds"] = seconds
    return report


def _draft_tries(settings: EngineBenchSettings, new_state: dict, requests: list) -> dict:
    """:mod:`bubblespec.cli.bench_engine_tries` on the torch engine: pi_t teacher-forced along pi_t+1's responses,
    and pi_t's drafts verified with and without a round of branches."""
    older = make_engine("torch", settings.model_path, settings.dtype, settings)  # pi_t
    newer = make_engine("torch", settings.model_path, settings.dtype, settings)
    newer.update_weights(new_state, version=1)  # pi_t+1
    try:
        found = tries.divergences(older, requests, newer.generate(requests))
        return {
            "requests": len(requests),
            "divergences": tries.divergence_summary(found),
            "branches": tries.decode_steps_with_branches(older, newer, requests, TRIES_BRANCHES_PER_DRAFT),
        }
    finally:
        older.close()
        newer.close()


def _engines_and_drafts(settings: EngineBenchSettings, shipped: bool, run, workload: Workload, timed: list):
    """An engine of each backend holding pi_t+1, pi_t+1's weights, pi_t's responses to the timed requests (the
    drafts) and the report so far (settings, workload, policy update, keyed sampling's share)."""
    drafter = make_engine("torch", settings.model_path, settings.dtype, settings)  # pi_t
    new_state, policy_update = _next_policy(settings, shipped, run, drafter)
    drafts = drafter.generate(timed)
    report = _empty_report(settings, workload, policy_update)
    share_batch = 16 if 16 in settings.batch_sizes else settings.max_batch_size
    pairs = zip(timed, drafts, strict=True)
    context = round(statistics.mean(len(r.prompt_token_ids) + len(d.token_ids) // 2 for r, d in pairs))
    report["keyed_sampling"] = keyed_sampling_share(drafter.model, share_batch, context, max(settings.repeats, 3))
    engines = {}
    for backend in settings.backends:
        if backend == "torch" and "torch" not in engines:
            engines["torch"], drafter = drafter, None
        else:
            engines[backend] = make_engine(backend, settings.model_path, settings.dtype, settings)
        engines[backend].update_weights(new_state, version=1)  # pi_t+1
    del drafter
    return engines, new_state, drafts, report


def _run_config(settings: EngineBenchSettings):
    """The run config of ``--config`` with its overrides, or None."""
    if settings.config_path is None:
        return None
    from bubblespec.core.config import load_config

    if settings.model_path is not None:
        raise ConfigError("--config names the model (model.path, or the task's own); leave out --model")
    return load_config(Path(settings.config_path), list(settings.overrides))


def _workload(settings: EngineBenchSettings, shipped: bool, run: ConfigRun | None, num_requests: int) -> Workload:
    if run is not None:
        return config_workload(run, num_requests)
    if shipped:
        return task_workload(num_requests, settings.seed)
    return random_workload(
        settings.model_path, num_requests, settings.prompt_lengths, settings.max_new_tokens, settings.seed
    )


def _next_policy(settings: EngineBenchSettings, shipped: bool, run: ConfigRun | None, drafter) -> tuple[dict, dict]:
    """pi_t+1's weights (float32, Hugging Face names) and how they were made."""
    if run is not None:
        return grpo_step(run, drafter)
    if shipped:
        prompts, samples = settings.policy_step_prompts, settings.policy_step_samples
        shipped_run = ConfigRun.of(shipped_config(settings.seed, prompts, samples, settings.learning_rate))
        try:
            return grpo_step(shipped_run, drafter)
        finally:
            shipped_run.close()
    from bubblespec.models.decoder import read_checkpoint

    _, weights = read_checkpoint(settings.model_path)
    return perturbation(weights, settings.weight_noise, settings.seed)


def _empty_report(settings: EngineBenchSettings, workload: Workload, policy_update: dict) -> dict:
    fields = {**settings.__dict__, "backends": list(settings.backends), "batch_sizes": list(settings.batch_sizes)}
    fields["hf_batch_sizes"] = list(settings.hf_batch_sizes)
    fields["prompt_lengths"] = list(settings.prompt_lengths)
    fields["exactness_dtypes"] = list(settings.exactness_dtypes)
    report: dict = {"settings": fields, "workload": workload.description, "policy_update": policy_update}
    report["hf_generate_tokens_per_s"] = {}
    report["backends"] = {backend: {name: {} for name in ROW_FIELDS} for backend in settings.backends}
    report["vllm_ngram"] = None  # filled with --vllm-ngram
    return report


ROW_FIELDS = (
    "num_requests",
    "engine_tokens_per_s",
    "engine_vs_hf_generate",
    "engine_tokens_per_s_with_draft",
    "speedup_with_draft",
    "forward_passes_no_draft",
    "forward_passes_with_draft",
    "identical_outputs",
)
"""Each backend's fields by batch size (``engine_vs_hf_generate`` only at ``hf_batch_sizes``)."""


def _measure_row(report, engines, hf, workload, plain, drafted, batch_size, settings, baselines=None) -> dict:
    """Times one batch size, interleaved, and fills its entries of ``report``; returns each backend's results
    without and with drafts (of the last repetition). ``baselines``: vLLM's own n-gram and plain engines, timed in
    the same interleaving (``--vllm-ngram``)."""
    runs: dict = {}
    if hf is not None and batch_size in settings.hf_batch_sizes:
        runs["hf"] = lambda: hf_generate(hf, workload, plain, batch_size)
    for backend, engine in engines.items():
        runs[backend] = _EngineRun(engine, plain, batch_size)
        runs[f"{backend}+draft"] = _EngineRun(engine, drafted, batch_size)
    for name in ngram.RUNS if baselines is not None else ():
        runs[name] = baselines.run(name, plain, batch_size)
    rates = _interleaved_rates(runs, settings.repeats, settings.device)
    key = str(batch_size)
    if "hf" in rates:
        report["hf_generate_tokens_per_s"][key] = rates["hf"]
    results = {}
    for backend in engines:
        row, plain_run, draft_run = report["backends"][backend], runs[backend], runs[f"{backend}+draft"]
        row["num_requests"][key] = len(plain)
        if "hf" in rates:
            row["engine_vs_hf_generate"][key] = rates[backend] / rates["hf"]
        row["engine_tokens_per_s"][key] = rates[backend]
        row["engine_tokens_per_s_with_draft"][key] = rates[f"{backend}+draft"]
        row["speedup_with_draft"][key] = rates[f"{backend}+draft"] / rates[backend]
        row["forward_passes_no_draft"][key] = plain_run.forward_passes
        row["forward_passes_with_draft"][key] = draft_run.forward_passes
        row["identical_outputs"][key] = _token_ids(plain_run.results) == _token_ids(draft_run.results)
        results[backend] = (plain_run.results, draft_run.results)
    if baselines is not None:
        vllm_row = report["backends"]["vllm"]
        ngram.fill_row(report["vllm_ngram"], key, rates, runs, rates["vllm"], vllm_row["speedup_with_draft"][key])
        report["vllm_ngram"]["summary"] = ngram.summary(runs["vllm-ngram"])  # the last batch size's stays
    return results


def _token_ids(results: list[GenerationResult]) -> list[list[int]]:
    return [list(r.token_ids) for r in results]


class _EngineRun:
    """``engine.generate`` on the requests in batches of ``batch_size``; keeps the last call's results and forward
    passes; returns the tokens generated."""

    def __init__(self, engine, requests: list[GenerationRequest], batch_size: int) -> None:
        self.engine, self.requests, self.batch_size = engine, requests, batch_size
        self.results: list[GenerationResult] = []
        self.forward_passes = 0

    def __call__(self) -> int:
        before = self.engine.num_forward_passes
        self.results = []
        for start in range(0, len(self.requests), self.batch_size):
            self.results += self.engine.generate(self.requests[start : start + self.batch_size])
        self.forward_passes = self.engine.num_forward_passes - before
        return sum(len(r.token_ids) for r in self.results)


def _interleaved_rates(runs: dict, repeats: int, device: str) -> dict[str, float]:
    """Median tokens/s of each run (a callable returning the tokens it generated), the runs interleaved."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run()
            synchronize(device)
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def _draft_summary(plain: list[GenerationResult], speculative: list[GenerationResult], per_step: int) -> dict:
    """Decode steps, acceptance and identity over the largest batch size's requests. ``steps_over_ceil_l_over_k``:
    of the responses whose every proposed draft token was accepted, the most decode steps beyond ceil(L / K)."""
    steps_plain = sum(r.stats.decode_steps for r in plain)
    steps_draft = sum(r.stats.decode_steps for r in speculative)
    verify_steps = sum(r.stats.verify_steps for r in speculative)
    accepted = sum(r.stats.draft_tokens_accepted for r in speculative)
    proposed = sum(r.stats.draft_tokens_proposed for r in speculative)
    fully_accepted = [
        r
        for r in speculative
        if r.stats.verify_steps and r.stats.draft_tokens_proposed == r.stats.draft_tokens_accepted
    ]
    return {
        "decode_steps_no_draft": steps_plain,
        "decode_steps_with_draft": steps_draft,
        "decode_step_reduction": 1 - steps_draft / max(steps_plain, 1),
        "acceptance_length_mean": acceptance_length(accepted, verify_steps),
        "draft_acceptance_rate": accepted / max(proposed, 1),
        "undecided_steps": sum(r.stats.undecided_steps for r in speculative),
        "identical_with_and_without_draft": _token_ids(plain) == _token_ids(speculative),
        "fully_accepted_responses": len(fully_accepted),
        "steps_over_ceil_l_over_k": max(
            (r.stats.decode_steps - -(-len(r.token_ids) // per_step) for r in fully_accepted), default=None
        ),
    }


def _shipped_model_path() -> Path:
    from bubblespec.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask.model_path()


def print_report(report: dict, console=None) -> None:
    """The speed tables (without, then with drafts), the drafts, exactness and keyed sampling; each table fits
    80 columns."""
    settings = report["settings"]
    title = f"Engine speed: {settings['dtype']}, {Path(settings['model_path']).name}"
    speed = table(title, ("backend", "batch", "HF generate tok/s", "engine tok/s", "engine / HF"), justify="left")
    with_drafts = table("Engine speed with drafts from one policy step older", ("backend", "batch", "tok/s",
                        "speedup", "engine steps\nwithout -> with", "identical"), justify="left")  # fmt: skip
    for backend, rows in report["backends"].items():
        for key in rows["engine_tokens_per_s"]:
            hf_rate, versus = report["hf_generate_tokens_per_s"].get(key), rows["engine_vs_hf_generate"].get(key)
            speed.add_row(
                backend,
                key,
                "-" if hf_rate is None else f"{hf_rate:.0f}",
                f"{rows['engine_tokens_per_s'][key]:.0f}",
                "-" if versus is None else f"{versus:.2f}x",
            )
            with_drafts.add_row(
                backend,
                key,
                f"{rows['engine_tokens_per_s_with_draft'][key]:.0f}",
                f"{rows['speedup_with_draft'][key]:.2f}x",
                f"{rows['forward_passes_no_draft'][key]} -> {rows['forward_passes_with_draft'][key]}",
                str(rows["identical_outputs"][key]),
            )
    names = ("decode_steps_no_draft", "decode_steps_with_draft", "decode_step_reduction", "acceptance_length_mean",
             "draft_acceptance_rate", "undecided_steps", "fully_accepted_responses",
             "steps_over_ceil_l_over_k")  # fmt: skip
    drafts = table("Drafts from one policy step older (largest batch size)", ("measure", *report["backends"]),
                   justify="left")  # fmt: skip
    for name in names:
        values = [rows.get(name) for rows in report["backends"].values()]
        drafts.add_row(name, *(f"{v:.3f}" if isinstance(v, float) else str(v) for v in values))
    exactness = table("Exactness", ("backend", "dtype", "responses", "differing\nwith drafts",
                      "differing between\nplain batches"), justify="left")  # fmt: skip
    for backend, rows in report["exactness"].items():
        for dtype, row in rows.items():
            exactness.add_row(
                backend,
                dtype,
                str(row["responses"]),
                f"{row['differing']} ({row['mismatch_rate']:.1%})",
                f"{row['differing_between_plain_batches']} ({row['plain_batch_mismatch_rate']:.1%})",
            )
    share = report["keyed_sampling"]
    spent = ", ".join(f"{name} {value:.0f}s" for name, value in report["benchmark_seconds"].items())
    notes = [
        f"keyed sampling: {share['keyed_sample_s'] * 1e3:.2f} ms vs {share['forward_pass_s'] * 1e3:.2f} ms for a "
        f"decode pass ({share['share_of_forward_pass']:.1%}) at batch {share['batch_size']}, vocabulary "
        f"{share['vocab_size']}, context {share['context_tokens']}",
        f"policy update: {report['policy_update']}",
        f"benchmark time: {spent}",
    ]
    tables = [speed, with_drafts, drafts, exactness]
    if report.get("draft_tries"):
        tables.append(_tries_table(report["draft_tries"]))
    if report.get("draft_head"):
        tables.extend(head.head_tables(report["draft_head"]))
    if report.get("vllm_ngram"):
        baseline, note = ngram.baseline_table(report["vllm_ngram"], report["backends"]["vllm"])
        tables.insert(2, baseline)
        notes.insert(0, note)
    print_tables(tables, notes, console)


def _tries_table(found: dict):
    """Where pi_t+1's responses left pi_t's drafts, and the decode steps with a round of branches (draft tries)."""
    shown = table(f"Where responses left their drafts (torch engine, {found['requests']} requests)",
                  ("measure", "value"), justify="left")  # fmt: skip
    for name, value in (*found["divergences"].items(), *found["branches"].items()):
        shown.add_row(name, "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value))
    return shown

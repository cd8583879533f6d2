"""Builds the parts of a run from its config and runs it: ``bubblespec run`` in a function.

The virtual clock runs every rank and the trainer in this process (a deterministic simulation of the
cluster); the wall clock runs rollout ranks as Ray Serve deployments and the trainer on Ray Train.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import ValidationError

from bubblespec import plugins
from bubblespec.clocks import PROFILES
from bubblespec.config import RunConfig, ServiceConfig, format_validation_error
from bubblespec.controller import Components, Controller, task_peek
from bubblespec.draft_sources import REQUEST_DRAFT, draft_chain
from bubblespec.errors import ConfigError, ModelLoadError
from bubblespec.interfaces import SamplingParams, acceptance_length
from bubblespec.metrics import RunMetrics
from bubblespec.run_dir import RunDirectory
from bubblespec.service import Peek, RolloutService
from bubblespec.trainer import LearnerSpec, TrainSample
from bubblespec.virtual_ranks import VirtualRankPool


def model_path(config: RunConfig, task) -> str:
    """The model folder to load: model.path, or the task's shipped model; checked before anything starts."""
    if config.model.path:
        folder = Path(config.model.path).expanduser().resolve()  # Ray workers do not share this process's cwd
        if not (folder / "config.json").is_file():
            raise ModelLoadError(
                f"model.path {config.model.path!r} is not a Hugging Face model folder (no config.json there)"
            )
        return str(folder)
    shipped = getattr(task, "model_path", None)
    if shipped is None:
        raise ConfigError(f"task {config.task.name!r} ships no model; set model.path to a Hugging Face model folder")
    return str(shipped())


def make_task(config: RunConfig, held_out: bool = False):
    """The configured task; ``held_out`` gives its held-out version for eval.

    A task whose constructor takes ``split`` holds out its own prompts (``split="eval"``, same seed); any other gets
    another seed (disjoint prompts of a procedural task). A constructor that takes ``model_path`` gets the model
    folder (its tokenizer, context length and generation config)."""
    task_class = plugins.load("tasks", config.task.name)
    parameters = inspect.signature(task_class).parameters
    prompts_per_step = config.eval_prompts if held_out else config.task.prompts_per_step
    options = dict(config.task.options)
    context: dict = {}
    seed = config.task.seed
    if "split" in parameters:
        context["split"] = "eval" if held_out else "train"
    elif held_out:
        seed += 1_000_003
        options.pop("dataset_size", None)  # the held-out set is one batch of its own size
    if "model_path" in parameters:
        context["model_path"] = model_path(config, task_class)
    try:
        return task_class(seed=seed, prompts_per_step=prompts_per_step, **context, **options)
    except ConfigError:
        raise
    except ValidationError as error:  # a task that checks its options with pydantic
        raise ConfigError(format_validation_error(error, f"task.options of task {config.task.name!r}")) from None
    except TypeError as error:  # an option the task's constructor does not take
        raise ConfigError(f"task.options {sorted(options)} do not fit task {config.task.name!r}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"task.options of task {config.task.name!r}: {error}") from None


def make_tasks(config: RunConfig) -> tuple[object, object | None]:
    """The task and, when ``eval_every`` asks for one, its held-out version: built before anything starts, so a
    bad dataset, tokenizer or reward fails first."""
    task = make_task(config)
    return task, make_task(config, held_out=True) if config.eval_every else None


def close_tasks(*tasks) -> None:
    """Stops what tasks started (a reward worker pool)."""
    for task in tasks:
        close = getattr(task, "close", None)
        if close is not None:
            close()


def sampling_params(config: RunConfig, task) -> SamplingParams:
    sampling = config.rollout.sampling
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens or task.max_new_tokens,
        stop_token_ids=tuple(getattr(task, "stop_token_ids", ())),
    )


def engine_settings(config: RunConfig | ServiceConfig, path: str, rank: int = 0) -> dict:
    """What ``from_pretrained`` of every backend gets: the common settings, then ``rollout.engine_options``."""
    rollout = config.rollout
    speculation = config.speculation
    chain = draft_chain(speculation.draft_sources) if speculation.enabled else ()
    dynamic = {}
    if any(name != REQUEST_DRAFT for name in chain):  # only then: other backends need not know the setting
        dynamic = {"draft_chain": chain, "draft_source_options": speculation.draft_source_options}
    return (
        {
            "model_path": path,
            "dtype": config.model.dtype,
            "max_batch_size": rollout.max_batch_size,
            "max_draft_tokens_per_step": rollout.max_draft_tokens_per_step,
            "verification": rollout.verification,
            "adaptive_draft_length": rollout.adaptive_draft_length,
            "num_threads": rollout.threads_per_rank,
            "rank": rank,
        }
        | dynamic
        | rollout.engine_options
    )


def load_backend(config: RunConfig | ServiceConfig):
    """The configured backend's engine class, after checking it can run the configured draft sources."""
    backend = plugins.load("backends", config.rollout.backend)
    speculation = config.speculation
    dynamic = [n for n in draft_chain(speculation.draft_sources) if n != REQUEST_DRAFT] if speculation.enabled else []
    if dynamic and not getattr(backend, "supports_draft_chain", False):
        able = [name for name in plugins.available("backends") if _runs_draft_chain(name)]
        raise ConfigError(
            f"speculation.draft_sources {dynamic} run inside the engine, and rollout.backend "
            f"{config.rollout.backend!r} cannot run them; use a backend that can ({', '.join(able)}) or only the "
            "sources the controller attaches (bubble, history)"
        )
    return backend


def _runs_draft_chain(name: str) -> bool:
    try:
        return bool(getattr(plugins.load("backends", name), "supports_draft_chain", False))
    except Exception:  # a backend whose engine is not installed cannot run anything here
        return False


class LocalTrainer:
    """The learner in this process; time is the profile's (virtual clock)."""

    def __init__(self, spec: LearnerSpec, seconds: Callable[[int], float]) -> None:
        self.spec = spec
        self.learner = spec.build()
        self.seconds = seconds

    def train(self, samples: list[TrainSample], step: int | None = None) -> tuple[dict, dict, float]:
        metrics = self.learner.step(samples, at_step=step)
        # Each epoch passes over the batch's tokens once (the recomputation of old logprobs is not charged).
        passes = self.spec.trainer.ppo_epochs
        return metrics, self.learner.state_dict(), self.seconds(metrics["trained_tokens"] * passes)

    def checkpoint_state(self) -> dict:
        """The optimizer state, and the float32 master weights of a bfloat16 run (see :class:`GRPOLearner`)."""
        return self.learner.checkpoint_state()

    def load_checkpoint_state(self, state: dict) -> None:
        """``state``: a checkpoint's trainer state plus its ``weights``."""
        self.learner.load_checkpoint_state(state)

    def reset(self) -> dict:
        self.learner = self.spec.build()
        return self.learner.state_dict()


def build_virtual(config: RunConfig) -> Components:
    import torch

    if config.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device 'cuda': this machine has no CUDA device torch {torch.__version__} can use")
    task, eval_task = make_tasks(config)
    path = model_path(config, task)
    backend = load_backend(config)
    engine = backend.from_pretrained(**engine_settings(config, path))
    profile = PROFILES[config.clock.profile]
    workers = config.trainer.num_workers
    trainer = LocalTrainer(LearnerSpec.of_run(config, path), lambda tokens: profile.train_seconds(tokens, workers))
    service = run_service(config, task, VirtualRankPool(engine, config.rollout.num_ranks, profile), engine.vocab_size)
    return Components(task=task, service=service, trainer=trainer, eval_task=eval_task)


def run_service(config: RunConfig, task, ranks, vocab_size: int) -> RolloutService:
    """The rollout service of a bubblespec run on ``ranks``: the task's prompts peeked, its sampling settings."""
    sampling = sampling_params(config, task)
    peek = task_peek(task, config.num_steps)
    return RolloutService.build(ranks, vocab_size, config.speculation, config.rollout, sampling, config.seed,
                                config.task.samples_per_prompt, peek, config.ray.colocated)  # fmt: skip


@contextlib.contextmanager
def start_service(
    config: ServiceConfig,
    path: str,
    sampling: SamplingParams,
    samples_per_prompt: int,
    peek: Peek | None = None,
) -> Iterator[RolloutService]:
    """A rollout service on the model folder ``path`` for a trainer of any framework: ``rollout.num_ranks`` ranks
    in this process on the virtual clock (``clock.kind: virtual``), or Ray Serve ranks on ``ray.address`` or a
    local Ray (``wall``); stopped on exit."""
    backend = load_backend(config)
    with contextlib.ExitStack() as stack:
        if config.clock.kind == "wall":
            from bubblespec.ray_cluster import serve_ranks

            ranks, vocab_size = stack.enter_context(serve_ranks(config, path, backend)), read_vocab_size(path)
        else:
            engine = backend.from_pretrained(**engine_settings(config, path))
            ranks = VirtualRankPool(engine, config.rollout.num_ranks, PROFILES[config.clock.profile])
            vocab_size = engine.vocab_size
        service = RolloutService.build(ranks, vocab_size, config.speculation, config.rollout, sampling, config.seed,
                                       samples_per_prompt, peek, config.ray.colocated)  # fmt: skip
        stack.callback(service.close)
        yield service


def read_vocab_size(path: str) -> int:
    import json

    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def run(
    config: RunConfig,
    resume_dir: Path | None = None,
    on_step: Callable[[dict], None] | None = None,
    on_phase: Callable[[int, str], None] | None = None,
    on_activity: Callable[[int, str, str], None] | None = None,
) -> dict:
    """Runs (or resumes) a whole run; returns its summary. ``on_step`` gets each step's record, ``on_phase``
    (step, phase) as the controller enters rollout, train and weight sync, and ``on_activity`` (rank,
    activity, detail) as wall-clock ranks generate, draft and fall idle within a step. With
    ``metrics.enabled`` the step records also feed Prometheus metrics served while the run runs."""
    metrics = RunMetrics() if config.metrics.enabled else None
    with contextlib.ExitStack() as stack:
        if metrics is not None:
            # First: a port in use fails before Ray starts or anything is written.
            metrics.serve(config.metrics)
            stack.callback(metrics.close)
        if config.clock.kind == "wall":
            from bubblespec.ray_cluster import build_on_ray

            parts = stack.enter_context(build_on_ray(config))
        else:
            parts = build_virtual(config)
        stack.callback(close_tasks, parts.task, parts.eval_task)
        run_dir = RunDirectory(resume_dir or config.run_dir)

        def step_done(record: dict) -> None:
            if metrics is not None:
                metrics.observe_step(record)
            if on_step is not None:
                on_step(record)

        controller = Controller(config, parts, run_dir, step_done, on_phase)
        start = 0
        if resume_dir is None:
            run_dir.create(config)
        else:
            start = controller.restore()
            if metrics is not None:
                metrics.observe_steps(run_dir.read_steps())  # counters continue from the steps already run
        started = time.perf_counter()
        if on_activity is not None:
            parts.service.ranks.on_activity = on_activity
        controller.run(start_step=start)
        summary = summarize(config, run_dir.read_steps(), time.perf_counter() - started) | placement(parts)
        run_dir.write_summary(summary)
        return summary


def placement(parts: Components) -> dict:
    """Where a Ray run's ranks and trainer workers ran at its end (node, GPUs; ranks' releases), for the summary;
    nothing on the virtual clock."""
    found = {}
    ranks = parts.service.ranks.placement()
    if ranks:
        found["ranks"] = ranks
    if hasattr(parts.trainer, "placement"):
        found["trainer_workers"] = parts.trainer.placement()
    return {"placement": found} if found else {}


def bubble_utilization(steps: list[dict], num_steps: int) -> float:
    """Bubble seconds spent drafting over all bubble seconds, leaving out the run's last step: it has no later
    step to draft for, so its bubble cannot be used."""
    usable = [s for s in steps if s["step"] < num_steps - 1]
    bubble = sum(s["bubble_seconds"] for s in usable)
    drafting = sum(s["bubble_utilization"] * s["bubble_seconds"] for s in usable)
    return drafting / bubble if bubble > 0 else 0.0


def summarize(config: RunConfig, steps: list[dict], wall_seconds: float) -> dict:
    if not steps:
        return {"num_steps": 0}
    rollout = sum(s["phase_seconds"]["rollout"] for s in steps)
    tokens = sum(s["generated_tokens"] for s in steps)
    decode = sum(s["decode_steps"] for s in steps)
    verify = sum(s["verify_steps"] for s in steps)
    accepted = sum(s["draft_tokens_accepted"] for s in steps)
    return {
        "name": config.name,
        "clock": config.clock.kind,
        "speculation": config.speculation.enabled,
        "num_steps": len(steps),
        "reward_first": steps[0]["reward_mean"],
        "reward_last": steps[-1]["reward_mean"],
        "rewards": [s["reward_mean"] for s in steps],
        "generated_tokens": tokens,
        "decode_steps": decode,
        "acceptance_length_mean": acceptance_length(accepted, verify),
        "draft_coverage_mean": sum(s["draft_coverage"] for s in steps) / len(steps),
        "bubble_utilization": bubble_utilization(steps, config.num_steps),
        "rollout_seconds": rollout,
        "rollout_tokens_per_second": tokens / rollout if rollout > 0 else 0.0,
        "eval_rewards": {
            **({"start": steps[0]["eval_reward_before_training"]} if "eval_reward_before_training" in steps[0] else {}),
            **{s["step"]: s["eval_reward"] for s in steps if "eval_reward" in s},
        },
        "wall_seconds": wall_seconds,
    }

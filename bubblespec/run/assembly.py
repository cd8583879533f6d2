"""Builds a run's parts from its config, for either clock: the one place that assembles tasks, engines, rank pools,
the rollout service and the trainer (docs/design.md §7).

The virtual clock runs every rank and the trainer in this process (a deterministic simulation of the cluster); the
wall clock runs rollout ranks as Ray Serve deployments (:mod:`bubblespec.run.ray_cluster`) and the trainer on Ray Train.
Imports go one way: :mod:`bubblespec.run.launch` (running a run) uses this module, this module uses the parts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import ValidationError

from bubblespec.core import model_folder, plugins
from bubblespec.core.config import EngineSettings, RunConfig, ServiceConfig, engine_config, format_validation_error
from bubblespec.core.draft_sources import REQUEST_DRAFT, draft_chain
from bubblespec.core.errors import ConfigError, ModelLoadError
from bubblespec.core.interfaces import Engine, SamplingParams, Task
from bubblespec.rl.learner import LearnerSpec, TrainSample
from bubblespec.rl.loop import Components, task_peek
from bubblespec.rollout.bubble_scheduler import RankPool
from bubblespec.rollout.clocks import PROFILES
from bubblespec.rollout.service import Peek, RolloutService
from bubblespec.rollout.virtual_ranks import VirtualRankPool

logger = logging.getLogger(__name__)


def model_path(config: RunConfig, task) -> str:
    """The model folder to load: model.path, or the task's shipped model; checked before anything starts."""
    if config.model.path:
        folder = Path(config.model.path).expanduser().resolve()  # Ray workers do not share this process's cwd
        if not (folder / "config.json").is_file():
            raise ModelLoadError(
                f"model.path {config.model.path!r} is not a Hugging Face model folder (no config.json there)"
            )
        return str(folder)
    shipped = task.model_path()
    if shipped is None:
        raise ConfigError(f"task {config.task.name!r} ships no model; set model.path to a Hugging Face model folder")
    return str(shipped)


def make_task(config: RunConfig, held_out: bool = False):
    """The configured task; ``held_out`` gives its held-out version for eval.

    A task whose constructor takes ``split`` holds out its own prompts (``split="eval"``, same seed); any other gets
    another seed (disjoint prompts of a procedural task). A constructor that takes ``model_path`` gets the model
    folder (its tokenizer, context length and generation config)."""
    task_class = plugins.load_subclass("tasks", config.task.name, Task)
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
        if task is not None:
            task.close()


def sampling_params(config: RunConfig, task, path: str | None = None) -> SamplingParams:
    """How the run samples: ``rollout.sampling``, the task's stop tokens and, where the config leaves them unset,
    its suppressed tokens (checked against the vocabulary and end-of-sequence tokens of the model folder ``path``
    where given)."""
    sampling = config.rollout.sampling
    suppressed = sampling.suppressed_token_ids
    suppressed = tuple(task.suppressed_token_ids if suppressed is None else suppressed)
    if path is not None and suppressed:
        vocab_size, eos = model_folder.vocab_size(path), model_folder.eos_token_ids(path)
        outside, ending = [t for t in suppressed if t >= vocab_size], [t for t in suppressed if t in eos]
        what = "rollout.sampling.suppressed_token_ids"
        if outside:
            raise ConfigError(f"{what} {outside} are outside the model's vocabulary of {vocab_size} tokens")
        if ending:
            raise ConfigError(
                f"{what} {ending} are the model's end-of-sequence tokens: a response could never end; suppress "
                "tokens that end nothing"
            )
    try:
        return SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens or task.max_new_tokens,
            stop_token_ids=tuple(task.stop_token_ids),
            suppressed_token_ids=suppressed,
        )
    except ValueError as error:
        raise ConfigError(f"rollout.sampling: {error}") from None


def engine_settings(config: RunConfig | ServiceConfig, path: str, rank: int = 0) -> dict:
    """What ``from_pretrained`` of every backend gets: the common settings, then ``rollout.engine_options``."""
    rollout = config.rollout
    speculation = config.speculation
    chain = draft_chain(speculation.draft_sources) if speculation.enabled else ()
    dynamic = {}
    if any(name != REQUEST_DRAFT for name in chain) or (chain and speculation.draft_candidates > 1):
        # only then: other backends need not know these settings
        dynamic = {"draft_chain": chain, "draft_source_options": speculation.draft_source_options}
        if speculation.draft_candidates > 1:
            dynamic["draft_candidates"] = speculation.draft_candidates
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
            "colocated": config.ray.colocated,
        }
        | dynamic
        | rollout.engine_options
    )


def checked_engine_settings(config: RunConfig | ServiceConfig, path: str, backend: type[Engine]) -> dict:
    """:func:`engine_settings`, checked against the backend's settings model (its ``config_class``, or
    :class:`~bubblespec.core.config.EngineSettings` for a backend without one) before anything starts: both clocks and
    ``bubblespec validate`` check them here, so a bad ``rollout.engine_options`` is one error naming the setting and
    listing the valid ones."""
    settings = engine_settings(config, path)
    engine_config(config.rollout.backend, backend.config_class or EngineSettings, settings)
    return settings


def load_backend(config: RunConfig | ServiceConfig):
    """The configured backend's engine class, after checking its settings model and that it can run the configured
    draft sources."""
    backend = plugins.load_subclass("backends", config.rollout.backend, Engine)
    model = backend.config_class
    if model is not None and not (isinstance(model, type) and issubclass(model, EngineSettings)):
        raise ConfigError(
            f"rollout.backend {config.rollout.backend!r}: its config_class {model!r} must subclass "
            "bubblespec.core.config.EngineSettings (the settings every engine receives; docs/plugins.md)"
        )
    speculation = config.speculation
    dynamic = [n for n in draft_chain(speculation.draft_sources) if n != REQUEST_DRAFT] if speculation.enabled else []
    if dynamic and not backend.supports_draft_chain:
        able = [name for name in plugins.available("backends") if _runs_draft_chain(name)]
        raise ConfigError(
            f"speculation.draft_sources {dynamic} run inside the engine, and rollout.backend "
            f"{config.rollout.backend!r} cannot run them; use a backend that can ({', '.join(able)}) or only the "
            "sources the controller attaches (bubble, history)"
        )
    trees = speculation.enabled and speculation.draft_candidates > 1 and bool(draft_chain(speculation.draft_sources))
    if trees and not backend.supports_draft_chain:
        raise ConfigError(
            f"speculation.draft_candidates {speculation.draft_candidates}: rollout.backend "
            f"{config.rollout.backend!r} verifies only the request's draft; use 1 with it, or the torch backend "
            "(token trees)"
        )
    if speculation.uses_tries and not backend.supports_draft_tries:
        raise ConfigError(
            f"speculation.tries_max_tokens_per_rank {speculation.tries_max_tokens_per_rank}: rollout.backend "
            f"{config.rollout.backend!r} does not draft tries (it reports no margins and takes no response prefix; "
            "docs/plugins.md); use 0 with it, or the torch or vllm backend"
        )
    if speculation.uses_draft_head and not getattr(backend, "supports_draft_head", False):
        raise ConfigError(
            f"speculation.draft_head.enabled: rollout.backend {config.rollout.backend!r} does not draft with a draft "
            "head (it exposes no hidden states to one; docs/plugins.md); use false with it, or the torch backend"
        )
    if trees and not backend.supports_draft_trees:
        logger.warning(
            "speculation.draft_candidates %d: rollout.backend %r verifies the first candidate of each pass only "
            "(no token trees)",
            speculation.draft_candidates,
            config.rollout.backend,
        )
    return backend


def check_sampling(backend, config: RunConfig | ServiceConfig, sampling: SamplingParams) -> None:
    """Refuses, before anything starts, sampling settings the backend declares it cannot apply."""
    used = sampling.settings_of(backend.unsupported_sampling)
    if used:
        hint = ""
        if any(name.startswith("suppressed_token_ids") for name in used):
            hint = " (rollout.sampling.suppressed_token_ids: [] suppresses none of the task's tokens)"
        raise ConfigError(
            f"rollout.backend {config.rollout.backend!r} cannot sample with {', '.join(used)}; use a backend that "
            f"can (torch, vllm){hint}"
        )


def _runs_draft_chain(name: str) -> bool:
    try:
        return plugins.load_subclass("backends", name, Engine).supports_draft_chain
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

    def weights(self) -> dict:
        """The current policy's weights as engines get them (copies: training updates the learner's in place)."""
        return {name: tensor.detach().clone() for name, tensor in self.learner.state_dict().items()}

    def placement(self) -> list[dict]:
        return []


@contextlib.contextmanager
def rank_pool(
    config: RunConfig | ServiceConfig, path: str, backend, extra_cpus: int = 0, check: Callable[[], None] = lambda: None
) -> Iterator[tuple[RankPool, int]]:
    """The clock switch: the rollout ranks of ``config`` on the model folder ``path`` and the model's vocabulary
    size. ``clock.kind: virtual``: every rank in this process on one engine; ``wall``: Ray Serve ranks on
    ``ray.address`` or a local Ray with room for ``extra_cpus`` more (trainer workers; ``check`` runs once a local
    Ray is up). Stopped on exit."""
    settings = checked_engine_settings(config, path, backend)
    if config.clock.kind == "wall":
        from bubblespec.run.ray_cluster import serve_ranks

        with serve_ranks(config, path, backend, settings, extra_cpus, check) as ranks:
            yield ranks, model_folder.vocab_size(path)
        return
    engine = backend.from_pretrained(**settings)
    try:
        yield (
            VirtualRankPool(
                engine, config.rollout.num_ranks, PROFILES[config.clock.profile], config.rollout.max_batch_size
            ),
            engine.vocab_size,
        )
    finally:
        engine.close()


def _service(config, ranks: RankPool, vocab_size: int, sampling, samples_per_prompt: int, peek) -> RolloutService:
    drafts_while_training, _ = config.training_drafting()
    return RolloutService.build(ranks, vocab_size, config.speculation, config.rollout, sampling, config.seed,
                                samples_per_prompt, peek, config.ray.colocated, drafts_while_training)  # fmt: skip


@contextlib.contextmanager
def build_parts(config: RunConfig) -> Iterator[Components]:
    """Everything a run's controller drives, for either clock: tasks, ranks and their rollout service, and the
    trainer (in this process on the virtual clock, Ray Train on the wall clock). Torn down on exit."""
    import torch

    if config.clock.kind == "virtual" and config.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device 'cuda': this machine has no CUDA device torch {torch.__version__} can use")
    task, eval_task = make_tasks(config)
    path = model_path(config, task)
    backend = load_backend(config)  # fail here, with the plugin or draft-source error, not inside a replica
    sampling, peek = sampling_params(config, task, path), task_peek(task, config.num_steps)
    check_sampling(backend, config, sampling)
    learner = LearnerSpec.of_run(config, path, sampling)
    with contextlib.ExitStack() as stack:
        if config.clock.kind == "wall":
            from bubblespec.rl.ray_train import RayTrainer
            from bubblespec.run.ray_cluster import check_local_gpus

            check = functools.partial(check_local_gpus, config)
            workers = config.trainer.num_workers
            ranks, vocab_size = stack.enter_context(rank_pool(config, path, backend, workers, check))
            trainer = RayTrainer(
                learner,
                config.run_dir / "ray_train",
                cpus_per_worker=1.0,
                gpus_per_worker=config.trainer.worker_gpus,
                nodes=config.ray.trainer_nodes,
            )
            stack.callback(trainer.close)
        else:
            ranks, vocab_size = stack.enter_context(rank_pool(config, path, backend))
            profile, workers = PROFILES[config.clock.profile], config.trainer.num_workers
            trainer = LocalTrainer(learner, lambda tokens: profile.train_seconds(tokens, workers))
        service = _service(config, ranks, vocab_size, sampling, config.task.samples_per_prompt, peek)
        yield Components(task=task, service=service, trainer=trainer, eval_task=eval_task)


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
    check_sampling(backend, config, sampling)
    with rank_pool(config, path, backend) as (ranks, vocab_size):
        service = _service(config, ranks, vocab_size, sampling, samples_per_prompt, peek)
        try:
            yield service
        finally:
            service.close()

"""TRL's ``GRPOTrainer`` with bubblespec's rollout: ``GRPOTrainer(..., rollout_func=BubblespecRollout(...))``.

TRL 1.16 calls ``rollout_func(prompts, trainer)`` once per generation batch with this process's prompts, each
already repeated ``num_generations`` times in a row, and wants one completion per element; it calls it too for every
batch of an evaluation (``trainer.model.training`` False: TRL's own "eval" mode), each prompt repeated
``num_generations_eval`` times. For a generation batch, this adapter:

    prompts            the distinct prompts, chat template at the boundary as TRL's own ``_tokenize_prompts`` does
                       (text: ``processing_class(text=...)``; messages: ``apply_chat_template(...,
                       add_generation_prompt=True, **chat_template_kwargs)``)
    keys               (TRL's seed, generation index, prompt position and content, sample index): the same prompts at
                       the same point of a run give the same completions, with or without speculation, resumed from
                       a checkpoint or not (the index goes on from the checkpoint's optimizer steps)
    weights            the trainer's model goes to the ranks whenever ``trainer.state.global_step`` changed, by
                       Hugging Face name; a peft (LoRA) model's adapter merged into the base weights (W + scale *
                       B @ A, as peft's ``merge_and_unload`` merges it, the trained model untouched)
    next prompts       read from a fresh copy of TRL's own ``RepeatSampler`` (the same seed and order), so that idle
                       ranks draft the prompts of the next generation batch while the slow ones finish
    output             ``prompt_ids``, ``completion_ids``, ``logprobs`` per completion, in TRL's order

Per generation batch, :attr:`BubblespecRollout.steps` holds a :class:`~bubblespec.observe.records.GenerationRecord` of
what every rank did (decode steps, drafts, bubbles), as a bubblespec run's step records do, and TRL logs the headline
numbers under ``bubblespec/``.

An evaluation batch is generated with the weights of the moment and no drafts (``service.evaluate``), under keys of
its own (step ``-1 - n`` for the n-th evaluation batch of the run): the training generations keep their indices and
their drafts, and an evaluation's completions are the same with speculation on or off. It is recorded in
:attr:`BubblespecRollout.evaluations`, not in ``steps`` nor in TRL's ``bubblespec/`` log. The ranks count as
generating from the first evaluation batch until TRL's ``on_evaluate``, then as training again.

On several processes (``accelerate launch --num_processes N``), each process calls with its slice of the generation
batch: the slices are gathered to the main process, which owns the service and generates the whole batch (its keys
and peek as on one process, the weights synced once per update), and each process gets its slice's completions
back, with the records (:attr:`~BubblespecRollout.steps`) or the main process's error.

Sampling is TRL's own generation's (``use_vllm=False``: transformers' ``generate``, in its order): ``temperature``,
``top_k``, ``top_p``, ``min_p`` (the model's ``generation_config`` where the config leaves it unset, as ``generate``
fills it), ``repetition_penalty``, ``max_completion_length`` and ``suppress_tokens`` (the model's
``generation_config``'s), each overridden by ``generation_kwargs`` as TRL does
(``do_sample=False`` there is greedy); the logprobs returned are of the distribution sampled (penalty and filters
applied). Any other ``generation_kwargs`` key that changes samples, and any sampling setting of the model's
``generation_config`` that TRL would take (``typical_p``, ``no_repeat_ngram_size``, ``num_beams``, ...), is refused by
name when the rollout is built (:func:`sampling_params`).

Supported: TRL 1.16 on one or several processes (DDP or DeepSpeed ZeRO-1/2: every process holds the whole model),
map-style datasets, text or chat prompts, evaluation (``eval_strategy``, ``num_generations_eval``), full fine-tuning or
one plain LoRA adapter (``peft_config=LoraConfig(...)`` or a ``PeftModel``; ``model_path`` is then the base model's
folder), resuming from a checkpoint. Refused at the first call with a clear error: another TRL version,
``use_vllm=True`` (the ranks are the generation engine), tools (``GRPOTrainer(tools=...)`` or an
``environment_factory``'s methods: TRL would generate every turn after a tool call with transformers' ``generate``,
outside the rollout), FSDP and DeepSpeed ZeRO-3 (each process holds only a shard of the weights: the ranks would
receive shards or empty placeholders), multimodal prompts, iterable datasets, peft models whose merge is not
W + scale * B @ A (DoRA and other LoRA variants, ``lora_bias``, ``modules_to_save``, ``trainable_token_indices``,
``target_parameters``, several active adapters, non-LoRA peft methods).
"""

from __future__ import annotations

import contextlib
import math
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path

from bubblespec.core.config import ServiceConfig
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import Prompt, SamplingParams
from bubblespec.integrations.common import (
    TrainingPhases,
    check_version,
    distinct,
    eos_ids,
    evaluation_record,
    evaluation_step,
    generation_record,
    peek_matched,
    prompt_uid,
)
from bubblespec.observe.records import GenerationRecord

SUPPORTED_TRL = ("1.16.0", "1.17.0")
"""TRL versions this adapter is tested with: >= the first, < the second."""


def check_trl_version(version: str) -> None:
    why = "its rollout_func contract is experimental and changes between releases"
    check_version("bubblespec.integrations.trl", "TRL", version, SUPPORTED_TRL, why)


def check_grpo_args(args) -> None:
    """GRPOConfig settings this rollout cannot honour are errors."""
    if getattr(args, "use_vllm", False):
        raise ConfigError(
            "GRPOConfig(use_vllm=True) with bubblespec's rollout: the bubblespec ranks are the generation engine "
            "(rollout.backend: vllm runs vLLM inside them); set use_vllm=False"
        )


def check_no_tools(trainer) -> None:
    """Tools are refused: TRL runs its tool-calling loop after ``rollout_func`` returns and generates every turn after
    a tool call itself, with transformers' ``generate``, so those tokens would bypass the rollout's keys and drafts."""
    if trainer.tools:
        names = ", ".join(getattr(tool, "__name__", repr(tool)) for tool in trainer.tools)
        raise ConfigError(
            f"GRPOTrainer tools ({names}) with bubblespec's rollout: not supported, because TRL would generate every "
            "turn after a tool call with transformers' generate, outside the rollout (neither keyed nor drafted); "
            "train without tools or environment_factory methods"
        )


def check_unsharded(accelerator) -> None:
    """FSDP and DeepSpeed ZeRO-3 are refused: the main process syncs the ranks from its own copy of the model, which
    there holds only this process's shard of each parameter (FSDP) or an empty placeholder (ZeRO-3). Read from
    ``accelerator.state`` as TRL's ``DistributedBackend`` reads it; ZeRO-1/2 and DDP keep every parameter whole."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    fsdp = getattr(state, "fsdp_plugin", None)  # set only under FSDP (and may be None there)
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if fsdp is not None or state.distributed_type == DistributedType.FSDP:
        sharding = f"FSDP{getattr(fsdp, 'fsdp_version', None) or ''}"
    elif deepspeed is not None and deepspeed.zero_stage == 3:
        sharding = "DeepSpeed ZeRO-3"
    else:
        return
    raise ConfigError(
        f"{sharding} with bubblespec's TRL rollout: not supported, because each process holds only a shard of the "
        "weights and the ranks would receive shards or empty placeholders; train with DDP, DeepSpeed ZeRO-1/2 or "
        "one process"
    )


GENERATION_KWARGS_APPLIED = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens",
                             "do_sample", "suppress_tokens")  # fmt: skip
"""``GRPOConfig.generation_kwargs`` keys the rollout applies as TRL's own generation would (they override the
config's fields there too; ``do_sample=False`` is greedy)."""
GENERATION_KWARGS_NEUTRAL = ("use_cache", "cache_implementation", "disable_compile", "pad_token_id", "bos_token_id",
                             "output_scores", "output_logits", "return_dict_in_generate")  # fmt: skip
"""Keys that change how transformers generates, not what it samples: accepted and not needed."""
MODEL_GENERATION_NEUTRAL = {
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0, "bad_words_ids": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "min_length": 0, "min_new_tokens": 0, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "num_beams": 1, "penalty_alpha": None,
    "dola_layers": None, "guidance_scale": 1.0, "watermarking_config": None, "stop_strings": None,
}  # fmt: skip
"""Fields of the model's ``generation_config.json`` that TRL's own generation takes (it leaves them unset) and that
change the samples unless they hold these values: the rollout refuses them rather than sample differently."""


def sampling_params(args, generation_config, stop: tuple[int, ...]) -> SamplingParams:
    """The sampling of TRL's own generation (``use_vllm=False``: transformers' ``generate``) for ``args`` (a
    ``GRPOConfig``) and the model's ``generation_config``: temperature, top-k, top-p, min-p (the model's
    ``generation_config`` where the config leaves it unset, as ``generate`` fills it), the repetition penalty, the
    length and the suppressed tokens (``suppress_tokens``), with ``generation_kwargs`` overriding them as in TRL.
    Any other setting that would change the samples is a :class:`ConfigError` naming it."""
    settings = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p if args.min_p is not None else getattr(generation_config, "min_p", None),
        "repetition_penalty": args.repetition_penalty,
        "max_new_tokens": args.max_completion_length,
        "suppress_tokens": getattr(generation_config, "suppress_tokens", None),
    }
    extra = dict(args.generation_kwargs or {})
    unknown = sorted(set(extra) - set(GENERATION_KWARGS_APPLIED) - set(GENERATION_KWARGS_NEUTRAL))
    if unknown:
        raise ConfigError(
            f"GRPOConfig.generation_kwargs {unknown}: bubblespec's rollout does not apply them, and they would change "
            f"the samples TRL's own generation makes; it applies {', '.join(GENERATION_KWARGS_APPLIED)} (and ignores "
            f"{', '.join(GENERATION_KWARGS_NEUTRAL)}, which change no sample)"
        )
    settings |= {key: value for key, value in extra.items() if key in GENERATION_KWARGS_APPLIED}
    model_settings = {
        name: getattr(generation_config, name, None) for name in MODEL_GENERATION_NEUTRAL
    }  # fmt: skip
    changing = sorted(
        name for name, value in model_settings.items() if value is not None and value != MODEL_GENERATION_NEUTRAL[name]
    )
    if changing:
        shown = ", ".join(f"{name}={model_settings[name]!r}" for name in changing)
        raise ConfigError(
            f"the model's generation_config sets {shown}, which TRL's own generation applies and bubblespec's rollout "
            "does not; remove them from the model's generation_config (or its generation_config.json)"
        )
    greedy = settings.pop("do_sample", True) is False
    return SamplingParams(
        temperature=0.0 if greedy else float(settings["temperature"]),
        top_k=int(settings["top_k"] or 0),
        top_p=float(settings["top_p"] if settings["top_p"] is not None else 1.0),
        min_p=float(settings["min_p"] or 0.0),
        repetition_penalty=float(settings["repetition_penalty"] if settings["repetition_penalty"] is not None else 1.0),
        max_new_tokens=int(settings["max_new_tokens"]),
        stop_token_ids=stop,
        suppressed_token_ids=tuple(int(t) for t in settings["suppress_tokens"] or ()),
    )


def _folder_generation_config(model_path: str):
    """The model folder's ``generation_config.json`` as transformers reads it (None without one)."""
    if not (Path(model_path) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model_path)


def check_mergeable(model) -> None:
    """The ranks run the base architecture: a peft model must merge into it as W + scale * B @ A."""
    from bubblespec.rl.trainer_models import lora_merge_problems

    problems = lora_merge_problems(model)
    if problems:
        raise ConfigError(
            "bubblespec's TRL rollout sends the ranks the trainer's weights with the LoRA adapter merged (W + scale "
            f"* B @ A), which this peft model's weights are not: {'; '.join(problems)}. Supported: one plain "
            "LoraConfig adapter (no use_dora or other variant, lora_bias, modules_to_save, trainable_token_indices "
            "or target_parameters)"
        )


def is_evaluation(trainer) -> bool:
    """Whether TRL is calling for an evaluation batch: its own signal, as ``GRPOTrainer._generate`` reads it
    (``mode = "train" if self.model.training else "eval"``)."""
    return not trainer.model.training


def _generations_before(trainer) -> int:
    """Generation batches done before this ``train()`` call: 0 from a run's start; after
    ``trainer.train(resume_from_checkpoint=...)``, those of the optimizer steps the checkpoint had done (TRL restarts
    its micro-step count, the run's keys and peek go on). A checkpoint inside a generation batch (TRL reuses one batch
    for ``steps_per_generation x num_iterations`` micro-steps and keeps none in its checkpoints) makes TRL generate
    afresh at once: that batch gets the next unused index, and the run cannot repeat the uninterrupted one."""
    args = trainer.args
    period = args.steps_per_generation * trainer.num_iterations
    done = trainer.state.global_step * args.gradient_accumulation_steps - trainer._step
    if done % period:
        warnings.warn(
            f"resumed at step {trainer.state.global_step}, inside a generation batch (TRL generates every "
            f"{period} micro-steps and keeps no generation batch in its checkpoints): TRL generates afresh now, so "
            "from here on the completions differ from an uninterrupted run's; save_steps a multiple of "
            f"{period // math.gcd(period, args.gradient_accumulation_steps)} resumes exactly",
            stacklevel=2,
        )
    return -(-done // period)


class BubblespecRollout:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` on a bubblespec rollout service.

    ``config``: the service's sections (``rollout``, ``speculation``, ``model.dtype``, ``clock``, ``ray``) as a
    :class:`~bubblespec.core.config.ServiceConfig` or a dict; ``model_path``: the folder TRL's model was loaded from
    (the ranks load it, then get the trainer's weights; with LoRA, the base model's folder). Sampling settings
    (temperature, top-k, top-p, max completion length) are TRL's. Call :meth:`close` (or use it as a context
    manager) to stop the ranks.

    Between two calls TRL trains: the service is told so (``training_starts`` as a call returns,
    ``training_ended`` as the next begins), so that ``ray.colocated`` ranks release their memory meanwhile and,
    with ``speculation.draft_during_training``, ranks on hardware of their own go on drafting (on the virtual
    clock for as many seconds as TRL really took). An evaluation ends that phase at its first batch; TRL's
    ``on_evaluate`` starts it again.
    """

    def __init__(self, config: ServiceConfig | dict, model_path: str | Path, args=None) -> None:
        import trl

        check_trl_version(trl.__version__)
        if args is not None:  # the GRPOConfig: settings we cannot honour fail here, before TRL builds anything
            check_grpo_args(args)
        self.config = config if isinstance(config, ServiceConfig) else ServiceConfig.model_validate(config)
        self.model_path = str(Path(model_path).expanduser().resolve())
        if not (Path(self.model_path) / "config.json").is_file():
            raise ConfigError(f"model_path {str(model_path)!r} is not a Hugging Face model folder (no config.json)")
        if args is not None:  # its sampling settings, against the model folder's generation_config.json
            sampling_params(args, _folder_generation_config(self.model_path), ())
        self.steps: list[GenerationRecord] = []
        """One record per generation batch: ``generation``, ``global_step``, per-rank records, decode steps..."""
        self.evaluations: list[dict] = []
        """One record per evaluation batch: ``evaluation``, ``global_step``, ``num_generations``, tokens, digest."""
        self.metrics = None
        """The Prometheus metrics (``bubblespec.observe.metrics.RunMetrics``) with ``metrics.enabled``."""
        self._stack = contextlib.ExitStack()
        self._service = None
        self._trainer = None
        self._started = False  # the first call starts the service (on the main process)
        self._synced_step: int | None = None
        self._training = TrainingPhases()  # TRL trains from a call's return until the next call
        self._order: list[int] = []  # dataset indices in TRL's sampler order
        self._peeked: dict[int, list[str]] = {}  # generation -> the uids peek said it would ask for
        self._sampler = None
        self._generations_before = 0  # generation batches a checkpoint this run resumed from had done

    # -- the rollout_func -------------------------------------------------------------------------------------------

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if not self._started:
            self._start(trainer)
        accelerator = trainer.accelerator
        if accelerator.num_processes == 1:
            return self._generate(prompts, trainer)
        # Several processes: each has its slice of the generation batch. The main process owns the service and
        # generates the whole batch (the keys and the peek are the batch's, as on one process); each process takes
        # back its slice, with the records, or the main process's error.
        from accelerate.utils import broadcast_object_list, gather_object

        slices = gather_object([prompts])
        reply: list = [None]
        failure = None
        if accelerator.is_main_process:
            steps, evaluations = len(self.steps), len(self.evaluations)
            try:
                output = self._generate([p for part in slices for p in part], trainer)
                reply = [(output, self.steps[steps:], self.evaluations[evaluations:], None)]
            except Exception as error:  # every process raises it: none waits for a reply forever
                failure = error
                reply = [(None, [], [], _portable(error))]
        output, steps, evaluations, error = broadcast_object_list(reply, from_process=0)[0]
        if failure is not None:
            raise failure
        if error is not None:
            raise error
        if not accelerator.is_main_process:
            self.steps += steps
            self.evaluations += evaluations
        start = sum(len(part) for part in slices[: accelerator.process_index])
        return {name: values[start : start + len(prompts)] for name, values in output.items()}

    def _generate(self, prompts: list, trainer) -> dict[str, list]:
        """One call's completions, on the process that owns the service."""
        self._training_ended()
        if self._synced_step != trainer.state.global_step:
            self._sync_weights(trainer)
        if is_evaluation(trainer):  # TRL trains again after its on_evaluate: _training_starts then
            return self._evaluation_batch(prompts, trainer)
        output = self._generation_batch(prompts, trainer)
        self._training_starts()
        return output

    def close(self) -> None:
        self._training_ended()
        self._stack.close()
        self._service = None
        self._started = False  # a later call starts again

    def _generation_batch(self, prompts: list, trainer) -> dict[str, list]:
        """A training generation batch: ``num_generations`` samples per prompt, drafted in the last one's bubbles."""
        generations = trainer.num_generations
        tokenized = self._prompts(self._distinct(prompts, generations))
        generation = self._generation_index(trainer)
        peeked = self._peeked.pop(generation, None)
        outcome = self._service.generate(generation, tokenized, generations)
        self._record(generation_record(generation, trainer.state.global_step, outcome, peek_matched(peeked, tokenized)))
        return _trl_output(tokenized, outcome.results)

    def _evaluation_batch(self, prompts: list, trainer) -> dict[str, list]:
        """An evaluation batch: ``num_generations_eval`` samples per prompt under evaluation keys, without drafts;
        the service's drafts and drafting plan stay as the last generation batch left them."""
        generations = trainer.num_generations_eval
        tokenized = self._prompts(self._distinct(prompts, generations))
        index = len(self.evaluations)
        requests = self._service.requests(evaluation_step(index), tokenized, generations)
        by_key = {result.key: result for result in self._service.evaluate(requests)}
        results = [by_key[r.key] for r in requests]
        self.evaluations.append(evaluation_record(index, trainer.state.global_step, generations, results))
        return _trl_output(tokenized, results)

    def _training_starts(self) -> None:
        self._training.starts(self._service)

    def _training_ended(self) -> None:
        self._training.ended(self._service)

    def __enter__(self) -> BubblespecRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- setup ------------------------------------------------------------------------------------------------------

    def _start(self, trainer) -> None:
        from bubblespec.run.assembly import start_service

        args = trainer.args
        check_grpo_args(args)
        check_no_tools(trainer)
        check_unsharded(trainer.accelerator)  # on every process: each raises it, none waits in a gather
        from torch.utils.data import IterableDataset

        if isinstance(trainer.train_dataset, IterableDataset):
            raise ConfigError("bubblespec's TRL rollout needs a map-style dataset (its sampler order is peekable)")
        check_mergeable(trainer.accelerator.unwrap_model(trainer.model))
        self._trainer = trainer
        if not trainer.accelerator.is_main_process:  # the main process owns the service (see __call__)
            self._started = True
            return
        self._generations_before = _generations_before(trainer)
        self._sampler = trainer._get_train_sampler()  # a fresh RepeatSampler: TRL's seed, TRL's order
        trainer.add_callback(_on_evaluate(self._training_starts))  # TRL's evaluation is over: it trains again
        tokenizer = trainer.processing_class
        generation_config = getattr(trainer.model, "generation_config", None)
        sampling = sampling_params(args, generation_config, eos_ids(tokenizer, generation_config))
        config = self.config.model_copy(update={"seed": int(args.seed)})
        if config.metrics.enabled:  # the per-rank metrics of a bubblespec run, on metrics.host:port
            from bubblespec.observe.metrics import RunMetrics, info_labels

            self.metrics = RunMetrics(config.rollout.num_ranks, info_labels(config))
            self.metrics.serve(config.metrics)
            self._stack.callback(self.metrics.close)
        self._service = self._stack.enter_context(
            start_service(config, self.model_path, sampling, trainer.num_generations, peek=self._peek)
        )
        if self.metrics is not None:  # each rank's state, last progress and replica replacements, live
            self._service.ranks.on_activity = self.metrics.activity
        self._started = True

    # -- prompts ----------------------------------------------------------------------------------------------------

    @staticmethod
    def _distinct(prompts: list, generations: int) -> list:
        """TRL's prompts without their repetition (each prompt ``generations`` times in a row: TRL's
        ``num_generations``, or ``num_generations_eval`` in an evaluation)."""
        firsts = distinct(prompts, generations, "TRL's num_generations, or num_generations_eval in an evaluation")
        if any(_is_multimodal(prompt) for prompt in firsts):
            raise ConfigError("bubblespec's TRL rollout takes text or chat prompts; this one carries images")
        return firsts

    def _generation_index(self, trainer) -> int:
        """Which generation batch this is: TRL generates every steps_per_generation x num_iterations micro-steps,
        counted from the run's start: a resumed run's micro-steps restart at 0 in TRL, so the generation batches the
        checkpoint had done are added (:func:`_generations_before`)."""
        return trainer._step // (trainer.args.steps_per_generation * trainer.num_iterations) + self._generations_before

    def _prompts(self, raw: Sequence) -> list[Prompt]:
        """bubblespec prompts: ids as TRL would tokenize them; uid = position + content, stable across runs."""
        prompts = []
        for position, prompt in enumerate(raw):
            token_ids = tuple(self._tokenize(prompt))
            prompts.append(Prompt(prompt_uid(position, token_ids), token_ids, str(prompt), ""))
        return prompts

    def _tokenize(self, prompt) -> list[int]:
        trainer = self._trainer
        tokenizer = trainer.processing_class
        if isinstance(prompt, list):  # messages; no tools (check_no_tools), so TRL's chat_template is None too
            return list(
                tokenizer.apply_chat_template(
                    conversation=prompt,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **(getattr(trainer, "chat_template_kwargs", None) or {}),
                )["input_ids"]
            )
        return list(tokenizer(text=prompt)["input_ids"])

    def _peek(self, generation: int) -> list[Prompt] | None:
        """The prompts of generation batch ``generation``, from TRL's sampler order; [] past the run's end."""
        trainer = self._trainer
        args = trainer.args
        per_call = args.steps_per_generation * trainer.num_iterations
        total = math.ceil(trainer.state.max_steps * args.gradient_accumulation_steps / per_call)
        if trainer.state.max_steps and generation >= total:
            return []
        size = args.generation_batch_size  # prompts per call, each repeated num_generations times
        start = generation * size * per_call
        while len(self._order) < start + size:
            self._order += list(self._sampler)  # a later epoch: the same sampler again, as TRL iterates it
        indices = self._order[start : start + size][:: trainer.num_generations]
        prompts = self._prompts([trainer.train_dataset[i]["prompt"] for i in indices])
        self._peeked[generation] = [p.uid for p in prompts]
        return prompts

    # -- weights and records ----------------------------------------------------------------------------------------

    def _sync_weights(self, trainer) -> None:
        """The trainer's weights to every rank by Hugging Face name, a LoRA adapter merged into its base weight."""
        import torch

        from bubblespec.models.decoder import DTYPES
        from bubblespec.rl.trainer_models import merged_weights

        dtype = DTYPES[self.config.model.dtype]
        model = trainer.accelerator.unwrap_model(trainer.model)
        with torch.no_grad():
            weights = {name: tensor.to("cpu", dtype) for name, tensor in merged_weights(model).items()}
        self._service.update_weights(weights, version=trainer.state.global_step)
        self._synced_step = trainer.state.global_step

    def _record(self, record: GenerationRecord) -> None:
        self.steps.append(record)
        if self.metrics is not None:
            self.metrics.observe_ranks(record.ranks)
        metrics = getattr(self._trainer, "_metrics", None)
        if metrics is not None:  # TRL logs these with its own metrics
            train = metrics["train"]
            train["bubblespec/decode_steps_saved"].append(record.decode_steps_saved)
            train["bubblespec/draft_coverage"].append(record.draft_coverage)
            train["bubblespec/rollout_seconds"].append(record.rollout_seconds)


def _portable(error: Exception) -> Exception:
    """``error`` as it can travel to the other processes: itself where it pickles, else a RuntimeError with its
    type and message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any exception that cannot make the trip
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _is_multimodal(prompt) -> bool:
    if not isinstance(prompt, list):
        return False
    return any(
        isinstance(message.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") not in (None, "text") for part in message["content"])
        for message in prompt
        if isinstance(message, dict)
    )


def _trl_output(prompts: list[Prompt], results) -> dict[str, list]:
    """What TRL wants back, one entry per completion in request order (prompt by prompt, sample by sample)."""
    by_uid = {p.uid: p for p in prompts}
    return {
        "prompt_ids": [list(by_uid[r.key.prompt_uid].token_ids) for r in results],
        "completion_ids": [list(r.token_ids) for r in results],
        "logprobs": [list(r.logprobs) for r in results],
    }


def _on_evaluate(callback):
    """A transformers ``TrainerCallback`` that calls ``callback()`` when an evaluation is over."""
    from transformers import TrainerCallback

    class EvaluationOver(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            callback()

    return EvaluationOver()

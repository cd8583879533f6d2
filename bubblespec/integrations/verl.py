"""verl's trainer with bubblespec's rollout: ``actor_rollout_ref.rollout.name=bubblespec``.

verl 0.9.1 imports every ``verl.plugins`` entry point when ``verl`` is imported; bubblespec's (:func:`register`)
adds ``bubblespec`` to verl's two rollout registries:

    RolloutReplicaRegistry "bubblespec"        :class:`BubblespecReplica`: starts no inference server (the
                                               bubblespec ranks are the engine), its sleep / wake-up are free
    _ROLLOUT_REGISTRY ("bubblespec", "async")  :class:`BubblespecServerAdapter`, the rollout inside each trainer
                                               worker: ``update_weights`` hands the actor's weights to the ranks,
                                               ``release`` / ``resume`` free nothing (the ranks keep their memory)

and verl's trainer generates through :class:`BubblespecAgentLoopManager`, its
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``: ``generate_sequences(DataProto) -> DataProto`` takes the
step's whole batch (each prompt ``rollout.n`` times in a row, as the trainer repeats it) and returns the keys and
shapes verl's single-turn agent loop returns, so that everything after the rollout (rewards, old logprobs,
advantages, the update) is verl's own:

    prompts            the chat template applied as verl's agent loop applies it (``raw_prompt``,
                       ``add_generation_prompt``, ``data.apply_chat_template_kwargs``), left-cut to
                       ``rollout.prompt_length``
    keys               (``custom.bubblespec.seed``, step, prompt position and content, sample index): the same
                       prompts at the same step give the same responses, with or without speculation
    next prompts       read from a fresh copy of verl's own sampler (``data.seed``, ``data.shuffle``), so that idle
                       ranks draft the next step's prompts while the slow ones finish
    weights            the newest the trainer's workers handed over (:class:`WeightInbox`), to every rank before
                       the step generates
    output             ``prompts`` [bsz, prompt_length] left-padded, ``responses`` / ``response_mask``
                       [bsz, response_length] right-padded, ``input_ids``, ``attention_mask``, ``position_ids``,
                       ``rollout_log_probs`` (with ``rollout.calculate_log_probs``), ``rm_scores`` from verl's reward
                       workers when the trainer streams rewards, the batch's own non-tensor fields

bubblespec's settings are the service's sections (``rollout``, ``speculation``, ``model.dtype``, ``clock``, ``ray``,
``seed``) under ``actor_rollout_ref.rollout.custom.bubblespec``; sampling (temperature, top-k, top-p, response
length, ``val_kwargs``) is verl's. Validation batches (``meta_info["validate"]``) are generated without drafts under
keys of their own (:func:`~bubblespec.integrations.common.evaluation_step`).

Supported: verl 0.9.x's legacy trainer (``trainer.use_v1=False``: its agent loop manager takes and returns
``DataProto``), single-turn text prompts, full fine-tuning or a LoRA adapter merged by verl (``model.lora.merge=True``).
Refused with a clear error: other verl versions, the v1 trainer, multimodal prompts, multi-turn agent loops
(``agent_name`` other than ``single_turn_agent``), LoRA adapters sent unmerged, ``delta_flush`` weights.
docs/integrations.md says what was run and measured.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from verl import DataProto
from verl.experimental.agent_loop import AgentLoopManager
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

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
from bubblespec.rollout.weights import PackedWeights

logger = logging.getLogger(__name__)

NAME = "bubblespec"
"""``actor_rollout_ref.rollout.name`` of bubblespec's rollout."""
MANAGER = f"{__name__}.BubblespecAgentLoopManager"
"""``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` of bubblespec's rollout."""
SUPPORTED_VERL = ("0.9.1", "0.10.0")
"""verl versions this plugin is tested with: >= the first, < the second."""


def check_verl_version(version: str) -> None:
    why = "it implements verl's rollout registries and agent loop manager, which change between releases"
    check_version("bubblespec's verl rollout", "verl", version, SUPPORTED_VERL, why)


def register() -> None:
    """The ``verl.plugins`` entry point: ``bubblespec`` in verl's replica and rollout registries."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.BubblespecServerAdapter"
    RolloutReplicaRegistry.register(NAME, lambda: BubblespecReplica)


# -- weights: from the trainer's workers to the manager ------------------------------------------------------------


class WeightInbox:
    """The newest weights the trainer's workers handed over, by version: a named Ray actor (``bubblespec-verl-
    weights``) when Ray is running, so that workers in other processes reach the manager's, else this process's."""

    ACTOR = "bubblespec-verl-weights"

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forgets what an earlier run handed over (a manager starts with the model folder's weights)."""
        self.version: int | None = None
        self.weights: PackedWeights | None = None
        """As byte buffers (:class:`~bubblespec.rollout.weights.PackedWeights`): Ray stores them out of band, one
        copy."""

    def put(self, version: int, weights: PackedWeights) -> None:
        self.version, self.weights = version, weights

    def newer_than(self, version: int | None) -> tuple[int, PackedWeights] | None:
        """(version, weights) if weights newer than ``version`` (None: any) were handed over, else None."""
        if self.weights is None or (version is not None and self.version <= version):
            return None
        return self.version, self.weights


class _RayInbox:
    """The Ray actor's inbox with the methods of a local one."""

    def __init__(self, actor) -> None:
        import ray

        self._actor, self._get = actor, ray.get

    def clear(self) -> None:
        self._get(self._actor.clear.remote())

    def put(self, version: int, weights: PackedWeights) -> None:
        self._get(self._actor.put.remote(version, weights))

    def newer_than(self, version: int | None):
        return self._get(self._actor.newer_than.remote(version))


_local_inbox = WeightInbox()


def inbox(create: bool = False) -> WeightInbox | _RayInbox:
    """The run's weight inbox: the named Ray actor when Ray is running (``create``: made if missing, by the manager),
    else this process's."""
    import ray

    if not ray.is_initialized():
        return _local_inbox
    if create:
        actor_class = ray.remote(num_cpus=0)(WeightInbox)
        return _RayInbox(actor_class.options(name=WeightInbox.ACTOR, get_if_exists=True).remote())
    try:
        return _RayInbox(ray.get_actor(WeightInbox.ACTOR))
    except ValueError:
        raise ConfigError(
            "the trainer's workers found no bubblespec weight inbox on this Ray cluster: verl's trainer must build "
            f"its rollout with actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER}"
        ) from None


class BubblespecServerAdapter(BaseRollout):
    """The rollout verl builds in each trainer worker (``get_rollout_class("bubblespec", "async")``): it receives the
    actor's weights after every update and hands them to the manager's ranks; the trainer's rank 0 does, the others
    drop their copy (each worker receives the full tensors)."""

    def __init__(self, config, model_config, device_mesh=None, *args, **kwargs) -> None:
        super().__init__(config, model_config, device_mesh)
        self.released = False
        """Whether verl asked to free the rollout's memory (``release``) since the last ``resume``."""
        self.replica_rank = kwargs.get("replica_rank", 0)
        self.is_leader_rank = True

    async def resume(self, tags: list[str]) -> None:
        """verl gives the rollout its memory back (``weights``, ``kv_cache``): the ranks never gave theirs up."""
        self.released = False

    async def release(self) -> None:
        """verl frees the rollout's memory for training: the ranks' memory is their own (a separate Ray actor), so
        nothing is freed here; colocated ranks release theirs when the manager says training starts."""
        self.released = True

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
        if wire_format != "named_tensors":
            raise ConfigError(
                f"bubblespec's verl rollout takes full named tensors, not {wire_format!r} weights: set "
                "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"
            )
        if kwargs.get("peft_config") is not None:
            raise ConfigError(
                "bubblespec's verl rollout takes full weights: with LoRA set actor_rollout_ref.model.lora.merge=True "
                "so that verl merges the adapter before it syncs"
            )
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            for _ in weights:  # every worker walks the generator (its gathers are collective); rank 0 keeps a copy
                pass
            return
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        version = kwargs.get("global_steps")
        inbox().put(0 if version is None else int(version), PackedWeights.pack(state))


class BubblespecReplica(RolloutReplica):
    """A replica of verl's LLM server manager that starts no server: the bubblespec ranks, started by
    :class:`BubblespecAgentLoopManager`, generate. It refuses to start without that manager."""

    async def launch_servers(self) -> None:
        manager = getattr(getattr(self.config, "agent", None), "agent_loop_manager_class", None)
        if manager != MANAGER:
            raise ConfigError(
                f"actor_rollout_ref.rollout.name={NAME} generates through bubblespec's agent loop manager: set "
                f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER} (it is {manager!r})"
            )
        self._server_address = f"{NAME}-{self.replica_rank}"
        self._server_handle = None

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def wake_up(self) -> None:
        pass

    async def sleep(self) -> None:
        pass

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    async def clear_kv_cache(self) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass


# -- the manager: one call per step's batch -------------------------------------------------------------------------


class BubblespecAgentLoopManager(AgentLoopManager):
    """verl's ``agent_loop_manager_class`` on a bubblespec rollout service (see the module's docstring).

    Built by verl's trainer as ``create(config=..., llm_client=..., teacher_client=...,
    reward_loop_worker_handles=...)`` (or directly, outside a trainer); :meth:`close` stops the ranks.
    :attr:`steps` has one :class:`~bubblespec.observe.records.GenerationRecord` per training step, :attr:`evaluations`
    one record per validation batch.
    """

    def __init__(self, config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None) -> None:
        import verl

        check_verl_version(verl.__version__)
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
        if config.trainer.get("use_v1", False):
            raise ConfigError(
                f"{MANAGER} is an agent loop manager of verl's legacy trainer (DataProto in, DataProto out): set "
                "trainer.use_v1=False (verl 0.9's v1 trainer hands its manager TransferQueue batches instead)"
            )
        rollout = config.actor_rollout_ref.rollout
        if rollout.name != NAME:
            raise ConfigError(f"{MANAGER} generates with actor_rollout_ref.rollout.name={NAME}, not {rollout.name!r}")
        custom = _plain(rollout.get("custom") or {})
        self.settings = _settings(custom.get(NAME) or {})
        records = custom.get(f"{NAME}_records")
        self.records_path = None if records is None else Path(str(records)).expanduser()
        """``custom.bubblespec_records``: a JSON line per training step (its record and the weights' version) is
        appended there, for a run whose manager lives in verl's driver actor."""
        path = Path(str(config.actor_rollout_ref.model.path)).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"actor_rollout_ref.model.path {str(path)!r} is not a local Hugging Face model folder (no "
                "config.json): bubblespec's ranks load the model from it"
            )
        self.model_path = str(path.resolve())
        self.steps: list[GenerationRecord] = []
        """One record per training step: decode steps, drafts, bubbles of every rank."""
        self.evaluations: list[dict] = []
        """One record per validation batch."""
        self._stack = contextlib.ExitStack()
        self._service = None
        self._version: int | None = None  # the weights' version on the ranks (None: the model folder's)
        self._training = TrainingPhases()  # verl trains from a step's return until the next call
        self._order: list[int] = []
        self._peeked: dict[int, list[str]] = {}

    async def _init_agent_loop_workers(self) -> None:
        """What verl's ``create`` starts: the bubblespec ranks instead of agent loop workers."""
        self.start()

    def start(self) -> None:
        """Starts the ranks (``create`` does; call it when built directly)."""
        if self._service is not None:
            return
        from transformers import AutoConfig, GenerationConfig
        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
        from verl.utils import hf_tokenizer
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        from bubblespec.run.assembly import start_service

        config = self.config
        rollout = config.actor_rollout_ref.rollout
        self.tokenizer = hf_tokenizer(self.model_path, trust_remote_code=config.actor_rollout_ref.model.get(
            "trust_remote_code", False))  # fmt: skip
        try:
            generation_config = GenerationConfig.from_pretrained(self.model_path)
        except OSError:
            generation_config = None
        stop = eos_ids(self.tokenizer, generation_config)
        self._builder = create_continuous_token_builder(
            self.tokenizer,
            hf_model_type=getattr(AutoConfig.from_pretrained(self.model_path), "model_type", None),
            chat_template_kwargs=_plain(config.data.get("apply_chat_template_kwargs") or {}),
        )
        self.sampling = _sampling(rollout, rollout, stop)
        self.validation_sampling = _sampling(rollout.val_kwargs, rollout, stop)
        # verl's own sampler, afresh: the order the trainer's dataloader reads the training set in.
        self.dataset = create_rl_dataset(config.data.train_files, config.data, self.tokenizer, None)
        self._sampler = create_rl_sampler(config.data, self.dataset)
        self._batch_size = int(config.data.get("gen_batch_size") or config.data.train_batch_size)
        batches_per_epoch = len(self.dataset) // self._batch_size
        self._total_steps = int(config.trainer.get("total_training_steps") or 0) or (
            batches_per_epoch * int(config.trainer.total_epochs)
        )
        self._service = self._stack.enter_context(
            start_service(self.settings, self.model_path, self.sampling, int(rollout.n), peek=self._peek)
        )
        self._inbox = inbox(create=True)  # after the service: on the wall clock it starts Ray; held: the actor lives
        self._inbox.clear()  # as long as a handle does

    def close(self) -> None:
        self._stack.close()
        self._service = None

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The step's responses in verl's layout (see the module's docstring); a validation batch
        (``meta_info["validate"]``) under evaluation keys, without drafts."""
        self.start()
        self._training_ended()
        self._sync_weights()
        validate = bool(prompts.meta_info.get("validate", False))
        rollout = self.config.actor_rollout_ref.rollout
        samples = int(rollout.val_kwargs.n if validate else rollout.n)
        for name in prompts.non_tensor_batch.get("agent_name", ()):
            if name != "single_turn_agent":
                raise ConfigError(f"bubblespec's verl rollout runs single-turn prompts; this batch asks for {name!r}")
        raw = [list(p) for p in prompts.non_tensor_batch["raw_prompt"]]
        tokenized = self._prompts(distinct(raw, samples, "verl's rollout.n, or val_kwargs.n in validation"))
        started = time.perf_counter()
        if validate:
            results = self._evaluate(tokenized, samples)
        else:
            step = int(prompts.meta_info.get("global_steps", len(self.steps) + 1))
            generation = step - 1  # verl counts steps from 1; bubblespec's keys and peek from 0
            outcome = self._service.generate(generation, tokenized, samples)
            record = generation_record(generation, step, outcome, peek_matched(self._peeked.pop(generation, None),
                                                                               tokenized))  # fmt: skip
            self.steps.append(record)
            self._write(record)
            results = outcome.results
        output = self._verl_output(tokenized, results, prompts)
        output.meta_info["timing"] = self._timing(validate, time.perf_counter() - started)
        if not validate:
            self._training_starts()
        return output

    # -- prompts ----------------------------------------------------------------------------------------------------

    def _prompts(self, messages: Sequence[list]) -> list[Prompt]:
        """bubblespec prompts, tokenized as verl's single-turn agent loop tokenizes ``raw_prompt``."""
        prompts = []
        for position, prompt in enumerate(messages):
            if any(isinstance(m.get("content"), list) for m in prompt):
                raise ConfigError("bubblespec's verl rollout takes text chat prompts; this one has content parts")
            token_ids = tuple(self._tokenize(prompt))
            prompts.append(Prompt(prompt_uid(position, token_ids), token_ids, str(prompt), ""))
        return prompts

    def _tokenize(self, messages: list) -> list[int]:
        """verl's own tokenization of a single-turn prompt: its Continuous Token builder for the model's family (the
        chat template with ``add_generation_prompt`` and ``data.apply_chat_template_kwargs``), the prompt's last
        ``rollout.prompt_length`` tokens kept, as its agent loop keeps them."""
        ids = self._builder.build_initial_tokens(messages)
        limit = int(self.config.actor_rollout_ref.rollout.prompt_length)
        return list(ids)[-limit:]

    def _peek(self, generation: int) -> list[Prompt] | None:
        """The prompts of step ``generation + 1`` in verl's sampler order (its dataloader drops the last partial
        batch of every epoch); [] past the run's last step."""
        if generation >= self._total_steps:
            return []
        size = self._batch_size
        start = generation * size
        while len(self._order) < start + size:
            epoch = list(self._sampler)  # a later epoch: the same sampler again, as the dataloader iterates it
            self._order += epoch[: len(epoch) // size * size]
        rows = [self.dataset[i]["raw_prompt"] for i in self._order[start : start + size]]
        prompts = self._prompts([list(r) for r in rows])
        self._peeked[generation] = [p.uid for p in prompts]
        return prompts

    # -- weights, phases, validation --------------------------------------------------------------------------------

    def _sync_weights(self) -> None:
        from bubblespec.models.decoder import DTYPES

        newer = self._inbox.newer_than(self._version)
        if newer is None:
            return
        version, weights = newer
        dtype = DTYPES[self.settings.model.dtype]
        self._service.update_weights({n: t.to(dtype) for n, t in weights.tensors().items()}, version=version)
        self._version = version

    def _write(self, record: GenerationRecord) -> None:
        if self.records_path is None:
            return
        line = {"weights_version": self._version, **record.model_dump(mode="json", exclude={"ranks"})}
        with self.records_path.open("a") as records:
            records.write(json.dumps(line) + "\n")

    def _training_starts(self) -> None:
        self._training.starts(self._service)

    def _training_ended(self) -> None:
        self._training.ended(self._service)

    def _evaluate(self, prompts: list[Prompt], samples: int) -> list:
        from bubblespec.rollout.step import step_requests

        index = len(self.evaluations)
        requests = step_requests(prompts, self._service.seed, evaluation_step(index), samples, self.validation_sampling)
        by_key = {result.key: result for result in self._service.evaluate(requests)}
        results = [by_key[r.key] for r in requests]
        self.evaluations.append(evaluation_record(index, len(self.steps), samples, results))
        return results

    def _timing(self, validate: bool, seconds: float) -> dict[str, float]:
        """What verl's trainer logs under ``timing_raw`` for the rollout."""
        timing = {"bubblespec/generate_seconds": seconds}
        if not validate and self.steps:
            record = self.steps[-1]
            timing |= {
                "bubblespec/decode_steps_saved": record.decode_steps_saved,
                "bubblespec/draft_coverage": record.draft_coverage,
                "bubblespec/bubble_seconds": record.bubble_seconds,
            }
        return timing

    # -- verl's output ----------------------------------------------------------------------------------------------

    def _verl_output(self, prompts: list[Prompt], results: list, batch: DataProto) -> DataProto:
        """The batch as verl's single-turn agent loop returns it (``AgentLoopWorker._postprocess``)."""
        from tensordict import TensorDict
        from verl.utils.model import compute_position_id_with_mask

        rollout = self.config.actor_rollout_ref.rollout
        prompt_length, response_length = int(rollout.prompt_length), int(rollout.response_length)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        by_uid = {p.uid: p for p in prompts}
        size = len(results)
        prompt_ids = torch.full((size, prompt_length), pad, dtype=torch.long)
        prompt_mask = torch.zeros((size, prompt_length), dtype=torch.long)
        response_ids = torch.full((size, response_length), pad, dtype=torch.long)
        response_mask = torch.zeros((size, response_length), dtype=torch.long)
        logprobs = torch.zeros((size, response_length), dtype=torch.float32)
        for row, result in enumerate(results):
            prompt = by_uid[result.key.prompt_uid].token_ids
            if prompt:
                prompt_ids[row, -len(prompt) :] = torch.tensor(prompt)
                prompt_mask[row, -len(prompt) :] = 1
            tokens = list(result.token_ids)[:response_length]
            response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            response_mask[row, : len(tokens)] = 1
            logprobs[row, : len(tokens)] = torch.tensor(list(result.logprobs)[: len(tokens)], dtype=torch.float32)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        tensors = {
            "prompts": prompt_ids,
            "responses": response_ids,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
        }
        if rollout.get("calculate_log_probs", False):
            tensors["rollout_log_probs"] = logprobs
        non_tensor = {"__num_turns__": np.full(size, 2, dtype=np.int32)}
        meta_info = {}
        if self.reward_loop_worker_handles is None:
            non_tensor |= batch.non_tensor_batch
        else:
            scores, infos = self._scores(tensors, batch)
            meta_info["reward_extra_keys"] = list(infos[0]) if infos else []
            at = response_mask.sum(dim=1) - 1
            rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
            rm_scores[torch.arange(size), at.clamp(min=0)] = torch.tensor(scores, dtype=torch.float32)
            tensors["rm_scores"] = rm_scores
            for key in infos[0] if infos else ():
                non_tensor[key] = np.array([info[key] for info in infos])
        # verl's agent loop gives text prompts empty multi-modal inputs, and its trainer reads them
        non_tensor["multi_modal_inputs"] = np.array([{} for _ in range(size)], dtype=object)
        for key in ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras"):
            non_tensor.setdefault(key, np.full(size, None, dtype=object))
        return DataProto(batch=TensorDict(tensors, batch_size=size), non_tensor_batch=non_tensor, meta_info=meta_info)

    def _scores(self, tensors: dict, batch: DataProto) -> tuple[list[float], list[dict]]:
        """Each response's reward from verl's reward workers (``compute_score``), one sample per call as verl's agent
        loop sends it."""
        import ray
        from tensordict import TensorDict

        calls = []
        for row in range(len(batch)):
            prompt = tensors["prompts"][row][tensors["attention_mask"][row, : tensors["prompts"].shape[1]].bool()]
            response = tensors["responses"][row][tensors["response_mask"][row].bool()]
            input_ids = torch.cat([prompt, response]).unsqueeze(0)
            mask = torch.ones_like(input_ids)
            sample = TensorDict(
                {"prompts": prompt.unsqueeze(0), "responses": response.unsqueeze(0), "input_ids": input_ids,
                 "attention_mask": mask, "position_ids": torch.arange(input_ids.shape[1]).unsqueeze(0)},
                batch_size=1,
            )  # fmt: skip
            fields = {k: np.array([v[row]], dtype=object) for k, v in batch.non_tensor_batch.items()}
            fields |= {"__num_turns__": np.array([2]), "prompt_len": np.array([len(prompt)]),
                       "response_len": np.array([len(response)])}  # fmt: skip
            handle = self.reward_loop_worker_handles[row % len(self.reward_loop_worker_handles)]
            calls.append(handle.compute_score.remote(DataProto(batch=sample, non_tensor_batch=fields)))
        results = ray.get(calls)
        return [r["reward_score"] for r in results], [r.get("reward_extra_info", {}) for r in results]


def _settings(custom: dict) -> ServiceConfig:
    """The rollout service's sections from ``actor_rollout_ref.rollout.custom.bubblespec``; a wrong one is a
    :class:`ConfigError` naming each key and what is allowed."""
    from pydantic import ValidationError

    from bubblespec.core.config import format_validation_error

    try:
        return ServiceConfig.model_validate(custom)
    except ValidationError as error:
        raise ConfigError(
            format_validation_error(error, "actor_rollout_ref.rollout.custom.bubblespec", ServiceConfig)
        ) from None


def _sampling(kwargs, rollout, stop: tuple[int, ...]) -> SamplingParams:
    """bubblespec's sampling from verl's (``rollout`` or ``rollout.val_kwargs``): ``do_sample=False`` is greedy,
    ``top_k=-1`` off; ``rollout.ignore_eos`` (verl's vLLM server honours it: responses run to ``response_length``)
    and ``rollout.repetition_penalty`` (a field of verl's rollout config that its own agent loop leaves at 1.0) for
    both."""
    greedy = not kwargs.get("do_sample", True)
    return SamplingParams(
        temperature=0.0 if greedy else float(kwargs.temperature),
        top_k=max(int(kwargs.get("top_k", -1)), 0),
        top_p=float(kwargs.get("top_p", 1.0)),
        max_new_tokens=int(rollout.response_length),
        stop_token_ids=stop,
        ignore_eos=bool(rollout.get("ignore_eos", False)),
        repetition_penalty=float(rollout.get("repetition_penalty", 1.0)),
    )


def _plain(value):
    """An OmegaConf node as plain Python (dicts and lists); anything else as it is."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


__all__ = [
    "BubblespecAgentLoopManager",
    "BubblespecReplica",
    "BubblespecServerAdapter",
    "WeightInbox",
    "inbox",
    "check_verl_version",
    "register",
]

register()  # verl imports this module through its verl.plugins entry point

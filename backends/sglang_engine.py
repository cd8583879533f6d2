"""An engine backend over SGLang 0.5.23's HTTP API: keyed sampling in a custom logit processor, drafts verified
exactly, on one of two routes (docs/design.md §4; the server side is :mod:`bubblespec.backends.sglang_server`).

**Prefill scoring** (the default): each step is one batched ``/generate`` round trip over the active sequences (up
to ``max_batch_size``):

- **plain generation**: ``input_ids`` = prompt + response so far, ``temperature: 0`` (greedy on processed
  logits) and ``KeyedGumbelProcessor``, which puts the keyed sample ``argmax(mask(z / T) + G(k, i))`` on top.
  The response position ``i`` is ``custom_params["offset"] + len(__req__.output_ids)``, exact only with
  ``--disable-overlap-schedule`` (the overlap scheduler samples before the previous token is appended).
- **verification**: ``input_ids`` = prompt + response + draft chunk, ``max_new_tokens: 1``, input logprobs from the
  position before the chunk with the top-K candidates and each draft token's own logprob;
  :func:`bubblespec.verify.verification.decide_keyed_samples` computes the keyed samples on the client, and the shared
  bookkeeping (:mod:`bubblespec.verify.sequence`) accepts draft tokens while they equal them, emits the first differing
  sample, takes the processor's sample as the bonus after a fully accepted chunk, and decodes a position the top K
  cannot decide as one plain token on the server before it goes on (exact, only slower).

**SGLang's own speculative step** (``speculative: true``): servers run bubblespec's ``BUBBLESPEC`` speculative
algorithm; each response is one request carrying its draft, the server verifies the draft's chunks with keyed
verify rows in its batched steps, and each reply is replayed on the client (``sglang_server.replay``) for its stats
and as a check.

The processor's two-point row (0 at the sample, its logprob - 1 next to it) carries each token's log-probability
back in the top-2 output logprobs (``lp = B - A + 1``), so no extra round trip is needed for logprobs.

Remote engines report round trips, not device passes: ``on_forward`` is called once per ``/generate`` call (a plain
generation call runs up to ``tokens_per_call`` device passes); ``RequestStats.decode_steps`` still counts device
passes that emitted tokens (one per plain-generated token, one per verify call). ``stop`` is polled while a call is
in flight; once set, the call's requests are aborted (``/abort_request`` matches rid prefixes) and their partial
``output_ids`` come back ``"preempted"``.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from bubblespec.backends.sglang_server import ALGORITHM, DRAFT, processor_payload, replay
from bubblespec.core.config import EngineSettings, engine_config
from bubblespec.core.errors import BubblespecError, ConfigError, ModelLoadError, RequestError
from bubblespec.core.interfaces import Engine, ForwardPass, GenerationRequest, GenerationResult
from bubblespec.verify.sequence import ProposalSettings, Sequence, record_top_k_verifications

_LAUNCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
_POLL_S = 0.005
_RESERVE = 1
"""Context positions SGLang keeps back: it needs input < context and input + max_new_tokens <= context."""


UNSUPPORTED_SAMPLING = ("min_p", "repetition_penalty", "suppressed_token_ids")
"""Sampling settings this backend refuses: its keyed processor and the client's top-K verification apply temperature,
top-k and top-p only (SGLang's own penalties run in its sampler, outside the keyed rows)."""


def _refuse_unsupported_sampling(index: int, request: GenerationRequest) -> None:
    used = request.sampling.settings_of(UNSUPPORTED_SAMPLING)
    if used:
        raise RequestError(
            f"request {index} ({request.key}) sets {', '.join(used)}: the sglang backend samples with temperature, "
            "top_k and top_p only; use the torch or vllm backend for min_p, repetition_penalty and suppressed tokens "
            "(or set rollout.sampling.suppressed_token_ids: [] where the task suppresses some)"
        )


class SGLangError(BubblespecError, RuntimeError):
    """An SGLang server failed, refused a call or went away; the message names the rank, URL and endpoint."""


class SGLangEngineConfig(EngineSettings):
    """Settings of the SGLang backend: the common ones (narrowed where SGLang cannot follow) and its own."""

    model_path: str
    """A local Hugging Face model folder; the client reads its config.json (vocabulary, EOS, context length)."""
    urls: list[str] = []
    """Running servers, one per rank: this engine uses ``urls[rank % len(urls)]``."""
    launch: bool = False
    """Start ``python -m sglang.launch_server`` on 127.0.0.1 at ``base_port + rank`` (needs bubblespec[sglang])."""
    base_port: int = Field(30000, ge=1, le=65535)
    """Port of rank 0's launched server."""
    launch_args: list[str] = []
    """Extra ``launch_server`` flags, e.g. ["--mem-fraction-static", "0.5"]."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long a launched server may take to answer ``/health_generate``."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """How long to wait for a server in ``urls`` to answer ``/health_generate`` before failing."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest one HTTP call may take."""
    top_logprobs_num: int = Field(20, ge=1)
    """K, the candidates scored per draft position; K >= vocabulary size decides every position."""
    tokens_per_call: int | None = Field(None, ge=1)
    """Tokens one generation call may produce; a batched call returns when its longest item is done. Empty: 64,
    or the whole response with ``speculative`` (each call's prefill samples a token without a draft)."""
    processor: Literal["reference", "value"] = "reference"
    """How the logit processor travels: "reference" (the server imports bubblespec) or "value" (dill bytecode;
    needs dill here and the same Python minor version on the server)."""
    weights_dir: str | None = None
    """Where ``update_weights`` writes safetensors for ``/update_weights_from_disk``; the server must read it."""
    weight_update_session: bool = True
    """Bracket the disk update with /begin_weight_update and /end_weight_update."""
    dtype: Literal["float32", "bfloat16", "float64"] = "bfloat16"
    """The launched server's --dtype; with ``urls``, how the servers were started (not checked).
    ``max_batch_size`` is the sequences sent in one /generate call."""
    verification: Literal["coupled"] = "coupled"
    """Only "coupled" (keyed noise): the keyed samples are the key's noise, on the client or in the server's
    verify step."""
    speculative: bool = False
    """Verify drafts inside SGLang's own speculative step: the servers run bubblespec's speculative algorithm
    (``--speculative-algorithm BUBBLESPEC``, see backends/sglang_server.py; ``launch: true`` adds the flags),
    each response is one request carrying its draft, drafts align by position. Off: drafts are verified on this
    client from prefill-scored top-K logprobs."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads of the client (noise for verification); None leaves torch's setting alone."""

    @model_validator(mode="after")
    def _check(self) -> SGLangEngineConfig:
        if self.launch == bool(self.urls):
            raise ValueError("give either urls (running servers) or launch: true, exactly one of them")
        if self.speculative and self.adaptive_draft_length:
            raise ValueError("speculative: true verifies with SGLang's fixed width: adaptive_draft_length must be off")
        if self.launch and self.dtype not in _LAUNCH_DTYPES:
            raise ValueError(f"SGLang cannot run dtype {self.dtype!r}; choose one of {sorted(_LAUNCH_DTYPES)}")
        return self


class SGLangEngine(Engine):
    """A :class:`bubblespec.core.interfaces.GenerationEngine` backed by one SGLang 0.5.23 server (per rank)."""

    config_class = SGLangEngineConfig
    unsupported_sampling = UNSUPPORTED_SAMPLING

    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self._read_model_config(config.model_path)
        self._process: subprocess.Popen | None = None
        self._log_file = None
        if config.launch:
            self.url = self._launch()
        else:
            self.url = config.urls[config.rank % len(config.urls)].rstrip("/")
            self._wait_healthy(config.connect_timeout_s, "is not reachable")
        self._processor = processor_payload(config.processor)
        self._policy_version = 0
        self._released = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sglang-rank{config.rank}")
        self.num_round_trips = 0
        self._tokens_per_call = config.tokens_per_call or (1 << 30 if config.speculative else 64)
        self._proposal = ProposalSettings(
            max_draft_tokens_per_step=config.max_draft_tokens_per_step,
            adaptive_draft_length=config.adaptive_draft_length,
            # the server proposes by position on the speculative route; the replay must propose as it does
            draft_alignment="position" if config.speculative else config.draft_alignment,
        )

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> SGLangEngine:
        return cls(engine_config("sglang", SGLangEngineConfig, {"model_path": str(model_path), **settings}))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def context_length(self) -> int:
        """The model's context less the one position SGLang keeps back (input < context)."""
        return self._context_length - _RESERVE

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def _read_model_config(self, model_path: str) -> None:
        config_file = Path(model_path).expanduser() / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"model path {model_path!r} has no config.json (a local Hugging Face folder)")
        hf = json.loads(config_file.read_text())
        eos = hf.get("eos_token_id")
        self._eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        self._vocab_size = int(hf["vocab_size"])
        self._context_length = int(hf.get("max_position_embeddings", 2048))

    # -- server management ---------------------------------------------------------------------------------------

    def _where(self, endpoint: str) -> str:
        return f"sglang backend, rank {self.config.rank}, {self.url}{endpoint}"

    def _launch(self) -> str:
        if importlib.util.find_spec("sglang") is None:
            raise ConfigError("launch: true needs SGLang installed: pip install 'bubblespec[sglang]'")
        port = self.config.base_port + self.config.rank
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.config.model_path]
        command += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"]
        command += ["--enable-custom-logit-processor", "--disable-overlap-schedule"]
        command += ["--dtype", _LAUNCH_DTYPES[self.config.dtype], *self.config.launch_args]
        if self.config.speculative:
            width = self.config.max_draft_tokens_per_step + 1  # the root and up to K draft tokens
            command += ["--speculative-algorithm", ALGORITHM, "--speculative-num-draft-tokens", str(width)]
        self._log_file = tempfile.NamedTemporaryFile("w+", prefix=f"sglang-rank{self.config.rank}-", suffix=".log")
        self._process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT)
        self.url = url
        self._wait_healthy(self.config.startup_timeout_s, "did not become healthy")
        return url

    def _wait_healthy(self, timeout_s: float, failure: str) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise SGLangError(f"{self._where('')}: the launched server exited ({self._log_tail()})")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=min(5.0, timeout_s)) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                last = str(getattr(error, "reason", error))
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        self.close()
        raise SGLangError(f"{self._where('/health_generate')} {failure} within {timeout_s:g} s (last error: {last})")

    def _log_tail(self) -> str:
        if self._log_file is None:
            return ""
        self._log_file.flush()
        self._log_file.seek(0)
        return "log: " + self._log_file.read()[-2000:]

    def _call(self, endpoint: str, body: Any = None, method: str = "POST", text: bool = False) -> Any:
        """One HTTP call; a non-2xx status, a dropped connection or a bad body raises :class:`SGLangError`."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + endpoint, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.config.request_timeout_s) as reply:
                raw = reply.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:1000]
            raise SGLangError(f"{self._where(endpoint)}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", error)
            gone = f"the server went away ({type(reason).__name__}: {reason})"
            raise SGLangError(f"{self._where(endpoint)}: {gone}") from None
        if text:
            return raw
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            raise SGLangError(f"{self._where(endpoint)}: not JSON: {raw[:200]!r}") from None

    def _checked(self, endpoint: str, body: Any) -> dict:
        reply = self._call(endpoint, body)
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise SGLangError(f"{self._where(endpoint)}: refused: {reply!r}")
        return reply

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """pause → begin → write safetensors + /update_weights_from_disk → end → flush → continue.

        Disk, not tensors: ``/update_weights_from_tensor`` sends CUDA IPC handles, usable only from a process on
        the server's GPU host. ``/end_weight_update`` re-runs post-load processing after a disk load (0.5.23 marks
        only tensor/distributed loads in the session): harmless for unquantised models; turn the bracket off with
        ``weight_update_session: false`` for packed/quantised ones.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"policy version must be an int, got {version!r}")
        # a folder of our own goes when the update is done (or failed); under ``weights_dir`` only the version's
        root = Path(self.config.weights_dir or tempfile.mkdtemp(prefix="bubblespec-sglang-weights-"))
        folder = root / f"rank{self.config.rank}-v{version}"
        try:
            self._load_from_disk(folder, state_dict, version)
        finally:
            shutil.rmtree(folder if self.config.weights_dir else root, ignore_errors=True)
        self._policy_version = version

    def _load_from_disk(self, folder: Path, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Writes the checkpoint folder ``folder`` (the model's files, ``state_dict`` as safetensors) and has the
        server load it as ``version``, generation paused meanwhile."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        for file in Path(self.config.model_path).expanduser().iterdir():
            if file.is_file() and file.suffix != ".safetensors":
                shutil.copy(file, folder / file.name)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
        save_file(tensors, str(folder / "model.safetensors"))
        reply = self._call("/pause_generation", {"mode": "abort"})
        if not isinstance(reply, dict) or reply.get("status") != "ok":
            raise SGLangError(f"{self._where('/pause_generation')}: refused: {reply!r}")
        try:
            if self.config.weight_update_session:
                self._checked("/begin_weight_update", {})
            body = {"model_path": str(folder), "weight_version": str(version), "flush_cache": True}
            self._checked("/update_weights_from_disk", body)
            if self.config.weight_update_session:
                self._checked("/end_weight_update", {})
            self._call("/flush_cache", text=True)
        finally:
            self._call("/continue_generation", {})

    def release(self) -> None:
        self._call("/release_memory_occupation", {"tags": ["kv_cache"]})
        self._released = True

    def resume(self) -> None:
        if self._released:
            self._call("/resume_memory_occupation", {"tags": ["kv_cache"]})
            self._released = False

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(
        self,
        requests: Seq[GenerationRequest],
        stop=None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        sequences = [
            Sequence.admit(i, r, self._vocab_size, self._context_length, self._eos_ids, reserve=_RESERVE)
            for i, r in enumerate(requests)
        ]
        for sequence in sequences:
            _refuse_unsupported_sampling(sequence.index, sequence.request)
        results: list[GenerationResult | None] = [None] * len(sequences)
        waiting, active = list(reversed(sequences)), []
        while waiting or active:
            if stop is not None and stop.is_set():
                for sequence in active + waiting:
                    results[sequence.index] = sequence.result("preempted")
                break
            while waiting and len(active) < self.config.max_batch_size:
                active.append(waiting.pop())
            preempted = self._step(active, stop, on_forward)
            for sequence in list(active):
                if sequence.finish is not None or preempted:
                    results[sequence.index] = sequence.result()
                    active.remove(sequence)
            if preempted:
                for sequence in waiting:
                    results[sequence.index] = sequence.result("preempted")
                break
        return results  # type: ignore[return-value]

    def _step(self, active: list[Sequence], stop, on_forward) -> bool:
        """One batched /generate round trip; returns True when ``stop`` aborted it."""
        if self.config.speculative:
            return self._speculative_step(active, stop, on_forward)
        drafts = [s.propose(self._proposal) for s in active]
        body = self._generate_body(active, drafts)
        replies, aborted = self._generate(body, stop)
        self.num_round_trips += 1
        if on_forward is not None:
            on_forward(_forward_pass(replies, drafts, self._vocab_size))
        verified = [(s, d, r) for s, d, r in zip(active, drafts, replies, strict=True) if d]
        if aborted:
            verified = [(s, d, r) for s, d, r in verified if _reason(r) != "abort"]
        self._verified(verified)
        for sequence, draft, reply in zip(active, drafts, replies, strict=True):
            if not draft:
                self._generated(sequence, reply)
        return aborted

    def _speculative_step(self, active: list[Sequence], stop, on_forward) -> bool:
        """One /generate of whole responses, each request carrying its draft; the server verifies them in its
        speculative steps and each reply is replayed on its sequence (stats, and a check of the server)."""
        body = self._generate_body(active, [[] for _ in active], whole=True)
        replies, aborted = self._generate(body, stop)
        self.num_round_trips += 1
        if on_forward is not None:
            on_forward(_forward_pass(replies, [[] for _ in replies], self._vocab_size))
        for sequence, params, reply in zip(active, body["sampling_params"], replies, strict=True):
            tokens = reply.get("output_ids") or []
            top = reply["meta_info"].get("output_top_logprobs") or []
            logprobs = [self._decoded_logprob(t, c) for t, c in zip(tokens, top[: len(tokens)], strict=True)]
            verify_count = reply["meta_info"].get("spec_verify_ct")
            replay(sequence, tokens, logprobs, self._proposal, params["max_new_tokens"], verify_count)
        return aborted

    def _generate_body(self, active: list[Sequence], drafts: list[list[int]], whole: bool = False) -> dict:
        vocab, k = self.vocab_size, min(self.config.top_logprobs_num, self.vocab_size)
        body: dict[str, list] = {key: [] for key in ("input_ids", "sampling_params", "logprob_start_len")}
        body["top_logprobs_num"] = []
        for sequence, draft in zip(active, drafts, strict=True):
            prompt, params = sequence.request.prompt_token_ids, sequence.request.sampling
            body["input_ids"].append([*prompt, *sequence.tokens, *draft])
            seed = sequence.noise_seed
            custom = {"seed0": seed[0], "seed1": seed[1], "offset": len(sequence.tokens) + len(draft)}
            custom |= {"temperature": float(params.temperature), "top_k": params.top_k, "top_p": float(params.top_p)}
            plain = 1 if sequence.decode_next else min(self._tokens_per_call, sequence.room)
            if whole:  # with the request's draft, for the server's speculative steps
                custom[DRAFT] = list(sequence.request.draft.token_ids) if sequence.request.draft else []
            body["sampling_params"].append(
                {
                    "max_new_tokens": 1 if draft else plain,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stop_token_ids": sorted(sequence.stop_ids),
                    "custom_params": custom,
                }
            )
            body["logprob_start_len"].append(len(prompt) + len(sequence.tokens) - 1 if draft else -1)
            body["top_logprobs_num"].append(k if draft else min(2, vocab))
        rid = f"bubblespec-r{self.config.rank}-{uuid.uuid4().hex}"
        body |= {"rid": [f"{rid}-{i}" for i in range(len(active))], "return_logprob": True}
        body["custom_logit_processor"] = [self._processor] * len(active)
        return body

    def _generate(self, body: dict, stop) -> tuple[list[dict], bool]:
        """Runs /generate in a worker thread while polling ``stop``; on stop, aborts the call's rids by prefix."""
        future = self._pool.submit(self._call, "/generate", body)
        aborted = False
        while True:
            try:
                replies = future.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                if not aborted and stop is not None and stop.is_set():
                    self._call("/abort_request", {"rid": body["rid"][0].rsplit("-", 1)[0]}, text=True)
                    aborted = True
        if not isinstance(replies, list) or len(replies) != len(body["input_ids"]):
            raise SGLangError(f"{self._where('/generate')}: expected {len(body['input_ids'])} results, got {replies!r}")
        for reply in replies:
            if _reason(reply) == "abort" and not aborted:
                raise SGLangError(f"{self._where('/generate')}: the server aborted a request: {reply['meta_info']}")
        return replies, aborted

    def _generated(self, sequence: Sequence, reply: dict) -> None:
        """Plain keyed generation: every output token with its logprob decoded from the processor's top-2."""
        output_ids = reply.get("output_ids") or []  # a request aborted while waiting may have none
        top = reply["meta_info"].get("output_top_logprobs") or []
        if len(top) < len(output_ids) and _reason(reply) != "abort":
            count = f"{len(top)} output top logprobs for {len(output_ids)} tokens"
            raise SGLangError(f"{self._where('/generate')}: {count}")
        tokens = output_ids[: len(top)]
        logprobs = [self._decoded_logprob(token, candidates) for token, candidates in zip(tokens, top, strict=True)]
        sequence.record_plain(tokens, logprobs, self._proposal)

    def _decoded_logprob(self, token: int, candidates: list) -> float:
        if self.vocab_size == 1:
            return 0.0
        if len(candidates) < 2 or candidates[0][1] != token or candidates[1][1] != (token + 1) % self.vocab_size:
            raise SGLangError(
                f"{self._where('/generate')}: the keyed logit processor did not run (top logprobs {candidates!r}); "
                "launch the server with --enable-custom-logit-processor --disable-overlap-schedule"
            )
        return candidates[1][0] - candidates[0][0] + 1.0

    def _verified(self, verified: list[tuple[Sequence, list[int], dict]]) -> None:
        """Records every verify call of this round trip: keyed samples decided on the client from the top-K input
        logprobs and each draft token's own, the processor's sample after the chunk as the bonus."""
        if not verified:
            return
        ids, logprobs, steps = [], [], []
        for sequence, draft, reply in verified:
            meta = reply["meta_info"]
            top = meta.get("input_top_logprobs") or []
            own = meta.get("input_token_logprobs") or []
            if len(top) != len(draft) + 1:
                where = self._where("/generate")
                raise SGLangError(f"{where}: {len(top)} input top logprobs for a chunk of {len(draft)}")
            # Rows 1.. score the draft tokens: the top K, then the draft token's own logprob (-1 pads if absent).
            for j, entry in enumerate(top[1:]):
                token = own[j + 1] if len(own) == len(top) else [None, -1, None]
                ids.append([c[1] for c in entry] + [token[1] if token[0] is not None else -1])
                logprobs.append([c[0] for c in entry] + [token[0] if token[0] is not None else 0.0])
            bonus = reply["output_ids"][0]  # the processor's sample after the chunk
            steps.append((sequence, draft, bonus, self._decoded_logprob(bonus, meta["output_top_logprobs"][0])))
        ids_JC = torch.tensor(ids, dtype=torch.int64)
        logprobs_JC = torch.tensor(logprobs, dtype=torch.float64)
        record_top_k_verifications(steps, ids_JC, logprobs_JC, ids_JC.shape[1] - 1, self._vocab_size, self._proposal)


def _reason(reply: dict) -> str | None:
    reason = reply.get("meta_info", {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else None


def _forward_pass(replies: list[dict], drafts: list[list[int]], vocab_size: int) -> ForwardPass:
    """A round trip as one ForwardPass: tokens the server computed (cache misses + outputs) and their context; each
    generated token and each verified draft position is sampled or bounded over the whole vocabulary."""
    fed, context, pairs = 0, 0, 0
    for reply in replies:
        meta = reply.get("meta_info", {})
        prompt, cached = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)
        new = prompt - cached + len(reply.get("output_ids", []))
        fed, context = fed + new, context + prompt + len(reply.get("output_ids", []))
        pairs += new * cached + new * (new + 1) // 2
    sampled = sum(len(r.get("output_ids", [])) for r in replies) + sum(len(d) for d in drafts)
    return ForwardPass(len(replies), fed, context, pairs, sampled_logits=sampled * vocab_size)

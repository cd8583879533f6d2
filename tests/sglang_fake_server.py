"""A fake SGLang 0.5.23 HTTP server for tests, backed by a real model (bubblespec's torch ``DecoderModel``).

It follows the request and response schemas of SGLang 0.5.23 as read from its source (see the research notes
the backend cites): the contract gate on ``/generate`` (serde-style ``{"error": "..."}`` 400s for unknown
``sampling_params`` keys and type errors), the later ``ValueError`` checks (``{"error": {"message": ...}}``),
``--skip-tokenizer-init`` semantics (no ``text``), batch/rid rules, logprob shapes (``[logprob, id, null]``, entry 0
of input logprobs ``[null, id, null]``, ``input_top_logprobs[0]`` null), finish reasons as dicts, ``output_ids``
including the stop token, and the control routes (pause/continue, abort by rid prefix, begin/end weight-update
sessions, update from disk, flush cache as plain text, release/resume memory, health).

Sampling is what SGLang does on the path the backend uses: ``temperature`` in [0, 1e-6) means greedy (argmax of
the logits after the custom logit processor). The processor string is decoded like ``CustomLogitProcessor.from_str``
(``json`` → ``bytes.fromhex`` → ``dill.loads``); where dill is not installed, the pickle is read with the stdlib and
only classes from ``bubblespec`` modules may be named in it (by-value pickles then fail, as they would need dill).

Deliberate differences, for tests: the pydantic layer before the contract gate is not modelled (its type errors show
as the gate's); items of a batch run one after another; ``logits_dtype`` defaults to float64 so that the fake is an
exact engine (SGLang hands processors float32 logits; pass ``logits_dtype=torch.float32`` to mimic that).
"""

from __future__ import annotations

import json
import pickle
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bubblespec.backends import sglang_server
from bubblespec.models.decoder import DTYPES, DecoderModel, KVCache, read_checkpoint

# decode_SamplingParams' field list (sglang/api/v1/api_types.py), in its order: the unknown-field text lists it.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
_INT_FIELDS = {"max_new_tokens", "top_k", "n", "min_new_tokens", "stream_interval", "sampling_seed", "beam_width"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_SAMPLING_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": 1 << 30, "ignore_eos": False}
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class ContractError(Exception):
    """The contract gate's 400: ``{"error": "<serde text>"}``."""


class BadRequest(Exception):
    """A ValueError after the gate: 400 ``{"error": {"message": ...}}``."""


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _expect(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_sampling_params(value: Any) -> dict:
    """``decode_SamplingParams``: unknown keys and wrong types are refused in serde's words."""
    _expect(isinstance(value, dict), value, "struct SamplingParams")
    for key, x in value.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if x is None or key == "custom_params":
            continue
        if key in _INT_FIELDS:
            _expect(_is_int(x), x, "i64")
        elif key in _FLOAT_FIELDS:
            _expect(_is_number(x), x, "f64")
        elif key in _BOOL_FIELDS:
            _expect(isinstance(x, bool), x, "a boolean")
        elif key == "stop_token_ids":
            _expect(isinstance(x, list), x, "a sequence")
            for e in x:
                _expect(_is_int(e), e, "i64")
    return {k: v for k, v in value.items() if v is not None}


def check_generate_contract(body: Any) -> None:
    """``decode_GenerateRequest`` for the keys a token-id client sends."""
    _expect(isinstance(body, dict), body, "struct GenerateRequest")
    for key, x in body.items():
        if x is None:
            continue
        if key in ("rid", "text"):
            items = x if isinstance(x, list) else [x]
            for e in items:
                _expect(isinstance(e, str), e, "a value or an array of values for StringOrList")
        elif key == "input_ids":
            _expect(isinstance(x, list), x, "a value or an array of values for TokenIdsOrList")
            rows = [x] if not x or _is_number(x[0]) else x
            for row in rows:
                _expect(isinstance(row, list), row, "a sequence")
                for e in row:
                    _expect(_is_int(e), e, "i64")
        elif key in ("stream", "return_text_in_logprobs"):
            _expect(isinstance(x, bool), x, "a boolean")
        elif key == "sampling_params":
            for e in x if isinstance(x, list) else [x]:
                check_sampling_params(e)
        elif key == "return_logprob":
            for e in x if isinstance(x, list) else [x]:
                _expect(isinstance(e, bool), e, "a value or an array of values for BoolOrList")
        elif key in ("logprob_start_len", "top_logprobs_num"):
            for e in x if isinstance(x, list) else [x]:
                _expect(_is_int(e), e, "a value or an array of values for Int64OrList")
        elif key == "custom_logit_processor":
            for e in x if isinstance(x, list) else [x]:
                _expect(e is None or isinstance(e, str), e, "a string")


class _BubblespecOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "bubblespec" or module.startswith("bubblespec."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the fake server (without dill) only loads bubblespec classes, not {module}")


def load_processor(text: str):
    """``CustomLogitProcessor.from_str``: the class from ``{"callable": hex(dill pickle)}``, instantiated."""
    payload = bytes.fromhex(json.loads(text)["callable"])
    try:
        import dill
    except ImportError:
        import io

        return _BubblespecOnly(io.BytesIO(payload)).load()()
    return dill.loads(payload)()


class FakeSGLangServer:
    """Start with ``with FakeSGLangServer(path) as server:``; ``server.url``; ``server.log`` lists (method, path, body).

    Test hooks: ``fail_generate = "500"`` answers the next /generate with an internal error, ``"close"`` drops the
    connection without an answer; ``token_delay_s`` slows each generated token (to test aborts).

    ``speculative_width=N`` is a server started with ``--speculative-algorithm BUBBLESPEC
    --speculative-num-draft-tokens N``: after the prefill's token, every step is a verify step over N tree slots
    laid out, keyed and checked by ``bubblespec.backends.sglang_server`` as the plugin worker does, accepted by a
    loop version of SGLang's ``verify_tree_greedy`` (:func:`greedy_tree_walk`). The fake computes the rows of the
    chain (root and chunk) with its model and leaves padding rows zero (SGLang computes them; the worker makes
    padding unmatchable either way); an accepted stop token ends the response there.
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float64",
        logits_dtype: torch.dtype = torch.float64,
        enable_custom_logit_processor: bool = True,
        token_delay_s: float = 0.0,
        speculative_width: int | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.config, weights = read_checkpoint(model_path)
        self.model = DecoderModel(self.config, weights, DTYPES[dtype], "cpu")
        self.logits_dtype = logits_dtype
        self.enable_custom_logit_processor = enable_custom_logit_processor
        self.token_delay_s = token_delay_s
        self.speculative_width = speculative_width
        self.fail_generate: str | None = None
        self.log: list[tuple[str, str, Any]] = []
        self.weight_version = "default"
        self.session_open = False
        self.released: set[str] = set()
        self._paused = threading.Event()
        self._model_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._running: dict[str, dict] = {}  # rid -> {"aborted": bool}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeSGLangServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def bodies(self, path: str) -> list[Any]:
        return [body for _, p, body in self.log if p == path]

    # -- routes --------------------------------------------------------------------------------------------------

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """(status, body): a dict/list/None is sent as JSON, a str as text/plain, bytes as they are."""
        routes = {
            "/generate": self.generate,
            "/health_generate": lambda b: (200, b""),
            "/health": lambda b: (200, b""),
            "/abort_request": self.abort_request,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/flush_cache": self.flush_cache,
            "/release_memory_occupation": lambda b: self.memory(b, release=True),
            "/resume_memory_occupation": lambda b: self.memory(b, release=False),
        }
        if path not in routes:
            return 404, {"detail": "Not Found"}
        if path != "/flush_cache" and method == "POST" and path not in ("/health", "/health_generate"):
            if path not in ("/release_memory_occupation", "/resume_memory_occupation") and not isinstance(body, dict):
                return 400, _error_response("Field required: body")
        return routes[path](body)

    def abort_request(self, body: dict) -> tuple[int, Any]:
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        with self._state_lock:
            for running_rid, state in self._running.items():
                if abort_all or (rid and running_rid.startswith(rid)):
                    state["aborted"] = True
        return 200, b""

    def pause_generation(self, body: dict) -> tuple[int, Any]:
        self._paused.set()
        if body.get("mode", "abort") == "abort":
            self.abort_request({"abort_all": True})
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        self._paused.clear()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def begin_weight_update(self, body: dict) -> tuple[int, Any]:
        if self.session_open:
            message = "a weight-update session is already open; call end_weight_update() first"
            return 400, {"success": False, "message": message}
        self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> tuple[int, Any]:
        if not self.session_open:
            message = "no weight-update session is open; call begin_weight_update() first"
            return 400, {"success": False, "message": message}
        self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        if "model_path" not in body:
            return 400, _error_response("Field required: model_path")
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            message = f"Failed to get weights iterator: no safetensors in {body['model_path']}."
            return 400, {"success": False, "message": message, "num_paused_requests": 0}
        from safetensors.torch import load_file

        weights = {}
        for file in files:
            weights |= load_file(str(file))
        with self._model_lock:
            self.model.load_weights(weights)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def flush_cache(self, body: Any) -> tuple[int, Any]:
        with self._state_lock:
            busy = bool(self._running)
        return (400, "Flush cache failed.\n") if busy else (200, FLUSH_OK)

    def memory(self, body: Any, release: bool) -> tuple[int, Any]:
        tags = (body or {}).get("tags") or ["weights", "kv_cache"]
        if release:
            self.released |= set(tags)
        else:
            self.released -= set(tags)
        return 200, None

    # -- /generate -----------------------------------------------------------------------------------------------

    def generate(self, body: Any) -> tuple[int, Any]:
        if self.fail_generate == "500":
            self.fail_generate = None
            return 500, _error_response("Internal Server Error") | {"type": "500", "code": 500}
        try:
            check_generate_contract(body)
        except ContractError as error:
            return 400, {"error": str(error)}
        try:
            items = self._normalise(body)
        except BadRequest as error:
            return 400, {"error": {"message": str(error)}}
        while self._paused.is_set():
            time.sleep(0.002)
        with self._state_lock:
            for item in items:
                if item["rid"] in self._running:
                    return 400, {"error": {"message": f"Duplicate request ID detected: {item['rid']}"}}
            for item in items:
                self._running[item["rid"]] = {"aborted": False}
        try:
            outputs = []
            for item in items:
                if item["logprob_start_len"] > len(item["input_ids"]):
                    message = (
                        f"req.logprob_start_len={item['logprob_start_len']} is higher than the number of input tokens "
                        f"len(req.origin_input_ids)={len(item['input_ids'])}. Please use a smaller logprob_start_len."
                    )
                    return 400, {"error": {"message": message}}
                outputs.append(self._run(item))
        finally:
            with self._state_lock:
                for item in items:
                    self._running.pop(item["rid"], None)
        return 200, outputs if items[0]["batch"] else outputs[0]

    def _normalise(self, body: dict) -> list[dict]:
        """``GenerateReqInput.normalize_batch_and_arguments`` and the tokenizer manager's checks."""
        if body.get("text") is not None and body.get("input_ids") is None:
            raise BadRequest(
                "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
                "input_ids or re-initialize the engine with skip_tokenizer_init=False."
            )
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if ids == []:
            raise BadRequest("input_ids cannot be empty.")
        batch = not _is_number(ids[0])
        rows = ids if batch else [ids]
        if body.get("custom_logit_processor") is not None and not self.enable_custom_logit_processor:
            raise BadRequest(
                "The server is not configured to enable custom logit processor. Please set "
                "`--enable-custom-logit-processor` to enable this feature."
            )

        def per_item(key: str, default: Any) -> list:
            value = body.get(key)
            if value is None:
                return [default] * len(rows)
            return value if isinstance(value, list) else [value] * len(rows)

        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else [rid or uuid.uuid4().hex] if not batch else None
        if rids is None:
            rids = [f"{rid}_{i}" for i in range(len(rows))] if rid else [uuid.uuid4().hex for _ in rows]
        if len(rids) != len(rows):
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rids)) != len(rids):
            raise BadRequest(f"Duplicate request IDs detected within the request: {rids}")
        sampling = body.get("sampling_params") or {}
        params = sampling if isinstance(sampling, list) else [sampling] * len(rows)
        starts, tops = per_item("logprob_start_len", -1), per_item("top_logprobs_num", 0)
        return_logprob, processors = per_item("return_logprob", False), per_item("custom_logit_processor", None)
        items = []
        for i, row in enumerate(rows):
            p = _SAMPLING_DEFAULTS | params[i]
            self._verify(p, len(row))
            items.append(
                {
                    "batch": batch,
                    "rid": rids[i],
                    "input_ids": list(row),
                    "params": p,
                    "return_logprob": return_logprob[i],
                    "logprob_start_len": starts[i] if return_logprob[i] else -1,
                    "top_logprobs_num": tops[i],
                    "processor": processors[i],
                }
            )
        return items

    def _verify(self, p: dict, input_len: int) -> None:
        if bad := [t for t in p.get("stop_token_ids", []) if t < 0]:
            raise BadRequest(f"stop_token_ids must be non-negative, got {bad}")
        if p["temperature"] < 0:
            raise BadRequest(f"temperature must be non-negative, got {p['temperature']}.")
        if not 0 < p["top_p"] <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {p['top_p']}.")
        if p["max_new_tokens"] < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
        if p.get("stop") or p.get("stop_regex") or p.get("min_new_tokens", 0) > 0:
            raise BadRequest("stop strings, stop_regex and min_new_tokens need a tokenizer (skip_tokenizer_init)")
        context = self.config.max_position_embeddings
        if input_len >= context:
            too_long = f"The input ({input_len} tokens) is longer than the model's context length ({context} tokens)."
            raise BadRequest(too_long)
        if input_len + p["max_new_tokens"] > context:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
                f"a total of {input_len + p['max_new_tokens']} tokens: {input_len} tokens from the input messages and "
                f"{p['max_new_tokens']} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )

    def _run(self, item: dict) -> dict:
        """Prefill, then one token per step like SGLang's scheduler; an abort stops after the current token."""
        started = time.monotonic()
        state = self._running[item["rid"]]
        p, ids = item["params"], item["input_ids"]
        greedy = p["temperature"] < 1e-6
        temperature, top_k = (1.0, 1) if greedy else (p["temperature"], p["top_k"])
        processor = load_processor(item["processor"]) if item["processor"] is not None else None
        custom = dict(p["custom_params"]) if isinstance(p.get("custom_params"), dict) else p.get("custom_params")
        req = SimpleNamespace(origin_input_ids=list(ids), output_ids=[])
        if isinstance(custom, dict):
            custom["__req__"] = req
        stop_ids = set(p.get("stop_token_ids", [])) | (set() if p["ignore_eos"] else set(self.config.eos_token_ids))
        cache = KVCache(self.config, 1, len(ids) + p["max_new_tokens"] + 1, self.model.dtype, "cpu")
        with self._model_lock:
            logits_TV = self.model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]
        logits_TV = logits_TV.to(self.logits_dtype)
        meta: dict[str, Any] = {}
        if item["return_logprob"]:
            meta |= _input_logprobs(ids, logits_TV, item["logprob_start_len"], item["top_logprobs_num"])
        output_logprobs, output_tops, finish = [], [], {"type": "length", "length": p["max_new_tokens"]}
        next_logits_V = logits_TV[-1]
        speculative = self.speculative_width is not None and isinstance(custom, dict)

        def emit(token: int, logprobs_V: torch.Tensor) -> bool:
            """Appends a generated token and its logprobs; True when it is a stop token (the response ends)."""
            nonlocal finish
            req.output_ids.append(token)
            output_logprobs.append([float(logprobs_V[token]), token, None])
            if item["top_logprobs_num"] > 0:
                output_tops.append(_top(logprobs_V, item["top_logprobs_num"]))
            if token in stop_ids:
                finish = {"type": "stop", "matched": token}
            return token in stop_ids

        spec_meta = {"spec_verify_ct": 0, "spec_num_correct_drafts": 0}
        while len(req.output_ids) < p["max_new_tokens"]:
            if speculative and req.output_ids:  # after the prefill's token: verify steps
                if state["aborted"]:
                    finish = dict(ABORTED)
                    break
                emitted, rows_logprobs = self._verify_step(item, custom, req, cache, spec_meta)
                for token, logprobs_V in zip(emitted, rows_logprobs, strict=True):
                    if emit(token, logprobs_V):
                        break
                if finish["type"] == "stop":
                    break
                continue
            if state["aborted"]:
                finish = dict(ABORTED)
                break
            row_1V = next_logits_V[None].clone()
            if processor is not None:
                row_1V = processor(row_1V, [custom]).to(row_1V.dtype)
            scores_1V = row_1V if greedy else row_1V / temperature
            logprobs_V = torch.log_softmax(scores_1V, -1)[0].clamp(min=torch.finfo(row_1V.dtype).min)
            if top_k == 1:
                token = int(row_1V.argmax(-1))
            else:
                token = _sample(scores_1V[0], top_k, p["top_p"])
            if emit(token, logprobs_V):
                break
            if len(req.output_ids) < p["max_new_tokens"] and not speculative:  # verify steps feed it as the root
                position = len(ids) + len(req.output_ids) - 1
                with self._model_lock:
                    out = self.model.forward(torch.tensor([[token]]), torch.tensor([[position]]), cache)
                next_logits_V = out[0, -1].to(self.logits_dtype)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
        meta = {
            "id": item["rid"],
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
            **meta,
        }
        if item["return_logprob"]:
            meta["output_token_logprobs"] = output_logprobs
            meta["output_token_logprobs_length"] = len(output_logprobs)
            if item["top_logprobs_num"] > 0:
                meta["output_top_logprobs"] = output_tops
        if speculative and spec_meta["spec_verify_ct"]:  # SGLang reports these only after a verify step
            meta |= spec_meta
        meta |= {"reasoning_tokens": 0, "completion_tokens": len(req.output_ids), "cached_tokens": 0}
        meta |= {"e2e_latency": time.monotonic() - started, "response_sent_to_client_ts": time.time()}
        return {"output_ids": list(req.output_ids), "meta_info": meta}

    def _verify_step(self, item: dict, custom: dict, req, cache: KVCache, spec_meta: dict):
        """One verify step of the BUBBLESPEC algorithm: the plugin's chunk and layout, the model's rows of the chain,
        the plugin's keyed rows, SGLang's greedy tree walk; returns the emitted tokens and their rows' logprobs."""
        width, p = self.speculative_width, item["params"]
        num_output = len(req.output_ids)
        draft = custom.get(sglang_server.DRAFT) or []
        room = p["max_new_tokens"] - num_output
        chunk = sglang_server.next_chunk(draft, custom["offset"] + num_output, room, width - 1)
        tokens, mask, depth, padding = sglang_server.chain_layout([chunk], [req.output_ids[-1]], width)
        chain = len(chunk) + 1
        start = len(item["input_ids"]) + num_output - 1  # the root's position
        with self._model_lock:
            out = self.model.forward(tokens[None, :chain], torch.arange(start, start + chain)[None], cache)
        logits_WV = torch.zeros(width, self.config.vocab_size, dtype=self.logits_dtype)
        logits_WV[:chain] = out[0].to(self.logits_dtype)
        sglang_server.keyed_tree_rows_(logits_WV, [custom], [num_output], depth)
        candidates = tokens.masked_fill(padding, sglang_server.UNMATCHABLE)
        path = greedy_tree_walk(candidates, mask.view(width, width), logits_WV.argmax(-1))
        logprobs_WV = torch.log_softmax(logits_WV, -1).clamp(min=torch.finfo(logits_WV.dtype).min)
        spec_meta["spec_verify_ct"] += 1
        spec_meta["spec_num_correct_drafts"] += len(path) - 1
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        predict = logits_WV.argmax(-1)
        return [int(predict[slot]) for slot in path], [logprobs_WV[slot] for slot in path]


def greedy_tree_walk(candidates_W: torch.Tensor, mask_WW: torch.Tensor, target_W: torch.Tensor) -> list[int]:
    """SGLang 0.5.23's ``verify_tree_greedy`` for one request, as a loop (``kernels/ops/speculative/spec_tree.py``):
    from the root (slot 0), accept the first child, in slot order, whose candidate token equals the target
    (argmax) of the last accepted slot; stop when none does. Returns the accepted slots, root first: each emits
    its row's target (the accepted draft tokens, then the bonus)."""
    width = len(candidates_W)
    parent = [max((j for j in range(i) if mask_WW[i, j]), default=-1) for i in range(width)]
    path = [0]
    while True:
        last = path[-1]
        children = [i for i in range(width) if parent[i] == last and int(candidates_W[i]) == int(target_W[last])]
        if not children:
            return path
        path.append(children[0])


def _input_logprobs(ids: list[int], logits_TV: torch.Tensor, start: int, top_num: int) -> dict:
    """Input logprobs from ``start`` (-1: none): entry 0 is ``[null, id, null]``, top entry 0 is null."""
    start = len(ids) if start == -1 else start
    logprobs_TV = torch.log_softmax(logits_TV, -1)
    token_logprobs = [[None, ids[start], None]] if start < len(ids) else []
    tops: list = [None] if start < len(ids) else []
    for j in range(start + 1, len(ids)):
        token_logprobs.append([float(logprobs_TV[j - 1, ids[j]]), ids[j], None])
        tops.append(_top(logprobs_TV[j - 1], top_num))
    meta = {"input_token_logprobs": token_logprobs}
    if top_num > 0:
        meta["input_top_logprobs"] = tops
    return meta


def _top(logprobs_V: torch.Tensor, num: int) -> list:
    values, ids = torch.topk(logprobs_V, min(num, logprobs_V.shape[-1]))
    return [[float(v), int(i), None] for v, i in zip(values, ids, strict=True)]


def _sample(scores_V: torch.Tensor, top_k: int, top_p: float) -> int:
    probs = torch.softmax(scores_V.to(torch.float64), -1)
    if 0 < top_k < probs.shape[-1]:
        probs[probs < torch.topk(probs, top_k).values[-1]] = 0
    sorted_probs, order = torch.sort(probs, descending=True)
    sorted_probs[(torch.cumsum(sorted_probs, -1) - sorted_probs) > top_p] = 0
    return int(order[torch.multinomial(sorted_probs, 1)])


def _error_response(message: str) -> dict:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def _handler_for(server: FakeSGLangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except json.JSONDecodeError as error:
                self._send(400, _error_response(f"JSON decode error: {error}"))
                return
            server.log.append((method, path, body))
            if path == "/generate" and server.fail_generate == "close":
                server.fail_generate = None
                self.close_connection = True
                self.connection.close()
                return
            status, reply = server.route(method, path, body)
            self._send(status, reply)

        def _send(self, status: int, reply: Any) -> None:
            if isinstance(reply, bytes):
                data, kind = reply, "text/plain"
            elif isinstance(reply, str):
                data, kind = reply.encode(), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(reply).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

    return Handler

"""The SGLang backend against a fake SGLang 0.5.23 server (tests/sglang_fake_server.py) backed by the tiny model,
and, where ``BUBBLESPEC_SGLANG_URL`` names one, against a real server (scripts/sglang_real_test.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from bubblespec.backends.sglang_engine import UNSUPPORTED_SAMPLING, SGLangEngine, SGLangError, processor_payload
from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import GenerationRequest, SamplingParams
from bubblespec.tasks.arithmetic import ArithmeticTask
from bubblespec.testing import EngineConformance, RealVocabularyConformance
from bubblespec.testing.conformance import _by_key, _with_draft
from tests.sglang_fake_server import FakeSGLangServer

MODEL = ArithmeticTask.model_path()
REAL_URL = os.environ.get("BUBBLESPEC_SGLANG_URL")
REAL_SPECULATIVE_URL = os.environ.get("BUBBLESPEC_SGLANG_SPECULATIVE_URL")


def _post(url: str, body) -> tuple[int, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            raw = reply.read().decode()
            return reply.status, json.loads(raw) if raw else raw
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode())


@pytest.fixture(scope="module")
def server():
    with FakeSGLangServer(MODEL) as fake:
        yield fake


@pytest.fixture(scope="module")
def requests() -> list[GenerationRequest]:
    return EngineConformance().make_requests()


def _engine(server: FakeSGLangServer, **settings) -> SGLangEngine:
    return SGLangEngine.from_pretrained(str(MODEL), urls=[server.url], dtype="float64", **settings)


def _with(requests, **params) -> list[GenerationRequest]:
    changed = []
    for r in requests:
        sampling = SamplingParams(**({"max_new_tokens": r.sampling.max_new_tokens} | params))
        changed.append(GenerationRequest(r.prompt_token_ids, r.key, sampling, r.draft))
    return changed


# -- the fake server speaks 0.5.23 ----------------------------------------------------------------------------------


def test_the_fake_rejects_malformed_requests_like_sglang_0_5_23(server):
    generate = server.url + "/generate"
    status, body = _post(generate, {"input_ids": [1, 2], "sampling_params": {"foo": 1}})
    assert status == 400 and body["error"].startswith("unknown field `foo`, expected one of `max_new_tokens`, `stop`")
    assert body["error"].endswith("`beam_width`, `watermark`, `choice`")
    status, body = _post(generate, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1.5}})
    assert (status, body) == (400, {"error": "invalid type: floating point `1.5`, expected i64"})
    status, body = _post(generate, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5})
    assert status == 400 and body["error"]["message"].startswith("req.logprob_start_len=5 is higher than the number")
    status, body = _post(generate, {"text": "1+1="})
    assert status == 400 and "skip_tokenizer_init=True cannot accept text prompts" in body["error"]["message"]
    status, body = _post(generate, {"input_ids": [[1], [2]], "rid": ["a", "a"]})
    assert status == 400 and body["error"]["message"].startswith("Duplicate request IDs detected within the request")
    assert _post(server.url + "/no_such_route", {})[0] == 404
    with FakeSGLangServer(MODEL, enable_custom_logit_processor=False) as plain:
        status, body = _post(plain.url + "/generate", {"input_ids": [1], "custom_logit_processor": "{}"})
    assert status == 400 and "Please set `--enable-custom-logit-processor`" in body["error"]["message"]


def test_the_fake_answers_with_the_0_5_23_shapes(server):
    body = {"input_ids": [1, 5, 6], "rid": "shape", "return_logprob": True, "logprob_start_len": 0}
    body |= {"top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    status, reply = _post(server.url + "/generate", body)
    meta = reply["meta_info"]
    assert status == 200 and "text" not in reply and len(reply["output_ids"]) == 3
    assert meta["id"] == "shape" and meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["input_token_logprobs"][0] == [None, 1, None] and meta["input_top_logprobs"][0] is None
    assert [entry[1] for entry in meta["input_token_logprobs"]] == [1, 5, 6]
    assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])
    assert [entry[1] for entry in meta["output_token_logprobs"]] == reply["output_ids"]
    assert {"prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency"} <= set(meta)
    request = urllib.request.Request(server.url + "/abort_request", data=b'{"rid": "x"}', method="POST")
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 200 and answer.read() == b""


# -- the conformance suite on the fake ------------------------------------------------------------------------------


def _engine_on_a_fake(model_path, fake_settings: dict | None = None, **settings) -> SGLangEngine:
    fake = FakeSGLangServer(model_path, **(fake_settings or {})).__enter__()
    engine = SGLangEngine.from_pretrained(str(model_path), urls=[fake.url], **settings)
    close = engine.close
    engine.close = lambda: (close(), fake.stop())  # the engine's fake server goes with it
    return engine


class TestSGLangEngineOnTheFake(EngineConformance):
    """Exact (float64 fake). ``tokens_per_call: 4`` so that two round trips leave responses unfinished for the stop
    check (with 64 tokens a call, every response ends in the first round trip)."""

    unsupported_sampling = UNSUPPORTED_SAMPLING  # refused by name (backends/sglang_engine.py)
    dtype = "float64"
    engine_settings = {"tokens_per_call": 4, "max_draft_tokens_per_step": 8}

    def make_engine(self, model_path: Path):
        return _engine_on_a_fake(model_path, dtype=self.dtype, **self.engine_settings)


class TestSGLangEngineOnTheFakeWithFewCandidates(EngineConformance):
    """K = 3 of 19 candidates: positions the bound cannot decide are sampled by the server; still exact."""

    unsupported_sampling = UNSUPPORTED_SAMPLING  # refused by name (backends/sglang_engine.py)
    dtype = "float64"
    engine_settings = {"tokens_per_call": 4, "top_logprobs_num": 3, "adaptive_draft_length": True}

    def make_engine(self, model_path: Path):
        return _engine_on_a_fake(model_path, dtype=self.dtype, **self.engine_settings)


class TestSGLangEngineOnTheFakeAtARealVocabulary(RealVocabularyConformance):
    """32,000 tokens with the top 20 candidates per draft position (float64 fake: exact)."""

    backend = "sglang"
    unsupported_sampling = UNSUPPORTED_SAMPLING  # refused by name (backends/sglang_engine.py)
    sampling_settings = {name: settings for name, settings in RealVocabularyConformance.sampling_settings.items()
                         if not set(settings) & set(UNSUPPORTED_SAMPLING)}  # fmt: skip
    dtype = "float64"
    num_prompts = 4
    engine_settings = {"tokens_per_call": 8, "top_logprobs_num": 20}

    def make_engine(self, model_path: Path):
        return _engine_on_a_fake(model_path, dtype=self.dtype, **self.engine_settings)


class TestSGLangEngineSpeculativeOnTheFake(EngineConformance):
    """``speculative: true``: the fake runs the BUBBLESPEC algorithm (the plugin's chunk, layout and keyed verify
    rows, SGLang's greedy tree walk over 9 slots), one request per response; exact (float64 fake)."""

    unsupported_sampling = UNSUPPORTED_SAMPLING  # refused by name (backends/sglang_engine.py)
    dtype = "float64"
    engine_settings = {"speculative": True, "max_draft_tokens_per_step": 8}

    def make_engine(self, model_path: Path):
        return _engine_on_a_fake(model_path, {"speculative_width": 9}, dtype=self.dtype, **self.engine_settings)

    def test_stop_returns_within_one_forward_pass_with_partial_responses(self, engine, requests, plain):
        """A remote engine's forward pass is its round trip, and one round trip here is every whole response: a
        stop aborts the call in flight (set once the server has it), within one verify step."""
        with FakeSGLangServer(MODEL, speculative_width=9, token_delay_s=0.02) as slow:
            engine = _engine(slow, speculative=True, max_draft_tokens_per_step=8)
            stop = threading.Event()

            def stop_once_the_call_is_in_flight():  # an event, not a delay: the server has the request
                while not slow.bodies("/generate"):
                    time.sleep(0.005)
                stop.set()

            threading.Thread(target=stop_once_the_call_is_in_flight, daemon=True).start()
            drafted = [_with_draft(r, plain[r.key].token_ids) for r in requests]
            results = _by_key(engine.generate(drafted, stop=stop))
            assert slow.bodies("/abort_request"), "the call in flight was not aborted"
        assert any(r.finish_reason == "preempted" for r in results.values())
        for key, result in results.items():
            assert plain[key].token_ids[: len(result.token_ids)] == result.token_ids
            assert len(result.logprobs) == len(result.token_ids)


def test_the_chain_layout_is_sglang_ngram_tree_layout():
    """result.cpp's fillResult for a chain: slot 0 the root, then the chunk (parent: the slot before), then zero
    padding hanging off the root; the mask row of a slot holds its ancestors and itself."""
    from bubblespec.backends.sglang_server import chain_layout

    tokens, mask, depth, padding = chain_layout([[7, 8], []], [5, 6], 4)
    assert tokens.tolist() == [5, 7, 8, 0, 6, 0, 0, 0]
    assert depth.tolist() == [0, 1, 2, 1, 0, 1, 1, 1]
    assert padding.tolist() == [False, False, False, True, False, True, True, True]
    first = mask.view(2, 4, 4)[0].int().tolist()
    assert first == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert mask.view(2, 4, 4)[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    with pytest.raises(ValueError, match="does not fit 4 slots"):
        chain_layout([[1, 2, 3, 4]], [0], 4)


def test_padding_is_never_accepted_even_where_it_equals_the_sample(server):
    """A padding slot holds token 0, a child of the root: SGLang's greedy walk would accept it wherever the root's
    sample is 0 and the chunk's first token is not. The worker makes padding's candidates unmatchable."""
    from bubblespec.backends.sglang_server import UNMATCHABLE, chain_layout
    from tests.sglang_fake_server import greedy_tree_walk

    tokens, mask, _, padding = chain_layout([[3]], [9], 3)
    target = torch.tensor([0, 4, 1])  # the root's sample is 0, the chunk's token 3 is wrong
    assert greedy_tree_walk(tokens, mask.view(3, 3), target) == [0, 2]  # the padding slot would be accepted
    assert greedy_tree_walk(tokens.masked_fill(padding, UNMATCHABLE), mask.view(3, 3), target) == [0]


def test_replies_the_algorithm_did_not_make_are_caught(server, requests):
    """A server without BUBBLESPEC decodes plainly: the same tokens (keyed sampling), but no verify steps reported,
    and the client says so instead of reporting steps that never ran. Replies whose steps or tokens cannot be the
    algorithm's are refused too."""
    from bubblespec.backends.sglang_server import replay
    from bubblespec.core.errors import EngineError
    from bubblespec.verify.sequence import ProposalSettings, Sequence

    settings = ProposalSettings(max_draft_tokens_per_step=4, draft_alignment="position")
    request = _with_draft(requests[0], [1, 2, 3, 4, 5])
    # prefill 1; a step verifying [2, 3, 4, 5] emits 2, 3 and the sample 9; a step verifying [5] emits the sample 7
    sequence = Sequence.admit(0, request, 19, 512, ())
    replay(sequence, [1, 2, 3, 9, 7], [0.0] * 5, settings, 64, 2)
    assert (sequence.stats.decode_steps, sequence.stats.verify_steps, sequence.stats.draft_tokens_accepted) == (3, 2, 2)
    with pytest.raises(EngineError, match="the server ran 4 verify steps where the drafts need 2"):
        replay(Sequence.admit(0, request, 19, 512, ()), [1, 2, 3, 9, 7], [0.0] * 5, settings, 64, 4)
    with pytest.raises(EngineError, match="ends inside a verify step"):  # 2, 3 accepted, then nothing: no sample
        replay(Sequence.admit(0, request, 19, 512, ()), [1, 2, 3], [0.0] * 3, settings, 64, None)
    plain_server = _engine(server, speculative=True)  # the module's fake runs no speculative algorithm
    with pytest.raises(EngineError, match="reported no speculative verify steps .* --speculative-algorithm BUBBLESPEC"):
        plain_server.generate(requests[:2])


def test_the_speculative_route_equals_plain_keyed_decoding_and_takes_fewer_steps(requests):
    """The speculative route against the torch engine, with its responses as drafts (T < 1, top-k and top-p;
    the keyed rows are the processor's, tested at 32,000 tokens on the other route): identical tokens and
    logprobs, one round trip, far fewer device steps."""
    requests = _with(requests[:8], max_new_tokens=48, temperature=0.8, top_k=6, top_p=0.9)
    expected = _by_key(TorchEngine.from_pretrained(str(MODEL), dtype="float64").generate(requests))
    drafted = [_with_draft(r, expected[r.key].token_ids) for r in requests]
    with FakeSGLangServer(MODEL, speculative_width=9) as fake:
        speculative = _by_key(_engine(fake, speculative=True, max_draft_tokens_per_step=8).generate(drafted))
        bodies = fake.bodies("/generate")
    assert {k: r.token_ids for k, r in speculative.items()} == {k: r.token_ids for k, r in expected.items()}
    for key, result in speculative.items():
        assert result.logprobs == pytest.approx(expected[key].logprobs, abs=1e-9)
    assert len(bodies) == 1 and all(p["custom_params"]["draft"] for p in bodies[0]["sampling_params"])
    plain_steps = sum(len(r.token_ids) for r in expected.values())
    assert sum(r.stats.decode_steps for r in speculative.values()) < 0.4 * plain_steps


def test_the_speculative_route_refuses_adaptive_lengths_and_launches_with_the_algorithm(server, monkeypatch):
    with pytest.raises(ConfigError, match="adaptive_draft_length must be off"):
        SGLangEngine.from_pretrained(str(MODEL), urls=[server.url], speculative=True, adaptive_draft_length=True)
    launched = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if SGLang were installed
    monkeypatch.setattr("subprocess.Popen", lambda command, **_: launched.append(command) or _Exited())
    with pytest.raises(SGLangError, match="exited"):
        SGLangEngine.from_pretrained(str(MODEL), launch=True, dtype="float32", speculative=True)
    flags = launched[0]
    assert flags[flags.index("--speculative-algorithm") + 1] == "BUBBLESPEC"
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "17"  # the root and 16 draft tokens


class _Exited:
    """A launched server process that has already exited."""

    def poll(self):
        return 1

    def terminate(self):
        pass

    def wait(self, timeout=None):
        return 1


# -- keyed sampling and verification --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}, {"temperature": 0.0}, {"temperature": 1.3, "top_p": 0.8}],
    ids=["t1", "t0.7-topk4", "greedy", "t1.3-topp0.8"],
)
@pytest.mark.parametrize("num_candidates", [3, 20])
def test_keyed_rollouts_equal_the_torch_engine_with_and_without_drafts(server, requests, params, num_candidates):
    requests = _with(requests[:8], max_new_tokens=40, **params)
    expected = _by_key(TorchEngine.from_pretrained(str(MODEL), dtype="float64").generate(requests))
    engine = _engine(server, top_logprobs_num=num_candidates, max_draft_tokens_per_step=6)
    plain = _by_key(engine.generate(requests))
    assert {k: r.token_ids for k, r in plain.items()} == {k: r.token_ids for k, r in expected.items()}
    for key, result in plain.items():
        assert result.logprobs == pytest.approx(expected[key].logprobs, abs=1e-9)
    for name in ("own", "reversed"):
        drafts = [plain[r.key].token_ids if name == "own" else plain[r.key].token_ids[::-1] for r in requests]
        drafted = _by_key(engine.generate([_with_draft(r, d) for r, d in zip(requests, drafts, strict=True)]))
        assert {k: r.token_ids for k, r in drafted.items()} == {k: r.token_ids for k, r in plain.items()}, name
    drafted = _by_key(engine.generate([_with_draft(r, plain[r.key].token_ids) for r in requests]))
    accepted = sum(r.stats.draft_tokens_accepted for r in drafted.values())
    complete = num_candidates >= engine.vocab_size
    assert accepted > 0 or ("top_p" in params and not complete), "top-p needs every candidate to decide a sample"
    if complete or params in ({"temperature": 1.0}, {"temperature": 0.0}):
        for key, result in drafted.items():  # exact logprobs; else renormalised over the K candidates
            assert result.logprobs == pytest.approx(plain[key].logprobs, abs=1e-9)


def test_every_generate_call_carries_the_keyed_processor(server, requests):
    server.log.clear()
    engine = _engine(server)
    engine.generate([_with_draft(requests[0], [3, 4, 5]), requests[1]])
    bodies = server.bodies("/generate")
    assert bodies
    for body in bodies:
        assert body["custom_logit_processor"] == [processor_payload("reference")] * len(body["input_ids"])
        for params in body["sampling_params"]:
            assert params["temperature"] == 0.0 and set(params["custom_params"]) >= {"seed0", "seed1", "offset"}
    verify = bodies[0]["sampling_params"][0]
    assert verify["max_new_tokens"] == 1 and verify["custom_params"]["offset"] == 3


@pytest.mark.skipif(importlib.util.find_spec("dill") is None, reason="processor: value needs dill")
def test_the_processor_travels_by_value_with_dill(server, requests):
    plain = _engine(server).generate(requests[:4])
    by_value = _engine(server, processor="value").generate(requests[:4])
    assert [r.token_ids for r in plain] == [r.token_ids for r in by_value]


# -- preemption, weights, failures ----------------------------------------------------------------------------------


def test_a_stop_during_a_call_aborts_it_and_returns_partial_responses(requests):
    with FakeSGLangServer(MODEL, token_delay_s=0.02) as slow:
        engine = _engine(slow, tokens_per_call=64)
        plain = _by_key(_engine(slow).generate(requests[:4]))
        stop, sent = threading.Event(), len(slow.bodies("/generate"))

        def stop_once_the_call_is_in_flight():  # an event, not a delay: the server has the request
            while len(slow.bodies("/generate")) == sent:
                time.sleep(0.005)
            stop.set()

        threading.Thread(target=stop_once_the_call_is_in_flight, daemon=True).start()
        started = time.monotonic()
        results = _by_key(engine.generate(requests[:4], stop=stop))
        assert time.monotonic() - started < 1.5
        rid = slow.bodies("/generate")[-1]["rid"][0].rsplit("-", 1)[0]
        assert slow.bodies("/abort_request") == [{"rid": rid}]
    assert any(r.finish_reason == "preempted" for r in results.values())
    for key, result in results.items():
        assert plain[key].token_ids[: len(result.token_ids)] == result.token_ids
        assert len(result.logprobs) == len(result.token_ids)


def test_a_weight_update_brackets_begin_and_end_and_gives_the_new_policy(requests, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(MODEL / "model.safetensors"))
    changed = {name: t * 1.05 if t.ndim == 2 else t for name, t in weights.items()}
    folder = tmp_path / "changed"
    shutil.copytree(MODEL, folder)
    save_file(changed, str(folder / "model.safetensors"))
    with FakeSGLangServer(MODEL) as fake, FakeSGLangServer(folder) as fresh:
        engine = _engine(fake, weights_dir=str(tmp_path / "weights"))
        before = engine.generate(requests)
        fake.log.clear()
        engine.update_weights(changed, version=3)
        endpoints = [path for _, path, _ in fake.log]
        assert endpoints == [
            "/pause_generation",
            "/begin_weight_update",
            "/update_weights_from_disk",
            "/end_weight_update",
            "/flush_cache",
            "/continue_generation",
        ]
        assert fake.bodies("/update_weights_from_disk")[0]["weight_version"] == "3"
        after, expected = engine.generate(requests), _engine(fresh).generate(requests)
    assert engine.policy_version == 3 and not fake.session_open
    assert [r.token_ids for r in after] == [r.token_ids for r in expected] != [r.token_ids for r in before]


def test_a_refused_weight_update_names_rank_url_and_endpoint(server, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the engine's own weights folder goes
    server.session_open = True  # someone else's session: begin is refused
    try:
        with pytest.raises(SGLangError, match=r"rank 0, http://127\.0\.0\.1:\d+/begin_weight_update: HTTP 400"):
            _engine(server).update_weights({}, version=1)
    finally:
        server.session_open = False
    assert server.bodies("/continue_generation"), "generation was left paused"
    assert not list(tmp_path.iterdir()), "the weights folder it made was left behind"
    _engine(server).update_weights({}, version=1)
    assert not list(tmp_path.iterdir()), "the weights folder it made was left behind"


def test_an_unreachable_url_fails_within_the_bounded_wait():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket closes
    started = time.monotonic()
    with pytest.raises(SGLangError, match=rf"rank 3, http://127\.0\.0\.1:{port}/health_generate is not reachable"):
        SGLangEngine.from_pretrained(str(MODEL), urls=[f"http://127.0.0.1:{port}"], rank=3, connect_timeout_s=1)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("failure", ["500", "close"])
def test_a_server_that_dies_mid_request_raises_naming_rank_and_backend(server, requests, failure):
    engine = _engine(server)
    server.fail_generate = failure
    with pytest.raises(SGLangError, match=r"sglang backend, rank 0, .*/generate"):
        engine.generate(requests[:2])


def test_settings_are_checked_with_clear_errors(server):
    with pytest.raises(ConfigError, match="colour.*Extra inputs are not permitted.*valid settings: .*urls"):
        SGLangEngine.from_pretrained(str(MODEL), urls=[server.url], colour="blue")
    with pytest.raises(ConfigError, match="exactly one of them"):
        SGLangEngine.from_pretrained(str(MODEL))
    with pytest.raises(ConfigError, match="verification: Input should be 'coupled'"):
        SGLangEngine.from_pretrained(str(MODEL), urls=[server.url], verification="one_hot")
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ConfigError, match=r"pip install 'bubblespec\[sglang\]'"):
            SGLangEngine.from_pretrained(str(MODEL), launch=True, dtype="float32")
    engine = SGLangEngine.from_pretrained(str(MODEL), urls=["http://nowhere.invalid", server.url], rank=1)
    assert engine.url == server.url


# -- a real SGLang server (scripts/sglang_real_test.sh) -------------------------------------------------------------

needs_real_server = pytest.mark.skipif(
    REAL_URL is None, reason="set BUBBLESPEC_SGLANG_URL to a running SGLang 0.5.23 server (scripts/sglang_real_test.sh)"
)


@needs_real_server
def test_real_sglang_server(requests):
    engine = SGLangEngine.from_pretrained(str(MODEL), urls=[REAL_URL], dtype="float32", connect_timeout_s=60)
    plain = _by_key(engine.generate(requests))
    drafted = _by_key(engine.generate([_with_draft(r, plain[r.key].token_ids) for r in requests]))
    differing = [k for k in plain if plain[k].token_ids != drafted[k].token_ids]
    assert len(differing) <= 1, f"drafts changed {len(differing)} of {len(plain)} responses"
    torch_outputs = _by_key(TorchEngine.from_pretrained(str(MODEL), dtype="float32").generate(requests))
    agree = sum(plain[k].token_ids == torch_outputs[k].token_ids for k in plain)
    assert agree >= len(plain) - 2, f"only {agree} of {len(plain)} responses agree with the torch engine"
    from safetensors.torch import load_file

    weights = load_file(str(MODEL / "model.safetensors"))
    engine.update_weights({n: t * 1.05 if t.ndim == 2 else t for n, t in weights.items()}, version=1)
    changed = _by_key(engine.generate(requests))
    engine.update_weights(weights, version=2)
    restored = _by_key(engine.generate(requests))
    assert any(changed[k].token_ids != plain[k].token_ids for k in plain), "the weight update changed nothing"
    assert sum(restored[k].token_ids == plain[k].token_ids for k in plain) >= len(plain) - 1
    engine.release()
    engine.resume()
    assert torch.isfinite(torch.tensor([p for r in restored.values() for p in r.logprobs])).all()


@needs_real_server
class TestSGLangEngineOnARealServer(EngineConformance):
    """The suite on one real server (float32 logits: a rounding near-tie may flip a token)."""

    unsupported_sampling = UNSUPPORTED_SAMPLING  # refused by name (backends/sglang_engine.py)
    dtype = "float32"
    max_mismatch_rate = 0.07
    engine_settings = {"tokens_per_call": 4}

    def make_engine(self, model_path: Path):
        return SGLangEngine.from_pretrained(str(model_path), urls=[REAL_URL], dtype=self.dtype, **self.engine_settings)

    def test_a_weight_update_gives_the_new_policy(self):
        pytest.skip("one server cannot also serve the changed weights; test_real_sglang_server checks updates")


@pytest.mark.skipif(
    REAL_SPECULATIVE_URL is None,
    reason="set BUBBLESPEC_SGLANG_SPECULATIVE_URL to a real SGLang 0.5.23 server running --speculative-algorithm "
    "BUBBLESPEC --speculative-num-draft-tokens 9 (scripts/sglang_real_test.sh)",
)
class TestSGLangEngineSpeculativeOnARealServer(EngineConformance):
    """The speculative route on a real server: SGLang's own NGRAM worker classes with bubblespec's drafts and keyed
    verify rows (backends/sglang_server.py), which no test here can run."""

    unsupported_sampling = UNSUPPORTED_SAMPLING  # refused by name (backends/sglang_engine.py)
    dtype = "float32"
    max_mismatch_rate = 0.07
    engine_settings = {"speculative": True, "max_draft_tokens_per_step": 8}

    def make_engine(self, model_path: Path):
        url = REAL_SPECULATIVE_URL
        return SGLangEngine.from_pretrained(str(model_path), urls=[url], dtype=self.dtype, **self.engine_settings)

    def test_a_weight_update_gives_the_new_policy(self):
        pytest.skip("one server cannot also serve the changed weights; test_real_sglang_server checks updates")

    test_stop_returns_within_one_forward_pass_with_partial_responses = None  # one round trip is every response

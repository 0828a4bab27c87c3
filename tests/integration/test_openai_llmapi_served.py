"""stoker's OpenAI service, as its own process started with ``--interface llmapi``, in front of a real tritonserver
serving a scripted model with the contract of TensorRT-LLM's LLM-API python model (the `llmapi` layout's
`tensorrt_llm`: the config.pbtxt stoker renders, stoker/gpu/llmapi.py), driven by the official `openai` client.

The scripted model behaves as TensorRT-LLM 1.2.1's llmapi model.py does in streaming mode: it answers a fixed text,
one word more per response, each response carrying the WHOLE output so far (``RequestOutput.outputs[0].text``),
``finish_reason`` "None" until the last response, then "length" (``sampling_param_max_tokens`` words reached) or
"stop" (the text ran out: its end id). It puts the prompt in front unless
``sampling_param_exclude_input_from_output`` is true, and refuses a request that does not stream. Every request's
inputs are logged, so the tests see what the service sent.
"""

from __future__ import annotations

import json

import pytest
from google.protobuf import text_format
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from openai_process import openai_service

from stoker.gpu import llmapi

pytestmark = [pytest.mark.triton]

openai = pytest.importorskip("openai")
pytest.importorskip("pytriton")

MODEL = "tiny-llmapi"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "name colours"}]

MODEL_PY = '''
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
HERE = os.path.dirname(os.path.abspath(__file__))


def _value(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    values = [v.decode() if isinstance(v, bytes) else v.item() for v in t.as_numpy().reshape(-1)]
    if name in ("sampling_param_stop",):
        return values
    if len(values) != 1:
        raise pb_utils.TritonModelException(f"Expected a scalar tensor for tensor {name}")
    return values[0]


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(HERE, "script.json")) as f:
            s = json.load(f)
        self.words, self.interval, self.inputs = s["words"], s["interval_s"], s["inputs"]
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            got = {n: _value(request, n) for n in self.inputs}
            got = {n: v for n, v in got.items() if v is not None}
            with self.lock, open(os.path.join(HERE, "requests.jsonl"), "a") as f:
                f.write(json.dumps(got) + "\\n")
            threading.Thread(target=self._serve, args=(got, request.get_response_sender()), daemon=True).start()
        return None

    def _response(self, text, finish, with_finish):
        out = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        if with_finish:
            out.append(pb_utils.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=out)

    def _serve(self, got, sender):
        if not got.get("streaming"):
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("this script streams only")),
                        flags=FINAL)
            return
        max_tokens = int(got.get("sampling_param_max_tokens", 32))
        count = min(max_tokens, len(self.words))
        finish = "length" if max_tokens < len(self.words) else "stop"
        prefix = "" if got.get("sampling_param_exclude_input_from_output") else got["text_input"]
        with_finish = bool(got.get("return_finish_reason"))
        for k in range(1, count + 1):
            time.sleep(self.interval)
            if sender.is_cancelled():
                sender.send(flags=FINAL)
                return
            last = k == count
            text = prefix + " ".join(self.words[:k])
            sender.send(self._response(text, finish if last else "None", with_finish), flags=FINAL if last else 0)
'''


def _tokenizer() -> Tokenizer:
    """A word-level tokenizer that adds a BOS, as Llama's does: one token per word of the script."""
    specials = ["<unk>", "<s>", "</s>"]
    extra = ["<|system|>", "<|user|>", "<|assistant|>", "be", "terse", "name", "colours", "once", "upon"]
    vocab = {w: i for i, w in enumerate(specials + WORDS + extra)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from stoker.stack import local_triton

    root = tmp_path_factory.mktemp("llmapi")
    repo = root / "repo"
    version = repo / llmapi.MODEL_NAME / "1"
    version.mkdir(parents=True)
    from stoker.spec.load import parse_spec

    # The inputs and outputs stoker renders for the llmapi layout, decoupled (as model.yaml's triton_config says).
    cfg = llmapi.config(parse_spec({"model": {"repo_id": "a/b"}, "storage": {"bucket": "unused"}, "target": "pytorch",
                                    "gpus": {"type": "h100-80gb", "count": 1}}))
    assert cfg.model_transaction_policy.decoupled
    (repo / llmapi.MODEL_NAME / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    (version / "model.py").write_text(MODEL_PY)
    (version / "script.json").write_text(json.dumps({"words": WORDS, "interval_s": 0.01,
                                                     "inputs": [n for n, _t, _o in llmapi.LLMAPI_IN]}))
    assets = root / "assets"
    assets.mkdir()
    tok = _tokenizer()
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (assets / "config.json").write_text(json.dumps({"max_position_embeddings": 256,
                                                    "vocab_size": tok.get_vocab_size()}))
    (assets / "chat_template.jinja").write_text(TEMPLATE)
    server = local_triton.start(repo, local_triton.pick_free_ports(), root / "tritonserver.log", auto_complete=True)
    try:
        with openai_service(MODEL, server.grpc_url, assets, log=root / "openai.log",
                            extra_args=("--interface", "llmapi")) as (base, _proc):
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=30)
            yield {"client": client, "log": version / "requests.jsonl", "tok": tok}
    finally:
        server.stop(deadline_s=10)


def _last_request(served) -> dict:
    return json.loads(served["log"].read_text().splitlines()[-1])


def _tokens(served, text: str, special: bool = False) -> int:
    return len(served["tok"].encode(text, add_special_tokens=special).ids)


def test_completion_greedy_non_streamed_sends_the_llm_api_inputs(served):
    r = served["client"].completions.create(model=MODEL, prompt="once upon", max_tokens=3, temperature=0)
    assert r.choices[0].text == "alpha beta gamma" and r.choices[0].finish_reason == "length"
    sent = _last_request(served)
    assert sent["text_input"] == "once upon"
    assert sent["streaming"] is True and sent["sampling_param_max_tokens"] == 3
    assert sent["sampling_param_exclude_input_from_output"] is True and sent["return_finish_reason"] is True
    assert sent["sampling_param_top_k"] == 1  # greedy: top_k 1, no temperature, no top_p
    assert not {"sampling_param_temperature", "sampling_param_top_p", "sampling_param_stop"} & set(sent)
    # usage: the prompt as the model's tokenizer reads it (its BOS included), the text returned re-encoded
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 3, 6)


def test_completion_streamed_takes_the_new_part_of_each_cumulative_response(served):
    chunks = list(served["client"].completions.create(model=MODEL, prompt="once", max_tokens=20, stream=True,
                                                      stream_options={"include_usage": True}, temperature=0.7,
                                                      top_p=0.9, seed=5))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == " ".join(WORDS)  # each word once: the whole output so far came every time
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= len(WORDS) - 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]  # the text ran out before max_tokens: the model's end id
    assert chunks[-1].usage.prompt_tokens == 2 and chunks[-1].usage.completion_tokens == len(WORDS)
    sent = _last_request(served)
    assert sent["sampling_param_temperature"] == pytest.approx(0.7) and sent["sampling_param_top_p"] == pytest.approx(0.9)
    assert sent["sampling_param_seed"] == 5 and "sampling_param_top_k" not in sent


def test_chat_applies_the_template_here_and_sends_text(served):
    r = served["client"].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].message.content == "alpha beta" and r.choices[0].finish_reason == "length"
    prompt = _last_request(served)["text_input"]
    # The template writes the BOS; the model's tokenizer adds one too, so the text goes without it (one BOS read).
    assert prompt == "<|system|> be terse </s> <|user|> name colours </s> <|assistant|>"
    assert r.usage.prompt_tokens == _tokens(served, prompt, special=True) and r.usage.completion_tokens == 2


def test_chat_streamed(served):
    chunks = list(served["client"].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
                                                           stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "alpha beta gamma delta epsilon"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_are_cut_here_and_not_sent_to_the_model(served, stream):
    args = dict(model=MODEL, prompt="once", max_tokens=20, stop=["gamma", "delta x"])
    if stream:
        pieces = [c.choices[0] for c in served["client"].completions.create(**args, stream=True) if c.choices]
        text, finish = "".join(p.text for p in pieces), [p.finish_reason for p in pieces if p.finish_reason]
        assert all("gam" not in p.text for p in pieces)
    else:
        r = served["client"].completions.create(**args)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
    assert text == "alpha beta " and finish == ["stop"]
    assert "sampling_param_stop" not in _last_request(served)
    # A possible stop sequence's start ("delta" of "delta x") is held back, then let out when it is not one.
    r = served["client"].completions.create(model=MODEL, prompt="once", max_tokens=5, stop=["delta x"])
    assert r.choices[0].text == "alpha beta gamma delta epsilon" and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra", [{"min_tokens": 2}, {"ignore_eos": True}])
def test_min_tokens_and_ignore_eos_are_refused(served, extra):
    with pytest.raises(openai.BadRequestError) as err:
        served["client"].completions.create(model=MODEL, prompt="once", max_tokens=4, extra_body=extra)
    body = err.value.body
    assert body["code"] == "unsupported_parameter" and body["param"] == next(iter(extra))
    assert "LLM-API" in body["message"]


def test_token_id_prompts_are_refused(served):
    with pytest.raises(openai.BadRequestError) as err:
        served["client"].completions.create(model=MODEL, prompt=[3, 4], max_tokens=4)
    assert err.value.body["param"] == "prompt"

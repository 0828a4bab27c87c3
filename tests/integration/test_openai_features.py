"""The OpenAI features applications call (issue 50) on the real tritonserver serving the tiny Llama's reference
build (xgrammar in the venv, as in Triton's CPU image), stoker's OpenAI service as its own process in front, asked by
the official `openai` client. One server for the module: each test asks it something else. The same features
through a deployment's stable address, over TLS and with a key, are test_openai_deployment's; on an adapter,
test_lora_served's; on the engine target's contract (the stand-in), test_lora_served's engine test.

Log probs: chat's `logprobs` / `top_logprobs` and completions' `logprobs`, streamed and not, against transformers.
Greedy decoding, so each token's log prob is transformers' log_softmax of the model's own logits at that position
(stoker/runtime/generate.py) and the alternatives are that row's top k, within 1e-4.

Structured outputs: `response_format` json_schema (strict) and json_object, streamed and not, constrained token by
token by xgrammar inside the Triton model's in-flight batcher; free requests decoded beside constrained ones answer
as they do alone. Tool calls: forced ones parse, name a declared function and validate; a result goes back through
the template. Penalties, logit_bias, n and seed: against transformers' logits under TensorRT-LLM's rule. Bad values
are 400s in OpenAI's shape naming the field, and nothing else is affected.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from openai_process import TOOLS_TEMPLATE, tiny_model_served

pytestmark = [pytest.mark.triton, pytest.mark.slow]
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
TOL = 1e-4
TOP = 5
MESSAGES = [{"role": "user", "content": "Name a colour."}]
JSON_MESSAGES = [{"role": "user", "content": "Name a colour, as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["colour", "bright", "name"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """The tiny Llama's reference build on a local tritonserver with the OpenAI service; transformers' model beside."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("oa-features")
    with tiny_model_served(root, chat_template=TOOLS_TEMPLATE) as (_server, artifact, base):
        model = transformers.LlamaForCausalLM.from_pretrained(root / "ckpt", dtype=torch.float32).eval()
        yield {"api": openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120), "name": "tiny",
               "model": model, "tok": Tokenizer.from_file(str(artifact / "tokenizer.json"))}


def _expected(d, prompt_ids: list[int], n: int):
    """transformers' greedy tokens after ``prompt_ids``, each one's log prob and its row's top TOP (ids, values)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = d["model"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
        tokens = out[0, len(prompt_ids):].tolist()
        logits = d["model"](input_ids=out).logits[0, len(prompt_ids) - 1: -1].float()
    rows = torch.log_softmax(logits, -1)
    chosen = rows[torch.arange(len(tokens)), tokens]
    return tokens, chosen.tolist(), torch.topk(rows, TOP)


def _text(d, token: int) -> str:
    return d["tok"].decode([token], skip_special_tokens=False)


def test_chat_logprobs_are_transformers_log_softmax_streamed_and_not(deployed):
    d = deployed
    ask = dict(model=d["name"], messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=TOP)
    whole = d["api"].chat.completions.create(**ask)
    # TOOLS_TEMPLATE without tools: the fallback template's text, BOS included
    prompt = d["tok"].encode("user: Name a colour.\nassistant:").ids
    assert whole.usage.prompt_tokens == len(prompt)
    content = whole.choices[0].logprobs.content
    tokens, chosen, top = _expected(d, prompt, len(content))
    # The served answer holds back the end id (TensorRT-LLM's rule) that transformers' output may end with.
    assert len(content) == whole.usage.completion_tokens and len(content) <= len(tokens)
    for i, entry in enumerate(content):
        assert entry.token == _text(d, tokens[i])
        # bytes: the token's own (byte-level BPE), the text's unless the token ends inside a character
        assert "\ufffd" in entry.token or bytes(entry.bytes).decode("utf-8") == entry.token
        assert entry.logprob == pytest.approx(chosen[i], abs=TOL)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values[i].tolist(), abs=TOL)
        assert [t.token for t in entry.top_logprobs] == [_text(d, t) for t in top.indices[i].tolist()]
    chunks = list(d["api"].chat.completions.create(**ask, stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices
                if choice.logprobs is not None and choice.logprobs.content for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)
    # Without logprobs the answer is the same greedy text, and carries none.
    plain = d["api"].chat.completions.create(model=d["name"], messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_completion_logprobs_in_openais_legacy_shape(deployed):
    d = deployed
    prompt = d["tok"].encode(PROMPT).ids
    for stream in (False, True):
        ask = dict(model=d["name"], prompt=prompt, max_tokens=8, temperature=0, logprobs=TOP)
        if stream:
            got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for chunk in d["api"].completions.create(**ask, stream=True):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    for key in got:
                        got[key] += getattr(chunk.choices[0].logprobs, key)
        else:
            got = d["api"].completions.create(**ask).choices[0].logprobs.model_dump()
        tokens, chosen, top = _expected(d, prompt, len(got["tokens"]))
        assert got["tokens"] == [_text(d, t) for t in tokens[:len(got["tokens"])]]
        assert got["token_logprobs"] == pytest.approx(chosen[:len(got["tokens"])], abs=TOL)
        for i, alternatives in enumerate(got["top_logprobs"]):
            want = {_text(d, t): v for t, v in zip(top.indices[i].tolist(), top.values[i].tolist())}
            assert set(want) <= set(alternatives) and len(alternatives) <= TOP + 1
            assert [alternatives[k] for k in want] == pytest.approx(list(want.values()), abs=TOL)
        assert got["text_offset"][0] == 0
        assert all(b - a == len(t) for a, b, t in zip(got["text_offset"], got["text_offset"][1:], got["tokens"]))


@pytest.mark.parametrize("route, ask, param", [
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("chat", dict(logprobs="yes"), "logprobs"),
    ("completions", dict(logprobs=6), "logprobs"),
    ("completions", dict(logprobs=True), "logprobs"),
])
def test_bad_log_prob_requests_are_400s_naming_the_field(deployed, route, ask, param):
    d = deployed
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            d["api"].chat.completions.create(model=d["name"], messages=MESSAGES, max_tokens=2, **ask)
        else:
            d["api"].completions.create(model=d["name"], prompt=PROMPT, max_tokens=2, **ask)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body


# ---------------------------------------------------------------- structured outputs


def test_json_schema_strict_streamed_and_not_parses_and_validates(deployed) -> None:
    client, model = deployed["api"], deployed["name"]
    out = client.chat.completions.create(model=model, messages=JSON_MESSAGES, max_tokens=120, temperature=0,
                                         response_format=FORMAT)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)

    chunks = list(client.completions.create(model=model, prompt="A colour as JSON:", max_tokens=120, temperature=0.9,
                                            seed=7, stream=True, extra_body={"response_format": FORMAT}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)

    streamed = client.chat.completions.create(model=model, messages=JSON_MESSAGES, max_tokens=120, temperature=0,
                                              response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content


def test_json_object_answers_an_object(deployed) -> None:
    client, model = deployed["api"], deployed["name"]
    out = client.chat.completions.create(model=model, messages=JSON_MESSAGES, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # ran out of tokens inside the object: still its beginning
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_free_requests_beside_constrained_ones_answer_as_alone(deployed) -> None:
    client, model = deployed["api"], deployed["name"]

    def free():
        return client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0).choices[0].text

    def guided():
        return client.chat.completions.create(model=model, messages=JSON_MESSAGES, max_tokens=120, temperature=0,
                                              response_format=FORMAT).choices[0].message.content

    alone = free()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(guided if i % 2 else free) for i in range(6)]
        results = [f.result() for f in futures]
    assert results[0::2] == [alone] * 3
    for text in results[1::2]:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("schema, words", [
    ({"type": "nonsense"}, "nonsense"),  # refused by xgrammar in the Triton model, turned into a 400 by the service
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"$ref": "#/$defs/x"}}}, "loops"),
])
def test_a_schema_that_cannot_be_used_is_a_400_naming_the_field(deployed, schema, words) -> None:
    client, model = deployed["api"], deployed["name"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=JSON_MESSAGES, max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert words in err.value.body["message"]
    # Nothing else is affected.
    assert client.chat.completions.create(model=model, messages=JSON_MESSAGES, max_tokens=4, temperature=0).choices


# ---------------------------------------------------------------- tool calls (issue 50 item 2)

PAINT = {"type": "function", "function": {"name": "paint", "description": "Paint the wall.", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "coats": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 3}},
    "required": ["colour", "coats"], "additionalProperties": False}}}
LIGHT = {"type": "function", "function": {"name": "light", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}
TOOLS = [PAINT, LIGHT]
ASK_TOOL = [{"role": "user", "content": "Paint it."}]


def _check_calls(calls) -> None:
    """Every call names a declared function and its arguments are valid against that function's schema."""
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "paint"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_parses_and_names_a_declared_function(deployed, choice) -> None:
    d = deployed
    ask = dict(model=d["name"], messages=ASK_TOOL, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0,
               parallel_tool_calls=False)
    whole = d["api"].chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    _check_calls(whole.message.tool_calls)
    assert len(whole.message.tool_calls) == 1
    if isinstance(choice, dict):
        assert whole.message.tool_calls[0].function.name == "paint"
    # Streamed: the official client's stream helper assembles the deltas into the same call.
    with d["api"].chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_a_tool_result_goes_back_through_the_template(deployed) -> None:
    d = deployed
    first = d["api"].chat.completions.create(model=d["name"], messages=ASK_TOOL, tools=TOOLS, max_tokens=120,
                                             tool_choice={"type": "function", "function": {"name": "paint"}},
                                             temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK_TOOL, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "painted"}]
    out = d["api"].chat.completions.create(model=d["name"], messages=history, tools=TOOLS, max_tokens=4,
                                           temperature=0)
    # The prompt is the template's rendering of the call (its arguments as an object, not a JSON string) and the
    # result: counted here from the same template through transformers' renderer.
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered = render_jinja_template([[
        ASK_TOOL[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "paint",
                                                             "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "painted"}]],
        chat_template=TOOLS_TEMPLATE, tools=TOOLS, add_generation_prompt=True, bos_token="<s>")[0][0]
    assert '<tool_call>{"name": "paint", "arguments": {"colour": ' in rendered and "tool: painted\n" in rendered
    assert out.usage.prompt_tokens == len(d["tok"].encode(rendered, add_special_tokens=False).ids)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_requests_are_400s_naming_the_field(deployed) -> None:
    d = deployed
    cases = [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice"),
             (dict(tool_choice="required"), "tool_choice"),
             (dict(tools=[PAINT, PAINT]), "tools[1].function.name"),
             (dict(tools=TOOLS, tool_choice="required", response_format=FORMAT), "tool_choice"),
             (dict(tools=TOOLS, n=2), "n")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            d["api"].chat.completions.create(model=d["name"], messages=ASK_TOOL, max_tokens=2, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)
        assert "\n" not in err.value.body["message"]


# ---------------------------------------------------------------- penalties, logit_bias, n, seed (issue 50 item 4)


def test_n_choices_each_reproduced_by_its_own_seed(deployed) -> None:
    """Choice i samples with seed + i: the same request repeats every choice, and an n = 1 request with seed + i
    is choice i (each choice its own sequence in the in-flight batch)."""
    d = deployed
    ask = dict(model=d["name"], prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234)
    many = d["api"].completions.create(n=3, **ask)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    assert [c.text for c in d["api"].completions.create(n=3, **ask).choices] == texts
    assert [d["api"].completions.create(**{**ask, "seed": 1234 + i}).choices[0].text for i in range(3)] == texts
    single = [d["api"].completions.create(**{**ask, "seed": 1234 + i}) for i in range(3)]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    assert many.usage.prompt_tokens == single[0].usage.prompt_tokens
    # Streamed: every chunk names its choice; put together per index they are the same texts.
    got: dict[int, str] = {}
    finished = set()
    for chunk in d["api"].chat.completions.create(model=d["name"], messages=MESSAGES, max_tokens=6, temperature=1.0,
                                                  seed=99, n=2, stream=True):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    whole = d["api"].chat.completions.create(model=d["name"], messages=MESSAGES, max_tokens=6, temperature=1.0,
                                             seed=99, n=2)
    assert finished == {0, 1} and [got[0], got[1]] == [c.message.content for c in whole.choices]


def _greedy_with(d, prompt_ids: list[int], n: int, bias: dict[int, float], presence: float, frequency: float):
    """Greedy tokens from transformers' logits with TensorRT-LLM's rule (penaltyKernels.cu, as the reference runtime
    follows it): bias added, then each token seen c > 0 times in prompt and output loses presence + c * frequency."""
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            logits = d["model"](input_ids=torch.tensor([ids])).logits[0, -1].float()
        for token, value in bias.items():
            logits[token] += value
        counts = torch.bincount(torch.tensor(ids), minlength=logits.shape[0]).float()
        logits -= (counts > 0).float() * presence + counts * frequency
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


def test_penalties_and_logit_bias_follow_the_engines_rule(deployed) -> None:
    d = deployed
    prompt = d["tok"].encode(PROMPT).ids
    ask = dict(model=d["name"], prompt=prompt, max_tokens=6, temperature=0, logprobs=0, extra_body={"min_tokens": 6})

    def tokens(**extra) -> list[str]:  # each token's text, as the legacy log probs name them
        return d["api"].completions.create(**{**ask, **extra}).choices[0].logprobs.tokens

    def texts(ids: list[int]) -> list[str]:
        return [_text(d, t) for t in ids]

    expected = _greedy_with(d, prompt, 6, {}, 0.0, 0.0)
    assert tokens() == texts(expected)
    banned = expected[0]
    assert tokens(logit_bias={str(banned): -100}) == texts(_greedy_with(d, prompt, 6, {banned: -100.0}, 0.0, 0.0))
    assert tokens(logit_bias={str(banned): -100})[0] != _text(d, banned)
    forced = 300  # any id of the tiny vocabulary (2048)
    assert tokens(logit_bias={str(forced): 100}) == texts([forced] * 6)
    assert tokens(presence_penalty=1.5, frequency_penalty=0.5) == texts(_greedy_with(d, prompt, 6, {}, 1.5, 0.5))
    assert tokens(presence_penalty=1.5, frequency_penalty=0.5) != tokens()  # the penalty changed the answer here


def test_bad_sampling_requests_are_400s_naming_the_field(deployed) -> None:
    d = deployed
    for extra, param in [(dict(n=9), "n"), (dict(presence_penalty=2.5), "presence_penalty"),
                         (dict(logit_bias={"999999": 1}), "logit_bias"), (dict(logit_bias={"1": 101}), "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as err:
            d["api"].completions.create(model=d["name"], prompt=PROMPT, max_tokens=2, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)

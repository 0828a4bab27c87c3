"""Tool calls in the OpenAI service (stoker/openai_api/tools.py): the request's checks, the model's chat template given
the tools and the tool messages (three template families), the forced call's guide compiled by xgrammar, the
parsers of free output, and the answer as the official openai client reads it, whole and streamed."""

from __future__ import annotations

import json

import pytest

from stoker.openai_api import mapping as m
from stoker.openai_api import tools
from stoker.openai_api.served_model import render_chat

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

# Short templates in the three families' styles (data, not the models' own): where the tools go, how an assistant's
# calls and a tool's result are written.
LLAMA = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nCall a function as "
    '{"name": ..., "parameters": ...}:{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- for c in m.tool_calls %}"
    '<|python_tag|>{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
QWEN = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant{%- for c in m.tool_calls %}\n<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
MISTRAL = (
    "{{- bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    "{%- if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    '{%- endif %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{{ ", " if not loop.last }}{%- endfor %}]{{ eos_token }}'
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, "
    "\"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}{{ eos_token }}{%- endif %}"
    "{%- endfor %}")
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def _use(**kw) -> tools.ToolUse:
    return tools.parse_tools(_chat(**kw))


# ---------------------------------------------------------------- the request's checks


@pytest.mark.parametrize("body, param", [
    (_chat(tools={"type": "function"}), "tools"),
    (_chat(tools=["f"]), "tools[0]"),
    (_chat(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0].function.name"),
    (_chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]),
     "tools[0].function.description"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools[0].function.parameters"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
     "tools[0].function.parameters"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}]),
     "tools[0].function.parameters"),
    (_chat(tools=[WEATHER, TIME, WEATHER]), "tools[2].function.name"),
    (_chat(tools=[WEATHER], tool_choice="always"), "tool_choice"),
    (_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice"),
    (_chat(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice"),
    (_chat(tool_choice="auto"), "tool_choice"),
    (_chat(tools=[], tool_choice="none"), "tool_choice"),
    (_chat(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
])
def test_bad_tool_fields_are_400s_naming_the_field(body, param):
    m.parse_chat(body)  # the rest of the request is fine
    with pytest.raises(m.ApiError) as err:
        tools.parse_tools(body)
    assert (err.value.status, err.value.param) == (400, param), err.value.message
    assert "\n" not in err.value.message


def test_the_deprecated_functions_spelling_stays_refused():
    for field, value in (("functions", [{"name": "f"}]), ("function_call", "auto")):
        with pytest.raises(m.ApiError) as err:
            m.parse_chat(_chat(**{field: value}))
        assert (err.value.param, err.value.code) == (field, "unsupported_parameter")


def test_tool_use_defaults_and_choices():
    assert tools.parse_tools(_chat()) is None and tools.parse_tools(_chat(tools=[])) is None
    auto = _use(tools=[WEATHER])
    assert (auto.choice, auto.parallel, auto.active, auto.forced) == ("auto", True, True, False)
    assert _use(tools=[WEATHER], parallel_tool_calls=None, tool_choice=None) == auto
    assert _use(tools=[WEATHER], tool_choice="none").template_tools() is None
    named = _use(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 parallel_tool_calls=False)
    assert (named.choice, named.named, named.parallel, named.forced) == ("function", "get_time", False, True)


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": "{oops"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": ["f"]}, "messages[1].tool_calls[0]"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls"),
    ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c1"}, "messages[1].content"),
])
def test_bad_tool_messages_are_400s_naming_the_field(message, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, message]}
    with pytest.raises(m.ApiError) as err:
        tools.messages(m.parse_chat(body))
    assert (err.value.status, err.value.param) == (400, param), err.value.message


# ---------------------------------------------------------------- the chat template


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "AbC123xyZ", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "AbC123xyZ", "content": "sunny, 21"},
]


def _render(template: str, history=HISTORY, use=None) -> str:
    use = use or _use(tools=[WEATHER, TIME])
    req = m.parse_chat({"model": "tiny", "messages": history})
    return render_chat(template, tools.messages(req), SPECIAL, use.template_tools())


def test_the_messages_carry_parsed_arguments_and_the_tool_calls_name():
    req = m.parse_chat({"model": "tiny", "messages": HISTORY})
    msgs = tools.messages(req)
    assert msgs[1]["tool_calls"] == [{"id": "AbC123xyZ", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]
    assert msgs[2] == {"role": "tool", "content": "sunny, 21", "tool_call_id": "AbC123xyZ", "name": "get_weather"}


@pytest.mark.parametrize("template, call, result", [
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
     "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21"),
    (QWEN, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>',
     "<tool_response>sunny, 21</tool_response>"),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}, "id": "AbC123xyZ"}]',
     '[TOOL_RESULTS]{"content": "sunny, 21", "call_id": "AbC123xyZ"}[/TOOL_RESULTS]'),
])
def test_each_family_renders_the_tools_the_calls_and_the_results(template, call, result):
    text = _render(template)
    assert json.dumps(WEATHER["function"]["parameters"]) in text and '"get_time"' in text  # the tools, as sent
    assert call in text and result in text


def test_tool_choice_none_gives_the_template_no_tools():
    text = _render(QWEN, use=_use(tools=[WEATHER], tool_choice="none"))
    assert "<tools>" not in text and "<tool_call>" in text  # the history's call is still written


def test_a_template_that_never_reads_tools_refuses_them():
    assert tools.template_refusal(_use(tools=[WEATHER]), QWEN) is None
    assert tools.template_refusal(_use(tools=[WEATHER], tool_choice="none"), PLAIN) is None
    for template in (PLAIN, None):
        err = tools.template_refusal(_use(tools=[WEATHER]), template)
        assert (err.status, err.param, err.code) == (400, "tools", "unsupported_parameter")


# ---------------------------------------------------------------- the guide


def test_a_forced_choice_is_a_guide_and_response_format_or_the_llm_api_refuse_it():
    required = _use(tools=[WEATHER], tool_choice="required")
    g = tools.guide(required, None)
    assert (g.type, g.param) == ("json_schema", "tools") and json.loads(g.text)["minItems"] == 1
    assert tools.guide(_use(tools=[WEATHER]), None) is None  # auto: free output
    fmt = tools.Guide("json_schema", "{}")
    assert tools.guide(_use(tools=[WEATHER]), fmt) is fmt
    for args in ((required, fmt), (required, None, True)):
        with pytest.raises(m.ApiError) as err:
            tools.guide(*args)
        assert err.value.param == "tool_choice"


def _accepts(schema: dict):
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from stoker.runtime.guided import _json_schema_ebnf  # what the reference runtime compiles a schema to

    grammar = xgrammar.Grammar.from_ebnf(_json_schema_ebnf(json.dumps(schema)))
    # xgrammar's JSON without free whitespace is json.dumps' own: ", " and ": "
    return lambda value: _is_grammar_accept_string(grammar, json.dumps(value))


def _call(name, **arguments):
    return {"name": name, "arguments": arguments}


def test_the_guides_compile_and_admit_only_declared_calls():
    weather, time_ = _call("get_weather", city="Oslo", unit="c"), _call("get_time", zone="utc")
    named = _accepts(tools.call_schema(_use(tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})))
    assert named(time_) and not named(weather) and not named(_call("get_time", zone="pst"))
    assert not named(_call("rm_rf", zone="utc")) and not named([time_])
    one = _accepts(tools.call_schema(_use(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)))
    assert one(weather) and one(time_) and not one([weather]) and not one(_call("get_wether", city="x", unit="c"))
    many = _accepts(tools.call_schema(_use(tools=[WEATHER, TIME], tool_choice="required")))
    assert many([weather]) and many([weather, time_]) and not many([]) and not many(weather)
    assert not many([_call("undeclared", zone="utc")])


# ---------------------------------------------------------------- parsing the output


@pytest.mark.parametrize("template, text, content", [
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}', None),
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}', None),
    (QWEN, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>', None),
    (QWEN, 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}',
     "Let me look."),  # no closing tag: the output ended right after the call
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]', None),  # [TOOL_CALLS] dropped
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"unit\\": \\"c\\"}"}]',
     None),
    (PLAIN, '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}', None),
])
def test_free_output_in_each_familys_format_is_a_call(template, text, content):
    assert tools.parse(text, _use(tools=[WEATHER]), template) == (
        content, [tools.Call("get_weather", {"city": "Oslo", "unit": "c"})])


def test_several_calls_and_what_stays_content():
    use = _use(tools=[WEATHER, TIME])
    two = [tools.Call("get_weather", {"city": "Oslo", "unit": "c"}), tools.Call("get_time", {"zone": "utc"})]
    llama = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; ' \
            '{"name": "get_time", "parameters": {"zone": "utc"}}'
    assert tools.parse(llama, use, LLAMA) == (None, two)
    qwen = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    assert tools.parse(qwen, use, QWEN) == (None, two)
    for text, template in (("It is sunny.", LLAMA), ('{"name": "unknown", "parameters": {}}', LLAMA),
                           ('{"name": "get_time", "parameters": {"zone": "utc"}} and more', LLAMA),
                           ("<tool_call>{broken</tool_call>", QWEN), ("[1, 2]", MISTRAL)):
        assert tools.parse(text, use, template) == (text, [])
    assert tools.parse('{"name": "get_time", "arguments": {}}', _use(tools=[TIME], tool_choice="none"), LLAMA)[1] == []


def test_forced_output_is_the_guides_json():
    forced = _use(tools=[WEATHER, TIME], tool_choice="required")
    assert tools.parse('[{"name":"get_time","arguments":{"zone":"cet"}}]', forced, QWEN) == (
        None, [tools.Call("get_time", {"zone": "cet"})])
    cut = '[{"name":"get_time","argu'  # max_tokens reached inside the call: the text, as it is
    assert tools.parse(cut, forced, QWEN) == (cut, [])


def test_call_ids_follow_the_family():
    assert tools.call_id(QWEN).startswith("call_") and len(tools.call_id(LLAMA)) == 29
    mistral = tools.call_id(MISTRAL)
    assert len(mistral) == 9 and mistral.isalnum()


# ---------------------------------------------------------------- the answer, as the openai client reads it


HEAD = m.Head("chatcmpl-1", 1, "tiny", "fp_x")
CALLS = [tools.Call("get_weather", {"city": "Oslo", "unit": "c"}), tools.Call("get_time", {"zone": "utc"})]


def test_the_response_is_an_openai_chat_completion_with_tool_calls():
    calls = tools.tool_calls(CALLS, QWEN)
    body = tools.attach(m.chat_response(HEAD, None, "stop", m.usage(3, 4)), None, calls)
    done = openai.types.chat.ChatCompletion.model_validate(body)
    choice = done.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        (c.name, c.arguments) for c in CALLS]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    plain = tools.attach(m.chat_response(HEAD, "hello", "stop", m.usage(3, 4)), "hello", [])
    assert openai.types.chat.ChatCompletion.model_validate(plain).choices[0].finish_reason == "stop"


def test_the_streamed_deltas_assemble_in_the_openai_clients_stream_state():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    calls = tools.tool_calls(CALLS, LLAMA)
    chunks = [m.chat_chunk(HEAD, {"role": "assistant", "content": ""}, None, False),
              *(m.chat_chunk(HEAD, d, None, False) for d in tools.deltas(None, calls)),
              m.chat_chunk(HEAD, {}, "tool_calls", False)]
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_both_targets_prompts_carry_the_tools():
    """The ensemble's token ids and the LLM API's text are one rendering: "auto" works on both targets."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from stoker.openai_api.served_model import ServedModel

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = ServedModel(key="k" * 12, tokenizer=tok, chat_template=QWEN, template_source="test", special=SPECIAL,
                        context_len=None, vocab_size=1)
    req = m.parse_chat({"model": "tiny", "messages": HISTORY})
    use = _use(tools=[TIME])
    text = model.chat_prompt(tools.messages(req), use.template_tools())
    assert '"get_time"' in text and "<tool_response>sunny, 21</tool_response>" in text
    assert model.encode(text, add_special_tokens=False) == model.chat_ids(tools.messages(req), use.template_tools())


def test_a_functions_own_refs_still_resolve_inside_the_call():
    point = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/pt"}, "path": {"type": "array", "items": {
            "$ref": "#/$defs/pt"}, "maxItems": 2}}, "required": ["to"], "additionalProperties": False,
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                         "additionalProperties": False}}}}}
    for choice, wrap in (({"type": "function", "function": {"name": "move"}}, lambda c: c), ("required", lambda c: [c])):
        schema = tools.call_schema(_use(tools=[point, TIME], tool_choice=choice))
        assert tools.ref_problem(schema) is None
        accepts = _accepts(schema)
        assert accepts(wrap(_call("move", to={"x": 1}, path=[{"x": 2}]))) and not accepts(wrap(_call("move", to={})))


def _hold(text: str, use: tools.ToolUse, template: str, step: int = 1):
    """(content sent while streaming, per piece; the rest and the calls at the end)."""
    h = tools.Holding(use, template)
    sent = [h.push(text[i:i + step]) for i in range(0, len(text), step)]
    return sent, h.finish()


@pytest.mark.parametrize("template", [LLAMA, QWEN, MISTRAL, PLAIN])
@pytest.mark.parametrize("text", [
    "It is sunny in Oslo.", "  <b>bold</b> {not a call}", "{not json at all", '{"name": "get_weather"}',
    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]',
    'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>',
    "a < b, and <tool_c is no tag", "ends with <tool_",
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_streamed_free_output_says_what_the_whole_one_says(template, text, step):
    use = _use(tools=[WEATHER])
    sent, (rest, calls) = _hold(text, use, template, step)
    content, want = tools.parse(text, use, template)
    assert calls == want
    streamed = "".join(sent) + (rest or "")
    assert streamed.strip() == (content or "").strip() or (not calls and streamed == text)


def test_plain_text_streams_at_once_and_a_call_is_held():
    use = _use(tools=[WEATHER])
    sent, _ = _hold("Sunny today.", use, LLAMA)
    assert sent[0] == "S"  # the first character shows it opens no call
    sent, (rest, calls) = _hold('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}', use, LLAMA)
    assert not any(sent) and rest is None and len(calls) == 1
    sent, (rest, calls) = _hold('Let me look. <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', use,
                                QWEN)
    assert "".join(sent) == "Let me look. " and rest is None and calls == [tools.Call("get_weather", {})]
    forced = _use(tools=[WEATHER], tool_choice="required")
    sent, (rest, calls) = _hold('[{"name": "get_weather", "arguments": {"city": "x", "unit": "f"}}]', forced, PLAIN)
    assert not any(sent) and len(calls) == 1

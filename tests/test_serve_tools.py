"""Tool calls' pure parts (jmoe.serve.tools, the chat template's tools): rendering against transformers'
apply_chat_template(..., tools=...), the formats' parsing (streamed in pieces = whole), the request checks
and the grammars of required / named calls. tests/test_serve_http.py drives them through the server."""

import json

import pytest

from jmoe.cli.common import DEFAULT_MODEL_DIR
from jmoe.serve.chat import load_chat_template
from jmoe.serve.params import RequestError
from jmoe.serve.tools import (HERMES, LLAMA3_JSON, MISTRAL, Parsed, plan_tools, reply_finish_reason,
                              reply_message, template_tool_calls, tool_format)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                        "celsius": {"type": "boolean"}},
                       "required": ["city", "celsius"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "clock"}},  # no parameters: it takes none
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "celsius": true}'}}
# OpenAI's conversation after a call: the assistant's call (content null), the tool's result, the next question.
OPENAI_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "user", "content": "And the time, déjà?"},
]


def tools_():
    return json.loads(json.dumps(TOOLS))  # as a body holds them: plain JSON


def source():
    return (DEFAULT_MODEL_DIR / "chat_template.jinja").read_text()


def as_template_sees(turns):
    """OpenAI's messages as jmoe hands them to the template: nulls left out, call arguments parsed."""
    out = []
    for i, m in enumerate(turns):
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = template_tool_calls(m["tool_calls"], f"messages.{i}.tool_calls")
        out.append(m)
    return out


@pytest.mark.quick
def test_shipped_template_renders_tools_as_transformers_does():
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ours = load_chat_template(DEFAULT_MODEL_DIR)
    conversations = [OPENAI_TURNS[1:2], OPENAI_TURNS, OPENAI_TURNS[1:4] + [dict(OPENAI_TURNS[3], content="2")]]
    for turns in conversations:
        messages = as_template_sees(turns)
        for tools in (TOOLS, None):
            expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert ours.render(messages, tools) == expected
    text = ours.render(as_template_sees(OPENAI_TURNS), TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # each tool as OpenAI sent it
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # Without tools a conversation renders as the plain ChatML template always did.
    plain = [{"role": r, "content": r.upper()} for r in ("system", "user", "assistant")]
    assert ours.render(plain) == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in plain) + \
        "<|im_start|>assistant\n"


def test_tool_use_template_is_picked_with_tools(tmp_path):
    from transformers import AutoTokenizer

    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | length }} tools: {{ messages[0]['content'] }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes())
    ours, theirs = load_chat_template(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        assert ours.render(messages, tools) == theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                          add_generation_prompt=True)
    assert ours.render(messages, TOOLS) == "2 tools: hi"
    assert "tools | length" in ours.source(TOOLS) and "tools" not in ours.source(None)


@pytest.mark.quick
def test_formats_are_read_from_the_template():
    assert tool_format(source()) is HERMES
    assert tool_format("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert tool_format("{{- '<|python_tag|>' }}") is LLAMA3_JSON
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is HERMES  # knows no tools: the default


def parse(plan, text, piece=None):
    """The reply `text` parsed whole, or fed `piece` characters at a time."""
    parser = plan.parser()
    out = Parsed()
    for i in range(0, len(text), piece or max(len(text), 1)):
        out.add(parser.feed(text[i:i + (piece or len(text))]))
    return out.add(parser.finish())


def calls_of(parsed):
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls]


HERMES_REPLIES = [  # (reply, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": false}}\n</tool_call>', "",
     [(0, "get_weather", {"city": "Oslo", "celsius": False})]),
    ('Let me look.\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>\n', "Let me look.",
     [(0, "clock", {}), (1, "get_weather", {"city": "Paris"})]),  # arguments as JSON text are read too
    ('<tool_call>\n{"name": "clock", "arguments": {}}', "", [(0, "clock", {})]),  # cut before its end marker
    ("Plain text, <tool and <tool_call ideas.\n\n", "Plain text, <tool and <tool_call ideas.\n\n", []),
    ('x <tool_call>{"name": "clock", "arguments": {}</tool_call> y', 'x <tool_call>{"name": "clock", "arguments": {}'
     '</tool_call> y', []),  # not JSON: left as written
    ('\n<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '\n<tool_call>{"name": "rm_rf", "arguments": {}}'
     '</tool_call>', []),  # a function the request did not define
    ('<tool_call>{"name": "clock", "arguments": {}', '<tool_call>{"name": "clock", "arguments": {}', []),
]


@pytest.mark.quick
@pytest.mark.parametrize("reply, content, calls", HERMES_REPLIES, ids=["call", "text_and_two_calls", "no_end_marker",
                                                                     "no_call", "not_json", "undefined_function",
                                                                     "cut_short"])
def test_hermes_calls_parse_the_same_streamed_and_whole(reply, content, calls):
    plan = plan_tools(tools_(), "auto", None, source())
    for piece in (None, 1, 2, 7):
        parsed = parse(plan, reply, piece)
        assert (parsed.content, calls_of(parsed)) == (content, calls), piece
    ids = [c["id"] for c in parse(plan, reply).calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == len(ids)


def test_llama3_and_mistral_replies():
    llama = plan_tools(tools_(), "auto", None, "<|python_tag|>")
    reply = '<|python_tag|>{"name": "clock", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for piece in (None, 1, 3):
        assert calls_of(parse(llama, reply, piece)) == [(0, "clock", {}), (1, "get_weather", {"city": "Oslo"})]
        assert parse(llama, "Hello {there}", piece).content == "Hello {there}"
        assert parse(llama, ' {"not": "a call"}', piece).content == ' {"not": "a call"}'
    mistral = plan_tools(tools_(), "auto", None, "[TOOL_CALLS]")
    listed = ' [{"name": "clock", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Paris"}}]'
    for text in (listed, "[TOOL_CALLS]" + listed):  # decoding drops the special token; kept, it is read past
        parsed = parse(mistral, text, 2)
        assert (parsed.content, [c[1] for c in calls_of(parsed)]) == ("", ["clock", "get_weather"])
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in parsed.calls)  # Mistral's templates want 9
    assert parse(mistral, "[1, 2] are numbers", 2).content == "[1, 2] are numbers"


@pytest.mark.quick
def test_tool_choice_none_parses_nothing_and_the_reply_shape():
    none = plan_tools(tools_(), "none", None, source())
    assert none.parser() is None and none.tools == TOOLS  # still rendered, as the client sent them
    assert plan_tools(None, None, None, source()).choice == "none"
    assert plan_tools(tools_(), None, None, source()).choice == "auto"
    call = parse(plan_tools(tools_(), "auto", None, source()), HERMES_REPLIES[0][0]).calls
    assert reply_message("", call) == {"role": "assistant", "content": None,
                                       "tool_calls": [{k: v for k, v in call[0].items() if k != "index"}]}
    assert reply_message("hi", []) == {"role": "assistant", "content": "hi"}
    assert (reply_finish_reason("stop", call), reply_finish_reason("length", call),
            reply_finish_reason("stop", [])) == ("tool_calls", "length", "stop")


@pytest.mark.parametrize("tools, choice, param", [
    ([dict(TOOLS[1]), dict(TOOLS[1])], None, "tools.1.function.name"),  # two named alike
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0.function.name"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], "auto", "tool_choice"),
    (TOOLS, "any", "tool_choice"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name"),
    ([{"type": "retrieval"}], None, "tools.0.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools.0.function.parameters"),
    ({"type": "function"}, None, "tools"),
])
def test_bad_tool_fields_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(RequestError) as error:
        plan_tools(tools, choice, None, source())
    assert error.value.param == param


def test_arguments_sent_back_must_be_json():
    for arguments in ("{city: Paris", "[1]"):
        bad = {**CALL, "function": {"name": "clock", "arguments": arguments}}
        with pytest.raises(RequestError) as error:
            template_tool_calls([CALL, bad], "messages.2.tool_calls")
        assert error.value.param == "messages.2.tool_calls.1.function.arguments"
    with pytest.raises(RequestError) as error:
        template_tool_calls([{"id": "x", "function": {"arguments": "{}"}}], "messages.2.tool_calls")
    assert error.value.param == "messages.2.tool_calls.0.function.name"
    assert template_tool_calls([{"function": {"name": "clock", "arguments": {}}}], "m") == \
        [{"type": "function", "function": {"name": "clock", "arguments": {}}}]  # an object is taken as it is


def test_required_and_named_grammars_write_the_template_format():
    named = plan_tools(tools_(), {"type": "function", "function": {"name": "clock"}}, None, source())
    assert named.grammar() == ('start: call\ncall: "<tool_call>\\n" call_json "\\n</tool_call>"\n'
                               'call_json: %json {"x-guidance":{"whitespace_flexible":false,"item_separator":", ",'
                               '"key_separator":": "},"type":"object","properties":{"name":{"const":"clock"},'
                               '"arguments":{"type":"object","properties":{},"additionalProperties":false}},'
                               '"required":["name","arguments"],'
                               '"additionalProperties":false}\n')
    required = plan_tools(tools_(), "required", None, source())
    assert required.grammar().startswith('start: call ("\\n" call)*\n') and required.grammar().count("%json") == 2
    assert plan_tools(tools_(), "required", False, source()).grammar().startswith("start: call\n")
    assert plan_tools(tools_(), "auto", None, source()).grammar() is None
    mistral = plan_tools(tools_(), "required", None, "[TOOL_CALLS]")  # one JSON list (its special token unwritten)
    assert mistral.grammar().startswith('start: "[" call_json (", " call_json)* "]"\n')
    llama = plan_tools(tools_(), "required", None, "<|python_tag|>")
    assert llama.grammar().startswith('start: call ("; " call)*\ncall: call_json\n') and '"parameters":' in \
        llama.grammar()


def test_the_recipe_writes_the_shipped_template():
    recipe = DEFAULT_MODEL_DIR.parent / "recipe" / "chat_template.jinja"
    assert recipe.read_text() == source()


@pytest.fixture(scope="module")
def served():
    """The API's view of the shipped model, without the model: its tokenizer, template and grammars."""
    from jmoe.checkpoint.tokenizer import load_tokenizer
    from jmoe.serve.grammar import Grammars
    from jmoe.serve.openai_api import Served

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    return Served(tokenizer, 1024, 8, load_chat_template(DEFAULT_MODEL_DIR), {"temperature": 0.0},
                  Grammars(tokenizer, 4096, [0]))


def chat_body(**fields):
    from jmoe.serve.openai_api import ChatBody

    return ChatBody.model_validate({"model": "m", "messages": OPENAI_TURNS, "tools": TOOLS, **fields})


@pytest.mark.quick
def test_required_and_named_calls_are_constrained_to_the_template_format(served):
    """The grammar a request's tool_choice compiles to accepts exactly the calls its template writes."""
    from jmoe.serve.openai_api import chat_generation

    auto = chat_generation(chat_body(), served)
    (prompt, params), = auto.choices
    assert params.constraint is None and auto.tools.choice == "auto"
    assert served.tokenizer.decode(prompt) == served.chat.render(as_template_sees(OPENAI_TURNS), TOOLS)
    written = as_template_sees([{"role": "assistant", "tool_calls": [CALL]}])  # the template's own call text
    call_text = served.chat.render(written, TOOLS).split("<|im_start|>assistant\n")[-2].removesuffix("<|im_end|>\n")
    assert call_text.startswith("<tool_call>\n{") and call_text.endswith("}\n</tool_call>")

    def accepts(generation, text):
        matcher = generation.choices[0][1].constraint.matcher()
        for token in served.tokenizer.encode(text, add_special_tokens=False):
            if not matcher.allowed()[token]:
                return False
            matcher.accept(token)
        return matcher.accepting

    named = chat_generation(chat_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}), served)
    assert accepts(named, call_text)
    assert not accepts(named, call_text.replace('"Paris"', '"Rome"'))  # not in the enum
    assert not accepts(named, call_text.replace("true", '"yes"'))
    assert not accepts(named, call_text + "\n" + call_text)  # a named function is called once
    required = chat_generation(chat_body(tool_choice="required"), served)
    assert accepts(required, call_text + "\n" + call_text)
    clock = '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
    assert accepts(required, clock) and not accepts(named, clock)
    assert chat_generation(chat_body(tool_choice="none"), served).choices[0][1].constraint is None
    with pytest.raises(RequestError) as both:
        chat_generation(chat_body(tool_choice="required", response_format={"type": "json_object"}), served)
    assert both.value.param == "tool_choice"


def events(text, reason="stop", piece=3):
    from jmoe.serve.engine import TokenEvent

    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    return [TokenEvent(i, p, None, None, reason if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]


@pytest.mark.quick
def test_a_reply_with_calls_streamed_and_whole(served):
    """Reply's body and chunks in OpenAI's shape: message.tool_calls, delta.tool_calls, finish_reason."""
    from jmoe.serve.openai_api import Choice, Reply, chat_generation

    reply_text = HERMES_REPLIES[1][0]
    for choice_field, calls, reason in [(None, ["clock", "get_weather"], "tool_calls"), ("none", [], "stop")]:
        generation = chat_generation(chat_body(tool_choice=choice_field), served)
        choice = Choice()
        for event in events(reply_text):
            choice.add(event)
        whole = Reply(True, "m", served.tokenizer.decode, generation.tools).body([choice], {})["choices"][0]
        assert [c["function"]["name"] for c in whole["message"].get("tool_calls", [])] == calls
        assert whole["finish_reason"] == reason
        assert whole["message"]["content"] == ("Let me look." if calls else reply_text)
        reply = Reply(True, "m", served.tokenizer.decode, generation.tools)
        chunks = [c["choices"][0] for c in (reply.chunk(0, e, False) for e in events(reply_text)) if c is not None]
        streamed_calls = [call for c in chunks for call in c["delta"].get("tool_calls", [])]
        assert [(c["index"], c["type"], c["function"]) for c in streamed_calls] == \
            [(i, "function", c["function"]) for i, c in enumerate(whole["message"].get("tool_calls", []))]
        assert all(c["id"].startswith("call_") for c in streamed_calls)
        assert "".join(c["delta"].get("content", "") for c in chunks) == whole["message"]["content"]
        assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [reason]
    # Echoed text is never read for calls; a reply cut by the token limit keeps "length".
    generation = chat_generation(chat_body(), served)
    reply = Reply(True, "m", served.tokenizer.decode, generation.tools)
    from jmoe.serve.engine import TokenEvent
    echoed = reply.chunk(0, TokenEvent(None, "<tool_call>", None, None, None), False, echo=True)
    assert echoed["choices"][0]["delta"] == {"content": "<tool_call>"}
    cut = [reply.chunk(1, e, False) for e in events(HERMES_REPLIES[0][0], "length")]
    assert [c for c in cut if c is not None][-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("template, reply", [
    ("[TOOL_CALLS]", '[{"name": "clock", "arguments": {}}, {"name": "get_weather", "arguments": '
                     '{"city": "Oslo", "celsius": true}}]'),
    ("<|python_tag|>", '{"name": "clock", "parameters": {}}; {"name": "get_weather", "parameters": '
                       '{"city": "Oslo", "celsius": true}}'),
])
def test_other_formats_grammars_accept_what_their_parsers_read(served, template, reply):
    plan = plan_tools(tools_(), "required", None, template)
    matcher = served.grammars.lark(plan.grammar(), "tools", "tool_calls").matcher()
    for token in served.tokenizer.encode(reply, add_special_tokens=False):
        assert matcher.allowed()[token]
        matcher.accept(token)
    assert matcher.accepting
    parsed = parse(plan, reply, 4)
    assert (parsed.content, [c[1] for c in calls_of(parsed)]) == ("", ["clock", "get_weather"])

"""Agent tools: schemas for the chat template, tool calls read from each model format (and from a
tokenizer's own response_template), tools run with every failure turned into text, and loaded by name."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from lora_ppo.agents.tools import (
    ToolCall,
    cut_short,
    load_tools,
    parse_tool_calls,
    run_tool,
    template_renders_tools,
    tool_message,
    tool_schemas,
    tools_system_message,
    with_system_text,
)
from lora_ppo.errors import RecipeError


def weather(city: str, days: int = 1) -> str:
    """Look up the weather forecast.

    Args:
        city: The city to look up.
        days: How many days ahead.
    """
    return f"sunny in {city} for {days} day(s)"


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def summary(city: str) -> dict:
    """The forecast as a record.

    Args:
        city: The city to look up.
    """
    return {"city": city, "temp": 21, "dry": True}


class Forecast:
    pass


def forecast() -> Forecast:
    """A forecast object, which is not text."""
    return Forecast()


def undocumented(city: str) -> str:
    return city


TOOLS = {fn.__name__: fn for fn in (add, divide, forecast, summary, weather)}
PARIS = ToolCall("weather", {"city": "Paris"})


def offline_tokenizer():
    """A tokenizer built here (no hub): only its templates matter, never its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]")


# ---- schemas ----------------------------------------------------------------------------------

def test_schema_of_a_documented_function_is_what_transformers_builds():
    assert tool_schemas([weather]) == [{
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Look up the weather forecast.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city to look up."},
                    "days": {"type": "integer", "description": "How many days ahead."},
                },
                "required": ["city"],
            },
            "return": {"type": "string"},
        },
    }]


def test_an_undocumented_function_is_a_recipe_error_naming_it():
    with pytest.raises(RecipeError, match=r"rollout.tools: tests.test_agent_tools.undocumented needs a docstring"):
        tool_schemas([weather, undocumented])


# ---- parsing: the fallback formats ------------------------------------------------------------

@pytest.mark.parametrize("text, calls", [
    pytest.param('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 [PARIS], id="hermes-one"),
    pytest.param('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                 [PARIS, ToolCall("add", {"a": 1, "b": 2})], id="hermes-two"),
    pytest.param('<tool_call>{"name": "forecast"}</tool_call>', [ToolCall("forecast", {})], id="hermes-no-arguments"),
    pytest.param('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>',
                 [PARIS, ToolCall("add", {"a": 1, "b": 2})], id="mistral"),
    # skip_special_tokens drops Mistral's [TOOL_CALLS]; the list alone still reads as calls
    pytest.param('[{"name": "weather", "arguments": {"city": "Paris"}}]', [PARIS], id="mistral-marker-dropped"),
    pytest.param('{"name": "weather", "parameters": {"city": "Paris"}}', [PARIS], id="llama-bare-json"),
    pytest.param('<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}', [PARIS], id="llama-python-tag"),
    pytest.param('```json\n{"name": "weather", "parameters": {"city": "Paris"}}\n```', [PARIS], id="llama-fenced"),
    pytest.param('[{"name": "weather", "parameters": {"city": "Paris"}}, '
                 '{"name": "add", "parameters": {"a": 1, "b": 2}}]',
                 [PARIS, ToolCall("add", {"a": 1, "b": 2})], id="llama-list"),
    pytest.param('<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
                 [PARIS], id="arguments-as-json-text"),
    pytest.param("It is sunny in Paris today.", [], id="plain-text"),
    pytest.param('{"answer": 42}', [], id="json-answer-is-not-a-call"),
    pytest.param("[" * 100_000, [], id="degenerate-brackets"),
])
def test_tool_calls_are_read_from_each_fallback_format(text, calls):
    assert parse_tool_calls(text) == calls


def test_malformed_json_in_a_tool_call_block_is_one_call_carrying_the_error():
    (call,) = parse_tool_calls('<tool_call>{"name": "weather", "arguments": {"city": "Paris"</tool_call>')
    assert call.name == "weather"
    assert list(call.arguments) == ["__error__"]
    assert call.arguments["__error__"].startswith("the tool call is not valid JSON (Expecting ")


def test_arguments_that_are_not_an_object_carry_the_error():
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert call == ToolCall("add", {"__error__": '"arguments" must be a JSON object, not [1, 2]'})


def test_broken_json_after_the_python_tag_is_a_call_carrying_the_error():
    (call,) = parse_tool_calls('<|python_tag|>{"name": "weather", "parameters": ')
    assert call.name == "weather" and call.arguments["__error__"].startswith("the tool call is not valid JSON")


def test_a_broken_mistral_list_names_the_tool_it_meant():
    (call,) = parse_tool_calls('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": ')
    assert call.name == "weather"
    assert call.arguments["__error__"].startswith("the [TOOL_CALLS] list is not valid JSON (")


def test_a_call_that_is_no_object_or_has_unreadable_arguments_carries_the_error():
    assert parse_tool_calls('[TOOL_CALLS] ["weather"]') == [
        ToolCall("", {"__error__": 'a tool call is a JSON object with a "name" and its "arguments"'})]
    (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{a: 1"}</tool_call>')
    assert call.name == "add" and call.arguments["__error__"].startswith('"arguments" is text that is not valid JSON (')


BROKEN = ToolCall("add", {"__error__": "the tool call is not valid JSON (Expecting value)"})
CUT = ToolCall("add", {"__error__": "the tool call was cut off by the token limit (rollout.max_new_tokens: 24) "
                                    "before it ended"})


@pytest.mark.parametrize("calls, expected", [
    ([], []),
    ([PARIS], [PARIS]),  # the turn ended on a readable call: nothing was cut
    ([BROKEN, PARIS], [BROKEN, PARIS]),
    ([PARIS, BROKEN], [PARIS, CUT]),  # only the last call can have been cut
    ([BROKEN, BROKEN], [BROKEN, CUT]),
])
def test_a_turn_cut_by_the_token_limit_blames_the_limit_for_its_last_unreadable_call(calls, expected):
    assert cut_short(calls, "rollout.max_new_tokens: 24") == expected


def test_a_template_that_fails_on_tools_does_not_render_them():
    def apply_chat_template(messages, tools=None, **_):
        if tools is not None:
            raise ValueError("this template takes no tools")  # as a jinja raise_exception does
        return "<|user|>What can you do?"

    assert not template_renders_tools(SimpleNamespace(apply_chat_template=apply_chat_template), [{"name": "add"}])


def test_the_tools_system_message_keeps_text_as_written():
    text = tools_system_message([{"name": "météo", "description": "La température à Paris"}])
    assert '{"name": "météo", "description": "La température à Paris"}' in text.splitlines()


def test_the_tools_text_closes_the_system_message_or_comes_first_as_its_own():
    user = {"role": "user", "content": "Hi"}
    system = {"role": "system", "content": "Be brief.", "name": "rules"}
    assert with_system_text([system, user, {"role": "assistant", "content": "Hello"}], "TOOLS") == [
        {"role": "system", "content": "Be brief.\n\nTOOLS", "name": "rules"}, user,
        {"role": "assistant", "content": "Hello"}]
    assert with_system_text([user], "TOOLS") == [{"role": "system", "content": "TOOLS"}, user]
    assert with_system_text([], "TOOLS") == [{"role": "system", "content": "TOOLS"}]


# ---- parsing: the tokenizer's own response_template -------------------------------------------

# A call format none of the fallbacks knows, so that a parse proves the template was used.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<call>", "close": "</call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}
TEMPLATE_CALL = 'Checking. <call>{"name": "weather", "arguments": {"city": "Paris", "days": "2"}}</call>'


def test_a_tokenizers_response_template_reads_the_calls_with_arguments_cast_to_the_schema():
    tokenizer = offline_tokenizer()
    tokenizer.response_template = RESPONSE_TEMPLATE
    # "2" becomes 2 because the schema says days is an integer: the tools reached the template
    assert parse_tool_calls(TEMPLATE_CALL, tokenizer, tools=[weather]) == [
        ToolCall("weather", {"city": "Paris", "days": 2})]
    assert parse_tool_calls(TEMPLATE_CALL) == []
    assert parse_tool_calls("It is sunny.", tokenizer) == []


def test_a_response_template_that_cannot_parse_the_call_gives_a_call_carrying_the_error():
    tokenizer = offline_tokenizer()
    tokenizer.response_template = RESPONSE_TEMPLATE
    (call,) = parse_tool_calls('<call>{"name": "weather", "arguments": {"city": </call>', tokenizer)
    assert call.name == "weather"
    assert call.arguments["__error__"].startswith("the tool call could not be parsed (json parser")


def test_a_tokenizer_without_a_response_template_uses_the_fallbacks():
    text = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert parse_tool_calls(text, offline_tokenizer()) == [PARIS]


# ---- chat templates render the schemas --------------------------------------------------------

# Qwen2.5's template, shortened: tools in the system prompt, calls and results in XML-ish tags.
QWEN_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1's template, shortened: tools as JSON in the first user turn, results as `ipython`.
LLAMA_TEMPLATE = """\
<|start_header_id|>system<|end_header_id|>

Environment: ipython<|eot_id|>
{%- for message in messages %}
{%- if message.role == "user" and loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.

{% for tool in tools %}{{ tool | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role in ["tool", "ipython"] %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}
{%- set call = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eom_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


@pytest.mark.parametrize("chat_template, assistant_open, assistant_close, rendered_result", [
    pytest.param(QWEN_TEMPLATE, "<|im_start|>assistant\n", "<|im_end|>",
                 "<|im_start|>user\n<tool_response>\nsunny in Paris for 1 day(s)\n</tool_response><|im_end|>",
                 id="qwen2.5"),
    pytest.param(LLAMA_TEMPLATE, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eom_id|>",
                 "<|start_header_id|>ipython<|end_header_id|>\n\nsunny in Paris for 1 day(s)<|eot_id|>",
                 id="llama3.1"),
])
def test_chat_templates_render_the_schemas_and_the_tool_result(chat_template, assistant_open, assistant_close,
                                                               rendered_result):
    tokenizer = offline_tokenizer()
    tokenizer.chat_template = chat_template
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": PARIS.name, "arguments": PARIS.arguments}}]},
        tool_message(PARIS, run_tool(PARIS, TOOLS, timeout_s=None)),
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=tool_schemas([weather]), tokenize=False,
                                             add_generation_prompt=True)
    assert '"name": "weather"' in rendered
    assert "Look up the weather forecast." in rendered and "The city to look up." in rendered
    assert rendered_result in rendered
    # The assistant turn as the template writes it is what the model learns to write: it reads back.
    assistant_turn = rendered.split(assistant_open)[1].split(assistant_close)[0]
    assert parse_tool_calls(assistant_turn) == [PARIS]


def test_tool_message_answers_the_call_by_name():
    assert tool_message(PARIS, "sunny") == {"role": "tool", "name": "weather", "content": "sunny"}


# ---- running tools ----------------------------------------------------------------------------

@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["no-timeout", "in-a-thread"])
@pytest.mark.parametrize("call, text", [
    pytest.param(PARIS, "sunny in Paris for 1 day(s)", id="text"),
    pytest.param(ToolCall("add", {"a": 1, "b": 2}), "3", id="int-as-json"),
    pytest.param(ToolCall("summary", {"city": "Zürich"}), '{"city": "Zürich", "temp": 21, "dry": true}',
                 id="dict-as-json"),
    pytest.param(ToolCall("divide", {"a": 1, "b": 0}), "error: divide raised ZeroDivisionError: division by zero",
                 id="raises"),
    pytest.param(ToolCall("forecast", {}), "error: forecast returned a Forecast, not text", id="not-text"),
    pytest.param(ToolCall("serch", {"query": "Paris"}),
                 "error: unknown tool 'serch' (available: add, divide, forecast, summary, weather)", id="unknown"),
    pytest.param(ToolCall("add", {"a": 1}),
                 "error: add does not take these arguments: missing a required argument: 'b'", id="missing-argument"),
    pytest.param(ToolCall("add", {"a": 1, "b": 2, "c": 3}),
                 "error: add does not take these arguments: got an unexpected keyword argument 'c'",
                 id="extra-argument"),
    pytest.param(ToolCall("weather", {"__error__": "the tool call is not valid JSON (Expecting value)"}),
                 "error: could not read the tool call to weather: the tool call is not valid JSON (Expecting value)",
                 id="parse-error"),
    pytest.param(ToolCall("", {"__error__": "the tool call is not valid JSON (Expecting value)"}),
                 "error: could not read the tool call: the tool call is not valid JSON (Expecting value)",
                 id="parse-error-no-name"),
])
def test_run_tool_returns_the_result_or_the_error_as_text(call, text, timeout_s):
    assert run_tool(call, TOOLS, timeout_s=timeout_s) == text


@pytest.fixture
def release():
    """An event a hung tool waits on; set at teardown, so that its thread ends with the test."""
    event = threading.Event()
    yield event
    event.set()


def test_a_tool_that_does_not_return_in_time_is_an_error_text(release):
    def lookup() -> str:
        release.wait()  # returns only at teardown: the outcome cannot depend on timing
        return "too late"

    assert run_tool(ToolCall("lookup", {}), {"lookup": lookup}, timeout_s=0.2) == \
        "error: lookup did not return within 0.2 s"


def test_a_malformed_call_reaches_the_model_as_an_error_text():
    (call,) = parse_tool_calls('<tool_call>{"name": "weather", "arguments": {"city": }}</tool_call>')
    assert run_tool(call, TOOLS, timeout_s=None).startswith(
        "error: could not read the tool call to weather: the tool call is not valid JSON (Expecting value")


# ---- loading tools ----------------------------------------------------------------------------

TOOL_MODULE = '''
def search(query: str) -> str:
    """Search the notes.

    Args:
        query: What to look for.
    """
    return "found " + query


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: The expression.
    """
    return "4"
'''


def test_tools_load_by_function_name_from_a_module_and_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "agent_tools_user_notes.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = load_tools(["agent_tools_user_notes:search", f"{tmp_path / 'agent_tools_user_notes.py'}:calculator"])
    assert sorted(tools) == ["calculator", "search"]
    assert run_tool(ToolCall("search", {"query": "Paris"}), tools, timeout_s=None) == "found Paris"
    assert run_tool(ToolCall("calculator", {"expression": "2+2"}), tools, timeout_s=None) == "4"


def test_two_tools_with_one_name_are_a_recipe_error_naming_both(tmp_path, monkeypatch):
    (tmp_path / "agent_tools_user_a.py").write_text(TOOL_MODULE)
    (tmp_path / "agent_tools_user_b.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError, match=r"rollout.tools: agent_tools_user_a:search and agent_tools_user_b:search "
                                          r"are both named 'search'"):
        load_tools(["agent_tools_user_a:search", "agent_tools_user_b:search"])


@pytest.mark.parametrize("spec, message", [
    ("agent_tools_no_such_module:search", "rollout.tools: cannot import module 'agent_tools_no_such_module'"),
    ("tests.test_agent_tools:no_such_tool",
     "rollout.tools: 'tests.test_agent_tools' has no callable named 'no_such_tool'"),
    ("search", "rollout.tools: 'search' must be module:function or path/file.py:function"),
])
def test_a_tool_that_cannot_be_imported_is_a_recipe_error_naming_rollout_tools(spec, message):
    with pytest.raises(RecipeError) as raised:
        load_tools([spec])
    assert str(raised.value).startswith(message)
    assert "reward.function" not in str(raised.value)


def test_a_tool_from_a_file_is_named_by_the_file_not_an_internal_module_name(tmp_path):
    # `rollout.tools: [path/my_tools.py:nodoc]` (how a run records a module beside the recipe)
    (tmp_path / "my_tools.py").write_text("def nodoc(x):\n    return x\n", encoding="utf-8")
    tools = load_tools([f"{tmp_path / 'my_tools.py'}:nodoc"])
    with pytest.raises(RecipeError, match=r"^rollout.tools: my_tools\.py\.nodoc needs a docstring"):
        tool_schemas(list(tools.values()))

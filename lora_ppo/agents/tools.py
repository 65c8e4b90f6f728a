"""The tools an agent may call: plain Python functions a recipe names (`rollout.tools:
[my_tools:search]`), described to the model by its chat template, read from its replies, and run.

Protocol: `tool_schemas` gives the chat template each function's JSON schema (from its type hints
and Google-style docstring); `parse_tool_calls` reads the calls in one assistant message;
`run_tool` runs one and returns the text of the `tool` message sent back. Every failure (a bad
call, a tool that raises or hangs) comes back as an `error: ...` text the model reads, so a bad
call costs the model a turn, never the run. Tools run in the training process with the user's own
permissions: there is no sandbox, so a recipe's tools are trusted code.

Calls are read with the tokenizer's own `response_template` where it has one; otherwise these
formats are tried in order:
  1. Hermes / Qwen / SmolLM3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
  2. Mistral: `[TOOL_CALLS]` and a JSON list of {"name", "arguments"} objects;
  3. Llama 3.x: the whole message is one JSON object {"name", "parameters" | "arguments"} or a
     JSON list of them, optionally after `<|python_tag|>` or inside ```json fences.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from lora_ppo.errors import RecipeError, first_line
from lora_ppo.rewards import STILL_RUNNING, USER_MODULE_PREFIX, import_function, run_within

# The one key of a call's arguments when the call could not be read: why, in words for the model.
PARSE_ERROR_KEY = "__error__"

# An unclosed block at the end still counts: generation may stop before `</tool_call>`.
HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA_PYTHON_TAG = "<|python_tag|>"
JSON_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
# The name in a call whose JSON is broken, so that the error can say which tool the model meant.
NAME_IN_BROKEN_JSON = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for. `arguments` is the decoded JSON object (may be {}); a call
    that could not be read has `{PARSE_ERROR_KEY: why}` instead, and name "" if none was readable."""

    name: str
    arguments: dict


def tool_schemas(functions: Sequence[Callable]) -> list[dict]:
    """The JSON schema of each function, as `apply_chat_template(..., tools=...)` takes them and
    as transformers builds them (`transformers.utils.get_json_schema`)."""
    schemas = []
    for fn in functions:
        try:
            schemas.append(get_json_schema(fn))
        except (DocstringParsingException, TypeHintParsingException) as err:
            name = f"{_module_label(fn)}.{getattr(fn, '__qualname__', repr(fn))}"
            raise RecipeError(f"rollout.tools: {name} needs a docstring with an Args: section and type hints "
                              f"(transformers.utils.get_json_schema: {first_line(err)})") from None
    return schemas


# How the tools reach a model whose chat template ignores `tools=` (SmolLM2's, many base models'):
# a system message in the Hermes / Qwen2.5 wording, asking for the first format parse_tool_calls
# reads. {schemas}: one JSON schema per line.
TOOLS_SYSTEM_MESSAGE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{schemas}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
# The conversation a template is tried on, with and without the tools.
PROBE = [{"role": "user", "content": "What can you do?"}]


def template_renders_tools(tokenizer: Any, schemas: list[dict]) -> bool:
    """Whether the tokenizer's chat template writes `tools=` into the prompt: rendered with and
    without them, the two texts differ. A template that fails on `tools=` does not render them."""
    without = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    try:
        with_tools = tokenizer.apply_chat_template(PROBE, tools=schemas, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template's own error (jinja, or raise_exception) on an argument it does not expect
        return False
    return with_tools != without


def tools_system_message(schemas: list[dict]) -> str:
    """The system message text that describes `schemas` to a model whose template ignores them."""
    return TOOLS_SYSTEM_MESSAGE.format(schemas="\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas))


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` closing their system message, or a system message of its own first."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content', '')}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _module_label(fn: Callable) -> str:
    """The module as the user named it: its name, or for a file loaded by path the file's name."""
    module = getattr(fn, "__module__", None) or "?"
    if module.startswith(USER_MODULE_PREFIX):
        return Path(getattr(sys.modules.get(module), "__file__", None) or module).name
    return module


def parse_tool_calls(text: str, tokenizer: Any = None, tools: Optional[Sequence[Any]] = None) -> list[ToolCall]:
    """The tool calls in one assistant message (`text`, the whole message), in order; [] when it
    has none. Never raises: a call that cannot be read is returned with its reason (see ToolCall).
    `tools` (functions or schemas) let a `response_template` cast arguments to their schema types."""
    if getattr(tokenizer, "response_template", None) is not None:
        return _calls_by_template(text, tokenizer, tools)
    if "<tool_call>" in text:
        return [_call_from_json_text(body) for body in HERMES_CALL.findall(text)]
    if MISTRAL_MARKER in text:
        listed = text.split(MISTRAL_MARKER, 1)[1].strip()
        # the list may be followed by an end-of-turn token such as `</s>`
        decoded, why = _decode_json(listed, trailing_text_ok=True)
        if why:
            return [_unreadable(listed, f"the {MISTRAL_MARKER} list is {why}")]
        return [_call_from_json(c) for c in (decoded if isinstance(decoded, list) else [decoded])]
    return _llama_calls(text.strip())


def _calls_by_template(text: str, tokenizer: Any, tools: Optional[Sequence[Any]]) -> list[ToolCall]:
    try:
        # prefix "": `text` is the whole assistant message, so no part of it lies in the prompt
        message = tokenizer.parse_response(text, prefix="", tools=tools)
    except Exception as err:  # a response_template's json region that does not parse, mostly
        return [_unreadable(text, f"the tool call could not be parsed ({first_line(err)})")]
    calls = []
    for entry in message.get("tool_calls") or []:
        # a `python-call-list` region yields a list of calls per region
        for one in entry if isinstance(entry, list) else [entry]:
            calls.append(_call_from_json(one.get("function", one) if isinstance(one, dict) else one))
    return calls


def _llama_calls(message: str) -> list[ToolCall]:
    tagged = message.startswith(LLAMA_PYTHON_TAG)
    body = message.removeprefix(LLAMA_PYTHON_TAG).strip()
    fenced = JSON_FENCE.fullmatch(body)
    body = fenced.group(1) if fenced else body
    decoded, why = _decode_json(body)
    if why:
        # Prose is not a call; after <|python_tag|> the model meant one.
        return [_unreadable(body, f"the tool call is {why}")] if tagged else []
    candidates = decoded if isinstance(decoded, list) else [decoded]
    # An answer that happens to be JSON ({"answer": 42}) is not a call.
    if not candidates or not (tagged or all(_looks_like_call(c) for c in candidates)):
        return []
    return [_call_from_json(c) for c in candidates]


def _looks_like_call(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("parameters" in obj or "arguments" in obj)


def _call_from_json_text(body: str) -> ToolCall:
    decoded, why = _decode_json(body)
    return _unreadable(body, f"the tool call is {why}") if why else _call_from_json(decoded)


def _decode_json(text: str, trailing_text_ok: bool = False) -> tuple[Any, str]:
    """The JSON value in `text` and "", or None and why not ("not valid JSON (...)")."""
    try:
        if trailing_text_ok:
            return json.JSONDecoder().raw_decode(text)[0], ""
        return json.loads(text), ""
    except (ValueError, RecursionError) as err:  # RecursionError: a degenerate "[[[[..." reply
        return None, f"not valid JSON ({first_line(err)})"


def _call_from_json(obj: Any) -> ToolCall:
    """{"name": ..., "arguments" | "parameters": {...} or its JSON text} as a ToolCall."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return _unreadable(json.dumps(obj), 'a tool call is a JSON object with a "name" and its "arguments"')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments, why = _decode_json(arguments.strip() or "{}")  # "": how some models write no arguments
        if why:
            return ToolCall(obj["name"], {PARSE_ERROR_KEY: f'"arguments" is text that is {why}'})
    if not isinstance(arguments, dict):
        why = f'"arguments" must be a JSON object, not {json.dumps(arguments)[:40]}'
        return ToolCall(obj["name"], {PARSE_ERROR_KEY: why})
    return ToolCall(obj["name"], arguments)


def cut_short(calls: list[ToolCall], limit: str) -> list[ToolCall]:
    """The calls of a turn that `limit` (the setting that ended it, "rollout.max_new_tokens: 24")
    cut off before its stop token: a last call that cannot be read was cut, and says so."""
    if not calls or PARSE_ERROR_KEY not in calls[-1].arguments:
        return calls
    why = f"the tool call was cut off by the token limit ({limit}) before it ended"
    return [*calls[:-1], ToolCall(calls[-1].name, {PARSE_ERROR_KEY: why})]


def _unreadable(raw: str, why: str) -> ToolCall:
    named = NAME_IN_BROKEN_JSON.search(raw)
    return ToolCall(named.group(1) if named else "", {PARSE_ERROR_KEY: why})


def run_tool(call: ToolCall, functions: Mapping[str, Callable], timeout_s: Optional[float]) -> str:
    """`functions[call.name](**call.arguments)` as the text of a `tool` message. A result that is
    not text is sent as JSON (3, true, null, {"a": 1}). Never raises, bar KeyboardInterrupt and
    SystemExit: every failure is an `error: ...` text for the model. `timeout_s` None: no limit."""
    if PARSE_ERROR_KEY in call.arguments:
        target = f" to {call.name}" if call.name else ""
        return f"error: could not read the tool call{target}: {call.arguments[PARSE_ERROR_KEY]}"
    fn = functions.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r} (available: {', '.join(sorted(functions))})"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as err:
        return f"error: {call.name} does not take these arguments: {err}"
    except ValueError:  # no signature to check (a builtin): the call itself says what is wrong
        pass
    try:
        # In a daemon thread: a hung tool keeps it, but never blocks the episode or the process's exit.
        result = run_within(lambda: fn(**call.arguments), timeout_s, f"tool {call.name}")
    except Exception as err:
        detail = f": {first_line(err)}" if str(err).strip() else ""
        return f"error: {call.name} raised {type(err).__name__}{detail}"
    if result is STILL_RUNNING:
        return f"error: {call.name} did not return within {timeout_s:g} s"
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # an object json cannot encode, a circular list
        return f"error: {call.name} returned a {type(result).__name__}, not text"


def tool_message(call: ToolCall, content: str) -> dict:
    """The chat message that answers `call` with `content` (run_tool's text)."""
    return {"role": "tool", "name": call.name, "content": content}


def load_tools(specs: Sequence[str]) -> dict[str, Callable]:
    """Each `module:function` or `path/file.py:function` imported, by the function's name (the
    name the model calls it by)."""
    functions: dict[str, Callable] = {}
    spec_of: dict[str, str] = {}
    for spec in specs:
        if ":" not in spec:
            raise RecipeError(f"rollout.tools: {spec!r} must be module:function or path/file.py:function")
        try:
            fn = import_function(spec)
        except RecipeError as err:
            raise RecipeError(str(err).replace("reward.function", "rollout.tools")) from None
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in functions:
            raise RecipeError(f"rollout.tools: {spec_of[name]} and {spec} are both named {name!r}, "
                              "and the model calls tools by name")
        functions[name], spec_of[name] = fn, spec
    return functions

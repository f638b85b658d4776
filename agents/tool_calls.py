"""How the policy writes tool calls and how a tool list reaches its prompt, for the agent server
(agents/openai_server.py): the Hermes / Qwen layout (`<tool_call>{json}</tool_call>`), its parser (`TOOL_PARSERS`,
`--rollout.agent-tool-parser`), the tool list and a call as that layout writes them, whether a chat template renders
`tools` itself, and the prompt text of a chat request (`render_chat`). Pure functions of text and a tokenizer."""

import json
from collections.abc import Callable


class ToolParseError(ValueError):
    """The model wrote tool-call markup that does not parse; the message says where and why."""


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    """(content, [(name, arguments), ...]) of a Hermes-format answer: each call is `<tool_call>` + a JSON object
    `{"name": str, "arguments": object}` + `</tool_call>` (the closing tag may be missing at the very end, e.g. when
    the model stopped right after the JSON). `content` is the text before the first call, right-stripped (None when
    empty); text between and after calls is dropped (as vLLM's Hermes parser drops it). Text without `<tool_call>` is
    all content. Raises `ToolParseError` when a call is not such an object (`arguments` may also be a JSON string of
    an object, as some models write it)."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return text, []
    content, calls, pos = text[:start].rstrip() or None, [], start
    while pos >= 0:
        body_at = pos + len(TOOL_OPEN)
        end = text.find(TOOL_CLOSE, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        where = f"tool call {len(calls)} ({body.strip()[:60]!r})"
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolParseError(f"{where}: not JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ToolParseError(f'{where}: not an object with a "name" string')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolParseError(f'{where}: "arguments" is a string that is not JSON') from None
        if not isinstance(args, dict):
            raise ToolParseError(f'{where}: "arguments" is not an object')
        calls.append((obj["name"], args))
        pos = -1 if end < 0 else text.find(TOOL_OPEN, end + len(TOOL_CLOSE))
    return content, calls


TOOL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[tuple[str, dict]]]]] = {
    "hermes": parse_hermes_tool_calls,  # Hermes 2 Pro, Qwen2.5 / Qwen3 instruct models
}


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The tool list in the Hermes layout, for templates that do not render `tools` themselves: the function
    signatures as one JSON object per line inside `<tools></tools>`, and how to call one."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"# Tools\n\nYou may call one or more of these functions. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\nTo call a function, write a JSON object with its name and arguments "
            f"inside <tool_call></tool_call>:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as "
            f"a JSON object>}}\n</tool_call>")  # fmt: skip


def hermes_call_text(name: str, arguments: dict | str) -> str:
    """One tool call as the Hermes layout writes it in an assistant turn."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a `tools` list into the prompt (Qwen2.5, Llama 3.1, ... do;
    `cleanrlhf/tiny-chat` and many older templates ignore it)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = {"type": "function", "function": {"name": "cleanrlhf_probe_tool", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    except Exception:  # a template that raises on tools does not render them
        return False
    return "cleanrlhf_probe_tool" in text


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of a chat request: the tokenizer's chat template with the generation prompt (and `tools`, when
    given), or, for a tokenizer without one, `role: content\\n` per message followed by `assistant: `."""
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

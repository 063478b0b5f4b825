"""The chat / tool-call format: the one place that defines how a transcript becomes text and token ids.

Everything that turns messages into tokens (SFT data, the agent harness, the Jinja `chat_template` written next to
the tokenizer for SGLang) follows this module, and tests compare them against it.

A transcript is a list of messages (dicts). Roles and what the model is trained on by default (`loss_mask`):

  role         header token           trained   extra keys
  system       <|system|>             no
  user         <|user|>               no
  assistant    <|assistant|>          yes       tool_calls: [{"name": str, "arguments": {...}}] (or OpenAI style
                                                {"function": {"name", "arguments"}}, arguments a dict or a JSON string)
  tool         <|tool_result|>        no        (a tool's output: environment text)
  summary      <|summary|>            yes       (a self-summary the model wrote when its context filled up)

Any message may carry `"train": bool` to override the default (e.g. a summary carried into the next context as
prompt is `{"role": "summary", ..., "train": False}`). The role header itself is never trained (it is the prompt the
engine is given); the content, the tool calls and the closing <|end_of_turn|> of a trained turn are.

Rendered text (no newlines are added between turns, so every stretch of plain text sits between two special tokens
and belongs to exactly one message — that is what makes the loss mask exact):

  <|begin_of_text|><|system|>You are a coding agent.<|end_of_turn|><|user|>Fix the test.<|end_of_turn|>
  <|assistant|>Let me look.<|tool_call|>{"name": "read_file", "arguments": {"path": "a.py"}}<|/tool_call|>
  <|end_of_turn|><|tool_result|>x = 1<|end_of_turn|><|assistant|>

(one line here, wrapped for the page; the final `<|assistant|>` is the generation prompt; to ask for a self-summary
instead, the harness appends the <|summary|> id to a transcript encoded without a generation prompt). A tool call is
the JSON object `{"name": ..., "arguments": {...}}` written by `json.dumps(..., ensure_ascii=False)` between
<|tool_call|> and <|/tool_call|>. Generation stops at <|end_of_turn|> (or <|end_of_text|>): see `STOP_TOKENS`.

Injection safety: text inside messages (file contents, tool output, user text) is encoded with special-token parsing
disabled, so a file containing the string "<|tool_call|>" yields ordinary byte-level tokens, never the special id.
Only this module places special ids. `parse_generated_ids` parses model output on ids for the same reason: a model
that spells "<|tool_call|>" out of ordinary tokens has not made a tool call. (`render` + a tokenizer that parses
special strings, e.g. transformers' `apply_chat_template(tokenize=True)`, gives the same ids only when no content
contains a special-token string; the harness must use `encode_messages`.)

This module is model-agnostic: it needs only a `tokenizers.Tokenizer` (or a transformers fast tokenizer) and never
imports jax or composer_jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL_RESULT = "<|tool_result|>"
SUMMARY = "<|summary|>"
END_OF_TURN = "<|end_of_turn|>"
TOOL_CALL = "<|tool_call|>"
TOOL_CALL_END = "<|/tool_call|>"
# Spare ids so later formats (e.g. thinking blocks) need no vocabulary change.
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(8))

# PAD first so that its id is 0, the value grain's packing pads with.
SPECIAL_TOKENS = (PAD, BEGIN_OF_TEXT, END_OF_TEXT, SYSTEM, USER, ASSISTANT, TOOL_RESULT, SUMMARY, END_OF_TURN,
                  TOOL_CALL, TOOL_CALL_END, *RESERVED)
STOP_TOKENS = (END_OF_TURN, END_OF_TEXT)

ROLE_HEADERS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL_RESULT, "summary": SUMMARY}
TRAINED_BY_DEFAULT = {"system": False, "user": False, "assistant": True, "tool": False, "summary": True}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed tool call."""
  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
  """Why model output could not be parsed as tool calls; `message` is written to be shown to the model."""
  message: str
  snippet: str = ""


@dataclasses.dataclass(frozen=True)
class AssistantOutput:
  """A parsed assistant turn: its text outside tool calls, and its tool calls or the error parsing them."""
  content: str
  tool_calls: list[ToolCall] | ToolCallError


# ----------------------------------------------------------------------------------------------------------------
# Rendering and encoding.


def _tool_call_json(tool_call: dict[str, Any]) -> str:
  """The JSON text of one tool call; the Jinja template builds the same string (see tokenizer.CHAT_TEMPLATE)."""
  call = tool_call.get("function", tool_call)
  if "name" not in call:
    raise ValueError(f"tool call has no 'name': {tool_call!r}")
  arguments = call.get("arguments", {})
  # A string is taken verbatim (OpenAI-style JSON text); a dict is dumped. For a dict this equals
  # json.dumps({"name": ..., "arguments": ...}, ensure_ascii=False).
  args_text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
  return '{"name": ' + json.dumps(call["name"], ensure_ascii=False) + ', "arguments": ' + args_text + "}"


def _pieces(messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[tuple[bool, str, bool]]:
  """The transcript as (is_special, text, trained) pieces, in order."""
  pieces = [(True, BEGIN_OF_TEXT, False)]
  for i, message in enumerate(messages):
    role = message.get("role")
    if role not in ROLE_HEADERS:
      raise ValueError(f"message {i} has role {role!r}; expected one of {sorted(ROLE_HEADERS)}")
    trained = bool(message.get("train", TRAINED_BY_DEFAULT[role]))
    content = message.get("content") or ""
    if not isinstance(content, str):
      raise ValueError(f"message {i} ({role}) content must be a string, got {type(content).__name__}")
    pieces.append((True, ROLE_HEADERS[role], False))
    if content:
      pieces.append((False, content, trained))
    tool_calls = message.get("tool_calls") or []
    if tool_calls and role != "assistant":
      raise ValueError(f"message {i} ({role}) has tool_calls; only assistant messages may")
    for call in tool_calls:
      pieces += [(True, TOOL_CALL, trained), (False, _tool_call_json(call), trained), (True, TOOL_CALL_END, trained)]
    pieces.append((True, END_OF_TURN, trained))
  if add_generation_prompt:
    pieces.append((True, ASSISTANT, False))
  return pieces


def render(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
  """Renders a transcript to text (the same text the tokenizer's Jinja chat_template produces)."""
  return "".join(text for _, text, _ in _pieces(messages, add_generation_prompt))


def _backend(tokenizer):
  """A `tokenizers.Tokenizer` from either that or a transformers fast tokenizer."""
  return getattr(tokenizer, "backend_tokenizer", tokenizer)


def encode_plain(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  """Encodes untrusted texts with special-token parsing disabled (no special id can come out of them)."""
  tok = _backend(tokenizer)
  # The flag is tokenizer state: set it for this call and put it back, so a caller's tokenizer is left as it was.
  # (Tokenizers from composer_jax.train.tokenizer already have it on, so concurrent callers never see it off.)
  previous = tok.encode_special_tokens
  tok.encode_special_tokens = True
  try:
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]
  finally:
    tok.encode_special_tokens = previous


def special_id(tokenizer, token: str) -> int:
  """The id of a special token, or a clear error if the tokenizer lacks it."""
  token_id = _backend(tokenizer).token_to_id(token)
  if token_id is None:
    raise ValueError(f"tokenizer has no special token {token!r}; train it with composer_jax.train.tokenizer")
  return token_id


def encode_messages(tokenizer, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
  """Encodes a transcript to token ids and a loss mask.

  Args:
    tokenizer: a `tokenizers.Tokenizer` (or transformers fast tokenizer) holding `SPECIAL_TOKENS`.
    messages: the transcript (see the module docstring).
    add_generation_prompt: append the `<|assistant|>` header that prompts the next model turn.

  Returns:
    (ids, loss_mask), equal-length lists; loss_mask[t] is 1 where token t was written by the model (content, tool
    calls and end-of-turn of assistant/summary turns, unless overridden by "train") and 0 elsewhere.
  """
  pieces = _pieces(messages, add_generation_prompt)
  plain = encode_plain(tokenizer, [text for special, text, _ in pieces if not special])
  ids, mask, k = [], [], 0
  for special, text, trained in pieces:
    if special:
      piece_ids = [special_id(tokenizer, text)]
    else:
      piece_ids, k = plain[k], k + 1
    ids += piece_ids
    mask += [int(trained)] * len(piece_ids)
  return ids, mask


# ----------------------------------------------------------------------------------------------------------------
# Parsing model output. Never raises: malformed output becomes a ToolCallError the harness can show the model.


def _parse_call(body: str) -> ToolCall | ToolCallError:
  snippet = body[:200]
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    return ToolCallError(f"tool call is not valid JSON ({e.msg} at char {e.pos}); write "
                         '{"name": "<tool>", "arguments": {...}} between the tool-call tokens', snippet)
  if not isinstance(obj, dict):
    return ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}", snippet)
  name, arguments = obj.get("name"), obj.get("arguments", {})
  if not isinstance(name, str) or not name:
    return ToolCallError('tool call needs a non-empty string "name"', snippet)
  unknown = sorted(set(obj) - {"name", "arguments"})
  if unknown:
    return ToolCallError(f'tool call has unexpected keys {unknown}; only "name" and "arguments" are allowed', snippet)
  if not isinstance(arguments, dict):
    return ToolCallError(f'tool call "arguments" must be a JSON object, got {type(arguments).__name__}', snippet)
  return ToolCall(name, arguments)


def _parse_segments(segments: list[tuple[bool, str]]) -> AssistantOutput:
  """Parses (is_marker, text) segments; markers are TOOL_CALL / TOOL_CALL_END / STOP_TOKENS."""
  content, calls, body, error = [], [], None, None
  for is_marker, text in segments:
    if error is not None:
      break
    if is_marker and text in STOP_TOKENS:
      if body is not None:
        error = ToolCallError(f"{text} inside an unclosed tool call; close it with {TOOL_CALL_END}", body[:200])
      break  # Anything after the end of the turn is not part of it.
    if is_marker and text == TOOL_CALL:
      if body is not None:
        error = ToolCallError(f"nested {TOOL_CALL}: close the previous call with {TOOL_CALL_END} first", body[:200])
      body = ""
    elif is_marker and text == TOOL_CALL_END:
      if body is None:
        error = ToolCallError(f"{TOOL_CALL_END} without an opening {TOOL_CALL}")
      else:
        parsed, body = _parse_call(body), None
        if isinstance(parsed, ToolCallError):
          error = parsed
        else:
          calls.append(parsed)
    elif body is not None:
      body += text
    else:
      content.append(text)
  if error is None and body is not None:
    error = ToolCallError(f"unclosed {TOOL_CALL}: end each call with {TOOL_CALL_END}", body[:200])
  return AssistantOutput("".join(content), error if error is not None else calls)


_MARKERS_RE = re.compile("(" + "|".join(re.escape(t) for t in (TOOL_CALL, TOOL_CALL_END, *STOP_TOKENS)) + ")")


def parse_assistant_text(text: str) -> AssistantOutput:
  """Parses decoded assistant text (special tokens written as strings) into content and tool calls."""
  parts = _MARKERS_RE.split(text)  # Odd positions are the markers themselves.
  return _parse_segments([(i % 2 == 1, p) for i, p in enumerate(parts) if p or i % 2 == 1])


def parse_tool_calls(text: str) -> list[ToolCall] | ToolCallError:
  """The tool calls in decoded assistant text, [] if none, or a ToolCallError; never raises."""
  return parse_assistant_text(text).tool_calls


def parse_generated_ids(tokenizer, ids: Sequence[int]) -> AssistantOutput:
  """Parses generated ids, splitting on the special ids themselves (spelled-out markers stay plain text)."""
  tok = _backend(tokenizer)
  markers = {special_id(tokenizer, t): t for t in (TOOL_CALL, TOOL_CALL_END, *STOP_TOKENS)}
  segments, run = [], []
  for i in [*ids, None]:
    if i is None or i in markers:
      if run:
        segments.append((False, tok.decode(run, skip_special_tokens=False)))
        run = []
      if i is not None:
        segments.append((True, markers[i]))
    else:
      run.append(i)
  return _parse_segments(segments)

"""Request parsing and validation for `hf-dllm serve` (OpenAI's request fields plus the dLLM fields).

Everything here is plain Python (no web framework), so it is tested and reused without a server. Invalid input
raises `APIError`, which the server turns into OpenAI's error object
`{"error": {"message", "type", "param", "code"}}` with the HTTP status.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

from ..generation_config import GENERATION_FIELDS, DiffusionGenerationConfig, is_int
from .options import MAX_PROMPTS

MAX_ERROR_MESSAGE = 2000


class APIError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        if len(message) > MAX_ERROR_MESSAGE:  # messages quote the offending value, which can be megabytes long
            message = message[:MAX_ERROR_MESSAGE] + "... (truncated)"
        # A quoted lone surrogate would make the JSON response unencodable (a 500): write it as its escape.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        if param is not None:
            param = param.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The request fields of the generation settings: every field of `DiffusionGenerationConfig` that is a request field
# (`GenerationField.request`; its type and values are the config's), under its own name, except `max_new_tokens`
# (OpenAI's `max_tokens`, below). The fields of a family's own sampler are the served model's (`sampler_fields`).
_OWN_NAMES = ("max_new_tokens",)
DLLM_FIELDS = {
    name: name
    for name, field in GENERATION_FIELDS.items()
    if field.option and field.request and field.owner is None and name not in _OWN_NAMES
}
# Other names of request fields: `use_dual_cache` is the name hand-written LLaDA servers use.
REQUEST_ALIASES = {"use_dual_cache": "dual_cache"}
DLLM_FIELDS.update(REQUEST_ALIASES)
# OpenAI fields accepted only with their neutral value (anything else: 400 naming the field).
NEUTRAL = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None,),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "top_p": (None, 1),
    "seed": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
}
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "stop",
    "user",
    "logit_bias",
    *NEUTRAL,
    *DLLM_FIELDS,
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "response_format", "metadata", "store"}
# Besides these, a request takes the fields of the served model's own sampler (its family's
# `own_generation_fields`: Dream's `alg`, `alg_temp`, `top_p`, `top_k`, `eps`), under their generation-config names:
# `sampler_fields`.
MAX_STOP_STRINGS = 16
# Longest stop string, in characters: every stop is searched in each row's text after every block, so their length
# is work per block (a 1 MiB stop string used to be accepted).
MAX_STOP_CHARS = 512
# Chat roles every chat template renders; `tool` only where the template mentions it (`chat_roles`).
CHAT_ROLES = ("system", "user", "assistant")
# OpenAI's rule for a message's `name`: letters, digits, `_` and `-`, at most 64 (so no special token fits in it).
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Deepest JSON nesting a request may have: OpenAI's schema needs 4 (messages -> message -> content -> part); deeper
# bodies are refused before they are walked (100k-deep JSON used to exhaust the parser's recursion, a 500).
MAX_JSON_DEPTH = 32
# A prompt longer than (tokens left in the context) x (the tokenizer's longest token, in characters) x this slack
# cannot fit, and is refused without tokenizing it (issue #15 measured tokenizing at ~400 bytes of memory per byte of
# prompt). The slack covers normalizers that merge characters (NFC: "e" + U+0301 -> "é").
NORMALIZER_SLACK = 2


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or `APIError` 400 `invalid_json`: malformed or too deeply nested JSON,
    numbers Python cannot hold, lone UTF-16 surrogates (which no tokenizer can encode). `NaN` and `Infinity` are
    parsed (Python's json accepts them, as JavaScript clients send them) and left to the field's validation, which
    rejects every non-finite number naming the field."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(
            400, f"The JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels).", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, bad UTF-8, ints over 4300 digits
        raise APIError(
            400, f"We could not parse the JSON body of your request: {error}.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    # Walk the whole body once, iteratively (no recursion to exhaust): depth and encodable strings.
    stack: list[tuple[object, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(
                400,
                f"The JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels).",
                param=field,
                code="invalid_json",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field)
                stack.append((item, depth + 1, field or key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, field) for item in value)
        elif isinstance(value, str):
            _check_text(value, field)
    return body


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = f"`{field}`" if field else "A field name"
        raise APIError(
            400,
            f"{where} holds a lone UTF-16 surrogate ({text[error.start]!r} at character {error.start}), which is not "
            "valid Unicode text.",
            param=field,
            code="invalid_json",
        ) from None


@dataclass
class GenerationParams:
    config: DiffusionGenerationConfig  # the resolved settings of the run; equal configs share a run (batching key)
    fields: dict  # the DiffusionGenerationConfig fields the request named (what `config` was resolved from)
    max_tokens: int  # cap of the returned tokens
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    # The request's names of config fields where they differ (`max_new_tokens` -> `max_tokens`, ...): its errors'.
    aliases: dict = field(default_factory=dict)


def _same(value, expected) -> bool:
    """Equality that keeps JSON's booleans apart from numbers (`true` is not `1`)."""
    if isinstance(expected, bool) or isinstance(value, bool) or expected is None or value is None:
        return value is expected
    return value == expected


def _error_param(message: str, aliases: dict[str, str]) -> str | None:
    """The first `field` named in a DiffusionGenerationConfig error, as the request called it."""
    match = re.search(r"`(\w+)", message)
    if match is None:
        return None
    return aliases.get(match.group(1), match.group(1))


def context_error(max_length: int, detail: str, param: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_length} tokens. {detail}",
        param=param,
        code="context_length_exceeded",
    )


def _resolve(model, fields: dict, aliases: dict[str, str]) -> DiffusionGenerationConfig:
    """`model.resolve_generation_config(**fields)`, its ValueError as a 400 naming the field as the request did."""
    try:
        return model.resolve_generation_config(**fields)
    except ValueError as error:
        message = str(error).replace("max_new_tokens", aliases["max_new_tokens"])
        for field_name, param in aliases.items():
            if field_name not in (param, "max_new_tokens"):
                message = message.replace(f"`{field_name}`", f"`{param}`")
        raise APIError(400, message, param=_error_param(str(error), aliases)) from None


def sampler_fields(model) -> tuple[str, ...]:
    """The request fields of the served model's own sampler: its family's `own_generation_fields` (Dream's `alg`,
    `alg_temp`, `top_p`, `top_k`, `eps`; none for LLaDA and LLaDA2.x). An OpenAI field among them (`top_p`) is then
    the sampler's setting, passed on, instead of a field accepted only with its neutral value."""
    return tuple(model.diffusion_family.own_generation_fields)


def parse_generation_params(body: dict, model, chat: bool, max_length: int | None = None) -> GenerationParams:
    """Validate the generation fields of a request body and resolve the run's settings with the model's own resolver:
    `model.resolve_generation_config(**fields the request named)`, so a field the request leaves out comes from the
    checkpoint's `generation_config.json` (then `DiffusionGenerationConfig`'s defaults), exactly as for
    `model.generate()` without that keyword, and a field named `null` is None, as `generate(field=None)`; the resolver's rules (`temperature` sets `do_sample`, naming one
    decoding rule replaces the checkpoint's) and its family's checks (`DiffusionFamily.validate`: LLaDA2 combines
    `steps` with `threshold` and takes the LLaDA2-only fields) apply. A bad value is a 400 naming the request's
    field.

    The model's own sampler fields (`sampler_fields`: Dream's `alg`, `alg_temp`, `top_p`, `top_k`, `eps`) are
    request fields too, resolved the same way; other models refuse them as unknown arguments.

    `max_tokens` (chat: or `max_completion_tokens`) caps the returned tokens; absent, it is the resolved
    `max_new_tokens` and the run is that of `generate()`. Given, the model decodes its family's
    `decoded_length` of it (a bidirectional model, LLaDA: rounded up to whole blocks of `block_length`, and the
    completion cut back to `max_tokens` tokens, `steps` counting the steps of the rounded length; a block-causal
    model, LLaDA2.x: `max_tokens` as it is, its blocks aligned to absolute positions). With `max_length` (the model's
    context), the decoded length is checked against it before anything is planned.
    """
    own_fields = sampler_fields(model)
    allowed = (CHAT_FIELDS if chat else COMPLETION_FIELDS) | set(own_fields)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in own_fields:  # the model's sampler setting (Dream's top_p): the resolver validates it
            continue
        if name in body and not any(_same(body[name], allowed_value) for allowed_value in neutral):
            raise APIError(
                400,
                f"`{name}`={body[name]!r} is not supported by this server (allowed: "
                f"{', '.join(json.dumps(v) for v in neutral)}).",
                param=name,
            )
    if body.get("logit_bias") not in (None, {}):
        raise APIError(400, "`logit_bias` is not supported by this server.", param="logit_bias")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise APIError(400, "Only response_format {'type': 'text'} is supported.", param="response_format")
    family = model.diffusion_family

    max_tokens = body.get("max_tokens")
    max_name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        if max_tokens is not None and max_tokens != body["max_completion_tokens"]:
            raise APIError(400, "Give `max_tokens` or `max_completion_tokens`, not both.", param="max_tokens")
        max_tokens, max_name = body["max_completion_tokens"], "max_completion_tokens"

    # Only what the request named: the resolver fills the rest from the checkpoint's generation_config.json. A field
    # named with `null` is named: set to None, as `generate(threshold=None)` sets it (`"threshold": null` turns the
    # checkpoint's threshold rule off; a field that takes no None gets the resolver's 400 naming it).
    fields: dict = {}
    aliases = {"max_new_tokens": max_name}
    if "dual_cache" in body and "use_dual_cache" in body and not _same(body["dual_cache"], body["use_dual_cache"]):
        raise APIError(400, "`dual_cache` and its alias `use_dual_cache` disagree: give one.", param="dual_cache")
    for name, target in [*DLLM_FIELDS.items(), *((name, name) for name in own_fields)]:
        if name in body:
            fields[target] = body[name]
            aliases[target] = name

    prompt_param = "messages" if chat else "prompt"
    if max_tokens is not None:
        if max_length is not None and is_int(max_tokens) and max_tokens > max_length:
            # Before validate(): its bound on max_new_tokens (2**20) would hide that the context is what is exceeded.
            raise context_error(max_length, f"You requested {max_tokens} tokens (`{max_name}`).", prompt_param)
        config = _resolve(model, {**fields, "max_new_tokens": max_tokens}, aliases)
        rounded = family.decoded_length(max_tokens, config)
        if rounded != max_tokens:
            if max_length is not None and rounded > max_length:
                raise context_error(
                    max_length,
                    f"Decoding `{max_name}`={max_tokens} in whole blocks of `block_length`={config.block_length} "
                    f"takes {rounded} positions.",
                    "block_length" if config.block_length > max_tokens else prompt_param,
                )
            config = _resolve(model, {**fields, "max_new_tokens": rounded}, aliases)
        fields["max_new_tokens"] = config.max_new_tokens
    else:
        config = _resolve(model, fields, aliases)
        max_tokens = config.max_new_tokens
        if max_length is not None and max_tokens > max_length:
            raise context_error(
                max_length,
                f"The model's generation config decodes {max_tokens} tokens (`max_new_tokens`).",
                prompt_param,
            )
    needs_eos = [
        name for name in ("eos_early_stop", "logits_eos_inf", "confidence_eos_eot_inf") if getattr(config, name)
    ]
    if needs_eos and not config.eos_token_ids:
        raise APIError(
            400,
            f"`{needs_eos[0]}` needs an EOS token, and the model has none: set it to false.",
            param=aliases.get(needs_eos[0], needs_eos[0]),
        )

    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        stop = tuple(stop)
    else:
        raise APIError(400, f"`stop` must be a string or a list of at most {MAX_STOP_STRINGS} strings.", param="stop")
    if any(s == "" for s in stop):
        raise APIError(400, "`stop` strings must not be empty.", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"`stop` strings must be at most {MAX_STOP_CHARS} characters long.", param="stop")

    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, f"`stream` must be true or false, got {stream!r}.", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise APIError(400, "`stream_options` must be an object with `include_usage` only.", param="stream_options")
        if not stream:
            raise APIError(400, "`stream_options` is only allowed with stream=true.", param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    return GenerationParams(config, fields, max_tokens, stop, stream, include_usage, aliases)


def check_plan(family, prompt_length: int, params: GenerationParams) -> None:
    """Plan a prompt of `prompt_length` tokens as `generate()` would (`DiffusionFamily.plan`: `steps` at least the
    blocks it decodes, LLaDA2's `minimal_topk` at most `max_new_tokens`; block-causal families' plans depend on the
    prompt's length): what it refuses is a 400 naming the request's field, before the row could fail the run of its
    whole batch. The server asks it for every prompt of a request (the one plan check)."""
    try:
        family.plan([prompt_length], prompt_length, params.config, torch.device("cpu"))
    except ValueError as error:
        name = "minimal_topk" if "`minimal_topk`" in str(error) else "steps"
        max_name = params.aliases.get("max_new_tokens", "max_new_tokens")
        raise APIError(
            400, str(error).replace("max_new_tokens", max_name), param=params.aliases.get(name, name)
        ) from None


def _token_ids(value, vocab_size: int) -> list[int] | None:
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        if not all(0 <= t < vocab_size for t in value):
            raise APIError(400, f"Prompt token ids must be in [0, {vocab_size}).", param="prompt")
        return list(value)
    return None


def split_prompts(prompt, vocab_size: int, max_prompts: int = MAX_PROMPTS) -> list[str | list[int]]:
    """`prompt` of /v1/completions (a string, a list of strings, a list of token ids, or a list of those) as a
    list of at most `max_prompts` texts and token-id lists, validated but not tokenized."""
    if isinstance(prompt, str):
        return [prompt]
    ids = _token_ids(prompt, vocab_size)
    if ids is not None:
        return [ids]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p, vocab_size) for p in prompt):
        if len(prompt) > max_prompts:
            raise APIError(400, f"At most {max_prompts} prompts per request, got {len(prompt)}.", param="prompt")
        return list(prompt)
    raise APIError(
        400,
        "`prompt` must be a string, a list of strings, a list of token ids or a list of such lists (non-empty).",
        param="prompt",
    )


def encode_prompts(prompts: list[str | list[int]], tokenizer) -> list[list[int]]:
    """Token ids of `split_prompts`' items (tokenizes the texts: run it off the event loop)."""
    return [p if isinstance(p, list) else list(tokenizer(p)["input_ids"]) for p in prompts]


def chat_roles(tokenizer) -> tuple[str, ...]:
    """The roles the tokenizer's chat template renders: `CHAT_ROLES`, plus `tool` where the template mentions it.
    A role outside them would be rendered as the template's fallback, or (in templates that print the role) as a
    forged turn header."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = " ".join(str(t) for t in template.values())
    return (*CHAT_ROLES, "tool") if "tool" in str(template) else CHAT_ROLES


def convert_messages(messages, roles: tuple[str, ...] = CHAT_ROLES) -> list[dict]:
    """OpenAI `messages` (string content or text parts, a `role` among `roles`, an optional `name` matching
    `NAME_PATTERN`) as `{role, content[, name]}` dicts for the chat template, validated."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "`messages` must be a non-empty list of {role, content} objects.", param="messages")
    converted = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string `role`.", param=f"messages[{i}]")
        if message["role"] not in roles:
            raise APIError(
                400,
                f"messages[{i}].role must be one of {list(roles)} (the roles this model's chat template knows), got "
                f"{message['role'][:64]!r}.",
                param=f"messages[{i}].role",
            )
        name = message.get("name")
        if name is not None and not (isinstance(name, str) and NAME_PATTERN.fullmatch(name)):
            raise APIError(
                400,
                f"messages[{i}].name must be 1 to 64 letters, digits, '_' or '-' (no special tokens).",
                param=f"messages[{i}].name",
            )
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400, f"messages[{i}].content: only text parts are supported.", param=f"messages[{i}].content"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(
                400, f"messages[{i}].content must be a string or a list of text parts.", param=f"messages[{i}].content"
            )
        converted.append({"role": message["role"], "content": content, **({"name": name} if name else {})})
    return converted


def render_chat(messages: list[dict], tokenizer) -> str:
    """The tokenizer's chat template applied to `convert_messages`' output, as text (run it off the event loop).
    Its tokens are `tokenizer(text, add_special_tokens=False)`, what `apply_chat_template(tokenize=True)` gives;
    rendering first lets the text's length be checked before it is tokenized."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model's tokenizer has no chat template: use /v1/completions.", param="messages")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest token (vocabulary and added tokens): no token covers more characters
    of a text (a byte-level token string has a character per byte, at least one per decoded character)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def check_prompt_chars(chars: int, budget: int | None, max_chars_per_token: int, param: str, max_length) -> None:
    """Refuse, without tokenizing it, a prompt of `chars` characters that cannot fit the `budget` tokens left in
    the context (see `NORMALIZER_SLACK`)."""
    if budget is None:
        return
    budget = max(budget, 0)
    limit = budget * max_chars_per_token * NORMALIZER_SLACK
    if chars > limit:
        raise context_error(
            max_length,
            f"The prompt has {chars} characters, and the {budget} tokens left for it after max_tokens cover at most "
            f"{limit} (the longest token has {max_chars_per_token} characters; x{NORMALIZER_SLACK} for "
            "normalization).",
            param,
        )

"""The fields of OpenAI's chat, completions and embeddings requests that the gateway reads,
counts or relays, with the types and ranges of OpenAI's API reference. Fields not named here
pass to the backend untouched (backends have their own: top_k, min_p, guided_json, ...).
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.stages.jsoncheck import (
    Check,
    an_object,
    array_of,
    boolean,
    by_type,
    empty_array,
    fields,
    integer,
    invalid_type,
    number,
    one_of,
    string,
    unsupported,
    values_of,
)

__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "MAX_TOKENS_CAP", "MESSAGES", "PROMPT"]

# Far beyond any model's context; a larger value is a client bug, not a request.
MAX_TOKENS_CAP = 1_000_000
# Token ids are int32 in every engine (llama.cpp's llama_token, vLLM's tensors).
_TOKEN_ID = integer(0, 2**31 - 1)
_INT64 = integer(-(2**63), 2**63 - 1)

_CALLED_FUNCTION = fields({"name": string, "arguments": string})
_TEXT_OR_OBJECT = "a string or an object"
_CONTENT_PART = fields({"type": string, "text": string, "refusal": string})
_CONTENT = by_type(
    "a string or an array of content parts", {str: string, list: array_of(_CONTENT_PART)}
)
_TOOL_CALL = fields(
    {"id": string, "type": string, "function": _CALLED_FUNCTION, "custom": an_object}
)
_ROLE = one_of("system", "developer", "user", "assistant", "tool", "function")
_MESSAGE = fields(
    {
        "role": _ROLE,
        "content": _CONTENT,
        "name": string,
        "tool_calls": array_of(_TOOL_CALL),
        "tool_call_id": string,
        "function_call": _CALLED_FUNCTION,
        "refusal": string,
    },
    required=("role",),
)
MESSAGES = array_of(_MESSAGE, non_empty=True)

_FUNCTION = fields(
    {"name": string, "description": string, "parameters": an_object, "strict": boolean}
)
_TOOL = fields({"type": string, "function": _FUNCTION, "custom": an_object})
_NAMED = fields({"name": string})
_TOOL_CHOICE = by_type(
    _TEXT_OR_OBJECT, {str: string, dict: fields({"type": string, "function": _NAMED})}
)
_STOP = by_type("a string or an array of strings", {str: string, list: array_of(string)})


def _prompt(max_items: int | None) -> Check:
    """A text, or a non-empty array of texts, of token ids, or of token-id arrays: never a mix
    (the first element says which)."""
    texts = array_of(string, max_items=max_items)
    ids = array_of(_TOKEN_ID)
    id_lists = array_of(array_of(_TOKEN_ID, non_empty=True), max_items=max_items)

    def check(value: object, param: str) -> None:
        if type(value) is str:
            return
        if type(value) is not list:
            raise invalid_type(param, "a string or an array", value)
        if not value:
            raise empty_array(param)
        first = value[0]
        shape = id_lists if type(first) is list else texts if type(first) is str else ids
        shape(value, param)

    return check


PROMPT = _prompt(None)

# Sampling fields shared by chat and completions.
_SAMPLING: Mapping[str, Check] = {
    "stream": boolean,
    "max_tokens": integer(1, MAX_TOKENS_CAP),
    "n": integer(1, 128),
    "temperature": number(0.0, 2.0),
    "top_p": number(0.0, 1.0),
    "frequency_penalty": number(-2.0, 2.0),
    "presence_penalty": number(-2.0, 2.0),
    "seed": _INT64,
    "stop": _STOP,
    "logit_bias": values_of(number(-100, 100)),
    "user": string,
}

CHAT: Mapping[str, Check] = {
    **_SAMPLING,
    # Chat's newer name for max_tokens (OpenAI's reasoning models take only this one).
    "max_completion_tokens": integer(1, MAX_TOKENS_CAP),
    "logprobs": boolean,
    "top_logprobs": integer(0, 20),
    "tools": array_of(_TOOL),
    "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": boolean,
    "functions": array_of(_FUNCTION),
    "function_call": by_type(_TEXT_OR_OBJECT, {str: string, dict: _NAMED}),
    "response_format": fields({"type": string, "json_schema": an_object}),
    "metadata": values_of(string),
    "modalities": array_of(string),
    "store": boolean,
    "reasoning_effort": string,
    "service_tier": string,
    "verbosity": string,
    "prompt_cache_key": string,
    "safety_identifier": string,
    "audio": an_object,
    "prediction": an_object,
    "web_search_options": an_object,
}

COMPLETIONS: Mapping[str, Check] = {
    **_SAMPLING,
    # Chat's name only: completions backends (vLLM, OpenAI) read max_tokens, so a bound sent
    # here would bound nothing the backend generates.
    "max_completion_tokens": unsupported("max_tokens"),
    # OpenAI allows 5 log-probabilities and 20 candidates; vLLM's default limit is 20 of both.
    "logprobs": integer(0, 20),
    "best_of": integer(0, 20),
    "echo": boolean,
    "suffix": string,
}

EMBEDDINGS: Mapping[str, Check] = {
    "input": _prompt(2048),
    "dimensions": integer(1, 65_536),
    "encoding_format": one_of("float", "base64"),
    "user": string,
}

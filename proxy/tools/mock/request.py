"""Parse and validate the mock backend's request bodies into small typed records.

Invalid input raises `MockHTTPError`, which renders as an OpenAI-shaped error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import orjson

from proxy.tools.mock.text import TokenSource, count_words, stopped

if TYPE_CHECKING:
    from proxy.tools.mock.toolplan import ToolPlan

__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "MAX_COMPLETION_TOKENS",
    "TOKENS_PER_MESSAGE",
    "CompletionRequest",
    "EmbeddingRequest",
    "Endpoint",
    "Knobs",
    "MockHTTPError",
    "bool_field",
    "content_text",
    "int_field",
    "model_of",
    "parse_completion",
    "parse_embedding",
    "parse_json",
    "parse_knobs",
]

DEFAULT_COMPLETION_TOKENS: Final = 256
# The longest answer, as a model's context bounds it: the whole text is built at once, and 5M
# tokens held the loop (every other stream with it) 10 s and took 400 MB.
MAX_COMPLETION_TOKENS: Final = 131_072
# The most tokens one whole answer holds, over its `n` choices for each prompt of a batch: 128
# answers of the longest length (about 100 MB of JSON).
MAX_ANSWER_TOKENS: Final = 128 * MAX_COMPLETION_TOKENS
TOKENS_PER_MESSAGE: Final = 4
MAX_EMBEDDING_INPUTS: Final = 2048
MAX_STOPS: Final = 64  # each is searched for in the whole answer
MAX_DIMENSIONS: Final = 8192
MAX_TOP_LOGPROBS: Final = 20  # OpenAI's bound on chat's top_logprobs; vLLM's default max_logprobs

_ERROR_KINDS: Final = {
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}


_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class MockHTTPError(Exception):
    """An error response: HTTP status plus OpenAI's {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        default_type, default_code = _ERROR_KINDS.get(status, ("invalid_request_error", None))
        self.status = status
        self.type = "server_error" if status >= 500 else default_type
        self.message = message
        self.param = param
        self.code = code if code is not None else default_code
        self.retry_after_s = retry_after_s

    def body(self, *, anthropic: bool = False) -> bytes:
        """OpenAI's error shape, or with `anthropic` Anthropic's (its types by status)."""
        if anthropic:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            anthropic_error = {"type": kind, "message": self.message}
            return orjson.dumps({"type": "error", "error": anthropic_error})
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return orjson.dumps({"error": error})


class Endpoint(enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    MESSAGES = "messages"


@dataclass(frozen=True, slots=True)
class Knobs:
    """Testing knobs: request fields the mock obeys and a real backend would reject."""

    fail_status: int | None = None
    fail_after_tokens: int | None = None
    delay_s: float = 0.0
    completion_tokens: int = DEFAULT_COMPLETION_TOKENS
    retry_after_s: int | None = None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool
    prompt_text: str
    prompt_tokens: int
    max_tokens: int | None
    answers: int = 1  # choices in a whole answer: `n` for each prompt of a batch
    stops: tuple[str, ...] = ()  # stop sequences
    tools: ToolPlan | None = None  # the tool calls a chat answer makes (toolcalls.py)
    logprobs: int | None = None  # asked for: each token's, with so many top alternatives

    def plan(self, knobs: Knobs) -> tuple[TokenSource, int, str]:
        """The answer's tokens, how many each choice has, and its finish_reason."""
        n_tokens, finish_reason = knobs.completion_tokens, "stop"
        if self.tools is not None:  # a piece of the arguments a token; no stop sequence ends it
            n_tokens, finish_reason = len(self.tools.pieces), "tool_calls"
        if self.max_tokens is not None and self.max_tokens < n_tokens:
            n_tokens, finish_reason = self.max_tokens, "length"
        if n_tokens * self.answers > MAX_ANSWER_TOKENS:
            raise MockHTTPError(
                400,
                f"{self.answers} choices of {n_tokens} tokens are more than the mock backend "
                f"answers at once ({MAX_ANSWER_TOKENS:,} tokens).",
                param="n",
            )
        cut = stopped(self.prompt_text, n_tokens, self.stops) if self.stops else None
        if self.tools is not None:
            cut = None
        if cut is not None:
            return *cut, "stop"
        return TokenSource(self.prompt_text), n_tokens, finish_reason


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    keys: tuple[bytes, ...]
    prompt_tokens: int
    dimensions: int
    base64: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MockHTTPError(
            400, f"We could not parse the JSON body of your request: {exc}"
        ) from exc
    if not isinstance(body, dict):
        raise MockHTTPError(400, "The request body must be a JSON object.")
    return body


def int_field(body: dict[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MockHTTPError(400, f"'{name}' must be an integer >= {low}.", param=name)
    if high is not None and value > high:
        raise MockHTTPError(400, f"'{name}' must be an integer <= {high}.", param=name)
    return value


def bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise MockHTTPError(400, f"'{name}' must be a boolean.", param=name)
    return value


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MockHTTPError(400, "You must provide a model parameter.", param="model")
    return model


def parse_knobs(body: dict[str, Any]) -> Knobs:
    delay_ms = body.get("mock_delay_ms", 0)
    if isinstance(delay_ms, bool) or not isinstance(delay_ms, int | float) or delay_ms < 0:
        raise MockHTTPError(400, "'mock_delay_ms' must be a number >= 0.", param="mock_delay_ms")
    completion_tokens = int_field(body, "mock_completion_tokens", low=1, high=MAX_COMPLETION_TOKENS)
    return Knobs(
        fail_status=int_field(body, "mock_fail", low=400, high=599),
        fail_after_tokens=int_field(body, "mock_fail_after_tokens", low=0),
        delay_s=delay_ms / 1000.0,
        completion_tokens=completion_tokens or DEFAULT_COMPLETION_TOKENS,
        retry_after_s=int_field(body, "mock_retry_after_s", low=0),
    )


def content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    raise MockHTTPError(
        400, "Message content must be a string or a list of parts.", param="messages"
    )


def _chat_prompt(body: dict[str, Any]) -> tuple[str, int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MockHTTPError(400, "'messages' must be a non-empty array.", param="messages")
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise MockHTTPError(400, "Each message needs a 'role'.", param="messages")
        texts.append(content_text(message.get("content")))
    tokens = sum(count_words(text) for text in texts) + TOKENS_PER_MESSAGE * len(texts)
    return "\n".join(texts), tokens


def _one_prompt(prompt: object) -> tuple[str, int]:
    if isinstance(prompt, str):
        return prompt, count_words(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)
    raise MockHTTPError(
        400, "'prompt' must be a string, a token array, or a list of either.", param="prompt"
    )


def _completion_prompt(body: dict[str, Any]) -> tuple[str, int, int]:
    """The prompt's text and tokens, and how many prompts it is (a batch is a list of them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        pieces = [_one_prompt(item) for item in prompt]
        text = "\n".join(text for text, _ in pieces)
        return text, sum(tokens for _, tokens in pieces), len(pieces)
    return (*_one_prompt(prompt), 1)


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise MockHTTPError(
            400, "'stop' must be a string or a list of non-empty strings.", param="stop"
        )
    if len(stops) > MAX_STOPS:
        raise MockHTTPError(400, f"'stop' takes at most {MAX_STOPS} sequences.", param="stop")
    return tuple(stops)


def parse_completion(body: dict[str, Any], endpoint: Endpoint) -> CompletionRequest:
    model = model_of(body)
    n = int_field(body, "n", low=1, high=128) or 1
    if endpoint is Endpoint.CHAT:
        text, prompt_tokens = _chat_prompt(body)
        prompts = 1
        max_tokens = int_field(body, "max_completion_tokens", low=1)
    else:
        text, prompt_tokens, prompts = _completion_prompt(body)
        max_tokens = None
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", low=1)
    stream = bool_field(body, "stream")
    logprobs = _logprobs(body, endpoint)
    options = body.get("stream_options")
    if options is not None and not stream:  # as OpenAI and vLLM refuse it
        raise MockHTTPError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    if options is not None and not isinstance(options, dict):
        raise MockHTTPError(400, "'stream_options' must be an object.", param="stream_options")
    return CompletionRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=bool_field(options or {}, "include_usage"),
        prompt_text=text,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        answers=n * prompts,
        stops=_stops(body),
        logprobs=logprobs,
    )


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    """How many top alternatives each token's logprobs list; None where not asked for: chat's
    `logprobs: true` (with `top_logprobs`, 0-20), completions' `logprobs` (0-20, as vLLM)."""
    if endpoint is not Endpoint.CHAT:
        return int_field(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    top = int_field(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if not bool_field(body, "logprobs"):
        if top is not None:  # as OpenAI and vLLM refuse it
            raise MockHTTPError(
                400,
                "'top_logprobs' requires 'logprobs' to be set to true.",
                param="top_logprobs",
            )
        return None
    return top or 0


def _embedding_inputs(value: object) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return [value]
    if isinstance(value, list) and value and len(value) <= MAX_EMBEDDING_INPUTS:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, list) and all(type(t) is int for t in item) for item in value):
            return list(value)
    raise MockHTTPError(
        400,
        f"'input' must be a string, a token array, or 1-{MAX_EMBEDDING_INPUTS} of either.",
        param="input",
    )


def parse_embedding(body: dict[str, Any]) -> EmbeddingRequest:
    model = model_of(body)
    inputs = _embedding_inputs(body.get("input"))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise MockHTTPError(
            400, "'encoding_format' must be 'float' or 'base64'.", param="encoding_format"
        )
    keys = tuple(
        b"s:" + item.encode() if isinstance(item, str) else b"t:" + orjson.dumps(item)
        for item in inputs
    )
    tokens = sum(count_words(item) if isinstance(item, str) else len(item) for item in inputs)
    dimensions = int_field(body, "dimensions", low=1, high=MAX_DIMENSIONS)
    return EmbeddingRequest(
        model=model,
        keys=keys,
        prompt_tokens=tokens,
        dimensions=dimensions or 384,
        base64=encoding == "base64",
    )

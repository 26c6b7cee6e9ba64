"""The gateway's one error tree; each error knows its HTTP status and OpenAI error shape.

GatewayError                      500 api_error (never raised bare; the base)
+-- BadRequest                    400 invalid_request_error
|   +-- InvalidJSON               400 invalid_request_error / invalid_json
|   +-- ContextLengthExceeded     400 invalid_request_error / context_length_exceeded
+-- AuthenticationFailed          401 invalid_request_error / invalid_api_key
+-- PermissionDenied              403 permission_error / model_not_allowed
+-- NotFound                      404 invalid_request_error / not_found
|   +-- ModelNotFound             404 invalid_request_error / model_not_found
+-- RequestTimeout                408 invalid_request_error / request_timeout
+-- HeadersTooLarge               431 invalid_request_error / request_headers_too_large
+-- BodyTooLarge                  413 invalid_request_error / request_too_large
+-- RateLimited                   429 rate_limit_error / rate_limit_exceeded (+ Retry-After)
+-- InsufficientQuota             429 insufficient_quota / insufficient_quota (+ Retry-After)
+-- StorageUnavailable            503 api_error / storage_unavailable (+ Retry-After)
+-- ShuttingDown                  503 api_error / server_shutting_down (+ Retry-After)
+-- UpstreamError                 502 api_error / upstream_error
|   +-- UpstreamBadResponse       502 api_error / upstream_bad_response
|   |   +-- UpstreamTooLarge      502 api_error / upstream_response_too_large
|   +-- UpstreamUnavailable       503 api_error / upstream_unavailable (+ Retry-After)
|   +-- UpstreamTimeout           504 api_error / upstream_timeout
+-- InternalError                 500 api_error / internal_error (the outermost handler only)

Every error with a Retry-After also carries `retry-after-ms`; one that retrying cannot fix soon
(a quota that resets more than a minute away, a request larger than a limit) carries
`x-should-retry: false`, which the OpenAI SDKs obey instead of retrying. Every 429 and 503 has a
Retry-After (DESIGN.md), a request no wait will fit too: then the limit's window or the quota's
reset, beside `x-should-retry: false`.
"""

from __future__ import annotations

import math

import orjson

FAR_RETRY_S = 60.0
"""A wait longer than this is not worth a client's automatic retry (the SDKs cap theirs at 60 s)."""
MINUTE_S = 60.0
"""The Retry-After of a request larger than a per-minute limit: the window in which its bucket
refills whole. No wait makes it fit (it also carries `x-should-retry: false`), but the contract
gives every 429 and 503 a Retry-After, and a client that reads only that waits a window."""

__all__ = [
    "FAR_RETRY_S",
    "MINUTE_S",
    "AuthenticationFailed",
    "BadRequest",
    "BodyTooLarge",
    "ContextLengthExceeded",
    "GatewayError",
    "HeadersTooLarge",
    "InsufficientQuota",
    "InternalError",
    "InvalidJSON",
    "ModelNotFound",
    "NotFound",
    "PermissionDenied",
    "RateLimited",
    "RequestTimeout",
    "ShuttingDown",
    "StorageUnavailable",
    "UpstreamBadResponse",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamTooLarge",
    "UpstreamUnavailable",
]


class GatewayError(Exception):
    """A request the gateway answers with an OpenAI-shaped error instead of a completion."""

    status: int = 500
    type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        if should_retry is None and retry_after_s is not None:
            should_retry = retry_after_s <= FAR_RETRY_S
        self.should_retry = should_retry

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None and math.isfinite(self.retry_after_s):
            headers["retry-after"] = str(max(1, round(self.retry_after_s + 0.499)))
            headers["retry-after-ms"] = str(max(1, round(self.retry_after_s * 1000 + 0.499)))
        if self.should_retry is False:
            headers["x-should-retry"] = "false"
        return headers


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"

    @classmethod
    def named(cls, model: str) -> ModelNotFound:
        """OpenAI's 404 for `model`, quoting at most 64 characters of a client's string."""
        shown = model if len(model) <= 64 else model[:64] + "..."
        return cls(
            f"The model `{shown}` does not exist or you do not have access to it.", param="model"
        )


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_headers_too_large"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    # False where the limit refused counts requests or slots, not the tokens reserved (what a
    # degradation rule's bound or model changes).
    on_tokens = True


class InsufficientQuota(GatewayError):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class StorageUnavailable(GatewayError):
    status = 503
    type = "api_error"
    code = "storage_unavailable"


class ShuttingDown(GatewayError):
    status = 503
    type = "api_error"
    code = "server_shutting_down"


class UpstreamError(GatewayError):
    status = 502
    type = "api_error"
    code = "upstream_error"


class UpstreamBadResponse(UpstreamError):
    """A backend answered 2xx with something that is not the answer asked for."""

    code = "upstream_bad_response"


class UpstreamTooLarge(UpstreamBadResponse):
    code = "upstream_response_too_large"


class UpstreamUnavailable(UpstreamError):
    status = 503
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class InternalError(GatewayError):
    status = 500
    type = "api_error"
    code = "internal_error"

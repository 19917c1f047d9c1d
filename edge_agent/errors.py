"""The one exception tree that every layer raises and both API dialects render.

    EdgeAgentError                       500 internal_error
    ├── InvalidRequest                   400 invalid_request_error (names the parameter)
    │   ├── UnsupportedParameter         400 a behaviour-changing parameter not supported here
    │   └── ContextLengthExceeded        400 context_length_exceeded (states both numbers)
    ├── Unauthorized                     401
    ├── Forbidden                        403
    ├── ModelNotFound                    404 model_not_found
    ├── NotFound                         404 another object: a batch or file that does not
    │                                        exist, or is another tenant's
    ├── Conflict                         409 the model's state forbids it (removing the
    │                                        active version, rolling back with no earlier one)
    ├── PayloadTooLarge                  413
    ├── RateLimited                      429 (Retry-After)
    ├── ServiceUnavailable               503 (Retry-After): model loading, switching …
    │   ├── QueueFull                    503 the model's queue (or embedding queue) is full
    │   ├── MemoryShort                  503 no room to load the model: every loaded one serves
    │   ├── DeadlineUnmet                503 the request's deadline ends before its turn
    │   ├── NotDegraded                  503 saturated, and the request's risk tier forbids
    │   │   │                                what else the box could do (a fallback model)
    │   │   └── Deferrable               503 … unless the API turns the request into a
    │   │                                    one-line batch (202): low tier, X-Edge-Defer
    │   ├── ShuttingDown                 503 a stream still running when the stop's drain
    │   │                                    grace ran out: ended with this, not cut silently
    │   └── UpstreamUnavailable          503 the request may run only on an upstream, and
    │                                        none can take it now (breaker open, all busy)
    ├── UpstreamFailed                   502 an upstream answered wrongly: an error, a broken
    │                                        or oversized stream, an answer off its schema
    ├── RequestTimeout                   504
    ├── BodyTimeout                      408 the request body did not arrive in time
    ├── ClientDisconnected               499 the client left before its answer was ready
    └── ModelFileError                   a model file is missing, corrupt or not GGUF
            (500 when met while serving; the CLI reports it as a failed check)

The engine and catalog raise these; `edge_agent.api.errors` maps them to each dialect's
error shape. Nothing below the API layer knows about HTTP beyond the status code.
"""

from __future__ import annotations


class EdgeAgentError(Exception):
    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class InvalidRequest(EdgeAgentError):
    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class ContextLengthExceeded(InvalidRequest):
    """Carries its numbers, so each dialect can word it as that dialect's clients expect."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = None, window: int | None = None,
                 prompt_tokens: int | None = None, output_tokens: int | None = None,
                 input_kind: str = "messages") -> None:
        super().__init__(message, param=param)
        self.window = window
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens  # the reservation that made it overflow, if any
        self.input_kind = input_kind  # "messages" (chat) or "prompt" (completion)


class Unauthorized(EdgeAgentError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(EdgeAgentError):
    status_code = 403
    error_type = "permission_error"
    code = "model_not_allowed"


class ModelNotFound(EdgeAgentError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NotFound(EdgeAgentError):
    """An object of the API other than a model (a batch, a file) that is not there for the
    caller: another tenant's is not found either, so its existence is not revealed."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class Conflict(EdgeAgentError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(EdgeAgentError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(EdgeAgentError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ServiceUnavailable(EdgeAgentError):
    status_code = 503
    error_type = "server_error"
    code = "service_unavailable"


class QueueFull(ServiceUnavailable):
    """A model's queue (or its embedding queue) is full: the metrics count it apart from
    the other reasons a model cannot take a request now."""


class MemoryShort(ServiceUnavailable):
    """The model is not loaded and cannot be now: the memory it needs is held by models
    serving requests. Like a full queue, it is saturation, which a risk tier may answer
    with a degraded service; a model too big for the budget at all is not."""


class DeadlineUnmet(ServiceUnavailable):
    """Requests already wait for the model and the request's own deadline ends before its
    turn would come (by the queue's estimate): refused at once rather than queued to time
    out, and, like a full queue, saturation that a risk tier may answer otherwise."""


class NotDegraded(ServiceUnavailable):
    """The box is saturated and the request's risk tier (or the policy for it) allows no
    degraded answer: refused with the tier and the cause in words an app can show, never
    answered by another model than the one asked."""

    code = "risk_not_degraded"


class Deferrable(NotDegraded):
    """A low-tier request on a saturated box that accepts a later answer: the API layer,
    which holds the request as sent, queues it as a one-line batch and answers 202; where
    it cannot (no batch queue for the endpoint), the refusal stands as a 503."""

    def __init__(self, message: str, *, tier: str, reason: str, model: str,
                 retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.tier = tier
        self.reason = reason
        self.model = model


class ShuttingDown(ServiceUnavailable):
    """A generation cut because the server stops: its answer is incomplete, and the client
    is told so in its dialect (an error object or event ending the stream), not left with a
    connection that just closes. The ledger row says `done_reason = "shutdown"`."""

    code = "shutting_down"


class UpstreamUnavailable(ServiceUnavailable):
    code = "upstream_unavailable"


class UpstreamFailed(EdgeAgentError):
    """An upstream's answer could not be passed on as the box's: it failed, hung, broke
    off, grew past its bound or missed the request's schema."""

    status_code = 502
    error_type = "server_error"
    code = "upstream_error"


class RequestTimeout(EdgeAgentError):
    status_code = 504
    error_type = "timeout_error"
    code = "timeout"


class BodyTimeout(EdgeAgentError):
    """The client's fault, not the server's: its body was too slow (`server.body_timeout_s`)."""

    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class ClientDisconnected(EdgeAgentError):
    """The client left before its answer was ready (nginx's 499; nobody reads the body)."""

    status_code = 499
    error_type = "client_closed_request"
    code = "client_closed_request"


class ModelFileError(EdgeAgentError):
    error_type = "model_file_error"
    code = "model_file_invalid"

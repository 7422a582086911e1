"""Bearer-token authentication of every call but a health check: refusals are counted and
logged, rate limited."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

import grpc

from physis_ros.link.wire import AUTH_METADATA_KEY
from physis_ros.serve.ratelog import RateLimit, held_note

log = logging.getLogger(__name__)

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
"""Health checks need no token: they reveal only SERVING / NOT_SERVING, and load balancers
and probes (grpc_health_probe, Kubernetes) do not carry one."""


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Every call but a health check must carry ``authorization: Bearer <token>``; otherwise
    UNAUTHENTICATED and the handler never runs. Refusals are counted (``on_refused``) and
    logged, at most once per ``log_interval_s`` with the count since."""

    def __init__(
        self,
        token: str,
        *,
        on_refused: Callable[[str], None] | None = None,
        log_interval_s: float = 10.0,
    ) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused
        self._log = RateLimit(log_interval_s)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return continuation(handler_call_details)
        why = "no bearer token"
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
                why = "wrong bearer token"
                break
        self._refused(handler_call_details.method, why)
        handler = continuation(handler_call_details)
        return _refusing_handler(handler)

    def _refused(self, method: str, why: str) -> None:
        if self._on_refused is not None:
            self._on_refused(why)
        held = self._log.due("refused")
        if held is not None:
            log.warning("refused %s: %s%s", method, why, held_note(held))


def _refusing_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_stream_rpc_method_handler(refuse)

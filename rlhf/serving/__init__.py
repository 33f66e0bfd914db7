"""Serving: one process runs a grpc.aio server and a FastAPI app (uvicorn) in one asyncio loop.

What every service uses (see ``services/reward`` for a complete example):

- settings: :class:`ServiceSettings` (``ServiceSettings.from_env(**cli_overrides)``), ``KNOWN_ENV_VARS``,
  :func:`warn_unknown_env_vars`, :func:`configure_logging`;
- errors: :class:`RLHFError` and subclasses, ``ERROR_TABLE`` (error -> gRPC code, HTTP status), :func:`grpc_errors`
  (decorator for async servicer methods), :func:`abort_grpc`, :func:`install_http_errors`, :class:`ErrorBody` and
  :func:`http_error_responses` (the error answers in OpenAPI);
- HTTP: :func:`create_app` (FastAPI with ``/healthz``, ``/readyz``, ``/metrics``, error handlers, body-size limit),
  :func:`json_response` (hot routes: render plain data once, no response_model pass);
- auth: :func:`require_token`, :func:`require_grpc_token`, :func:`http_token_dependency`, :func:`grpc_auth_metadata`;
- metrics: :class:`ServiceMetrics` (own CollectorRegistry per service);
- running: :class:`ServiceRunner` (``add_grpc``, ``set_http_app``, ``set_ready``, ``add_readiness_check``,
  ``await run(startup=..., shutdown=...)``), :func:`open_channel` / :func:`grpc_options` for clients
  (TLS per the settings: :func:`client_credentials`, :func:`client_ssl_context`).

A service package provides ``services/<name>/main.py`` with ``serve(config_path: str, settings: ServiceSettings)``
(a coroutine function; ``rlhf serve <name>`` runs it with ``asyncio.run``).
"""

from rlhf.serving.auth import (
    grpc_auth_metadata,
    grpc_bearer,
    http_token_dependency,
    parse_bearer,
    require_grpc_token,
    require_token,
)
from rlhf.serving.errors import (
    ERROR_TABLE,
    ClientDisconnected,
    DeadlineExceeded,
    ErrorBody,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    MethodNotAllowed,
    NotFound,
    NotReady,
    PayloadTooLarge,
    PermissionDenied,
    RequestValidationFailed,
    ResourceExhausted,
    RLHFError,
    Unauthenticated,
    abort_grpc,
    error_body,
    grpc_errors,
    http_error_response,
    http_error_responses,
    install_http_errors,
    status_for,
)
from rlhf.serving.http import cancel_on_disconnect, create_app, json_response
from rlhf.serving.metrics import ServiceMetrics
from rlhf.serving.runner import ServiceRunner, client_credentials, client_ssl_context, grpc_options, open_channel
from rlhf.serving.settings import (
    KNOWN_ENV_VARS,
    ServiceSettings,
    configure_logging,
    register_env_var,
    unknown_env_vars,
    warn_unknown_env_vars,
)

__all__ = [
    "ERROR_TABLE",
    "KNOWN_ENV_VARS",
    "ClientDisconnected",
    "DeadlineExceeded",
    "ErrorBody",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "MethodNotAllowed",
    "NotFound",
    "NotReady",
    "PayloadTooLarge",
    "PermissionDenied",
    "RLHFError",
    "RequestValidationFailed",
    "ResourceExhausted",
    "ServiceMetrics",
    "ServiceRunner",
    "ServiceSettings",
    "Unauthenticated",
    "abort_grpc",
    "cancel_on_disconnect",
    "client_credentials",
    "client_ssl_context",
    "configure_logging",
    "create_app",
    "error_body",
    "grpc_auth_metadata",
    "grpc_bearer",
    "grpc_errors",
    "grpc_options",
    "http_error_response",
    "http_error_responses",
    "http_token_dependency",
    "install_http_errors",
    "json_response",
    "open_channel",
    "parse_bearer",
    "register_env_var",
    "require_grpc_token",
    "require_token",
    "status_for",
    "unknown_env_vars",
    "warn_unknown_env_vars",
]

"""Serving: one process runs a grpc.aio server and a FastAPI app (uvicorn) in one asyncio loop.

What every service uses, re-exported here: settings (:class:`ServiceSettings`), errors (:class:`RLHFError`,
``ERROR_TABLE``, :func:`grpc_errors`, :func:`install_http_errors`), HTTP (:func:`create_app`, :func:`json_response`),
auth (:func:`require_token`, :func:`require_grpc_token`), metrics (:class:`ServiceMetrics`) and running
(:class:`ServiceRunner`, :func:`open_channel`). A service package provides ``services/<name>/main.py`` with
``serve(config_path: str, settings: ServiceSettings)``, which ``rlhf serve <name>`` runs with ``asyncio.run``; see
``services/reward`` for a complete example. Design: docs/services.md#common-to-every-service.
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

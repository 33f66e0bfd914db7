"""Bearer-token checks for weight sync and admin calls (``RLHF_API_TOKEN``, compared in constant time).

A server without a configured token refuses every protected call (PermissionDenied): protection cannot be turned
off by forgetting to set the variable. A missing or wrong token is Unauthenticated (401 / UNAUTHENTICATED).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rlhf.serving.errors import PermissionDenied, Unauthenticated

if TYPE_CHECKING:  # pragma: no cover
    import grpc

    from rlhf.serving.settings import ServiceSettings

AUTH_METADATA_KEY = "authorization"


def parse_bearer(value: str | bytes | None) -> str | None:
    """``"Bearer abc"`` -> ``"abc"``; anything else -> None."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require_token(expected: ServiceSettings | str | None, presented: str | None) -> None:
    """Raise unless ``presented`` equals the configured token. ``expected``: the settings or the token itself."""
    if expected is not None and not isinstance(expected, str):
        expected = expected.api_token
    if not expected:
        raise PermissionDenied(
            "this server has no API token configured, so weight-sync and admin calls are disabled; "
            "start it with RLHF_API_TOKEN set"
        )
    if not presented:
        raise Unauthenticated(
            "missing token: send 'authorization: Bearer <RLHF_API_TOKEN>' (HTTP header or gRPC metadata)",
            field="authorization",
        )
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthenticated("invalid token: it does not match the server's RLHF_API_TOKEN", field="authorization")


def grpc_bearer(context: grpc.aio.ServicerContext) -> str | None:
    """The bearer token in a call's ``authorization`` metadata, if any."""
    for key, value in context.invocation_metadata() or ():
        if key.lower() == AUTH_METADATA_KEY:
            return parse_bearer(value)
    return None


def require_grpc_token(context: grpc.aio.ServicerContext, settings: ServiceSettings | str | None) -> None:
    """For servicer methods (inside :func:`rlhf.serving.grpc_errors`, which turns the raise into the status)."""
    require_token(settings, grpc_bearer(context))


def http_token_dependency(settings: ServiceSettings | str | None) -> Any:
    """A FastAPI dependency: ``@app.post("/admin", dependencies=[Depends(http_token_dependency(settings))])``.

    The route's OpenAPI operation then names the bearer scheme (``security``) and, through
    :class:`rlhf.serving.http.ContractRoute`, its 401 and 403 answers."""
    scheme = HTTPBearer(
        auto_error=False,  # the check below decides (and says what is wrong)
        scheme_name="bearer",
        description="the server's RLHF_API_TOKEN, as 'Authorization: Bearer <token>'",
    )

    async def _check(request, declared=Security(scheme)) -> None:  # noqa: B008 - FastAPI's way to declare it
        require_token(settings, parse_bearer(request.headers.get("authorization")))

    # real classes: this module uses string annotations
    _check.__annotations__ = {"request": Request, "declared": HTTPAuthorizationCredentials | None, "return": None}
    _check.rlhf_requires_token = True  # type: ignore[attr-defined]
    return _check


def grpc_auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Client side: metadata to pass as ``metadata=`` on a protected call."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()

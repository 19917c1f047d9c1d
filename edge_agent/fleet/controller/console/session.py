"""The console's session: the operator token in a cookie, and the CSRF token its forms
carry.

The cookie holds the token itself (HttpOnly: no script reads it; SameSite=Strict: no other
site's page sends it; Secure on HTTPS; 12 hours), so a revoked token ends the session at
the next request, as it does for the API. The store keeps no session of its own.

Every form that changes something carries `csrf`, an HMAC of the session's token: a page
of another origin cannot read it, so a forged POST riding on the cookie is refused (403)
even where a browser would send the cookie. The API's routes never take the cookie (only
`Authorization: Bearer`), so they need no such token.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "edge_fleet_session"
MAX_AGE_S = 12 * 3600


def session_token(request: Request) -> str | None:
    return request.cookies.get(COOKIE) or None


def csrf_for(token: str) -> str:
    return hmac.new(token.encode(), b"edge-agent console csrf", hashlib.sha256).hexdigest()


def csrf_ok(request: Request, sent: str | None) -> bool:
    """Whether a form may act: it carries the session's CSRF token, or the request was
    authenticated by its own `Authorization` header, which no other site's page can add
    (the controller allows no cross-origin requests)."""
    if "authorization" in request.headers:
        return True
    token = session_token(request)
    if not token or not sent:
        return False
    return hmac.compare_digest(csrf_for(token), sent)


def open_session(response: Response, request: Request, token: str) -> None:
    response.set_cookie(COOKIE, token, max_age=MAX_AGE_S, path="/", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def close_session(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")

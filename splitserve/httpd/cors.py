"""Cross-origin requests from browsers (CORS), for the origins the operator allows only.

A preflight (OPTIONS with Origin and Access-Control-Request-Method) from an allowed origin
is answered 204 before the API-key check (a browser sends no credentials with it); one
from any other origin is served as any request is (405, or 401 without the key). Every
answer to a request from an allowed origin says so (Access-Control-Allow-Origin), and lets
the page read X-Request-Id.
"""

from __future__ import annotations

from splitserve.httpd.messages import Request, Response

ANY = "*"
MAX_AGE = "600"     # seconds a browser may keep a preflight's answer


def parse_origins(given: str | list) -> tuple[str, ...]:
    """--allowed-origins: comma-separated origins (`https://app.example.com`), or `*`; a
    cluster file may list them."""
    items = given.split(",") if isinstance(given, str) else given
    if not all(isinstance(o, str) for o in items):
        raise ValueError("allowed_origins must be origins (strings)")
    return tuple(o.strip().rstrip("/") for o in items if o.strip())


class CORS:
    def __init__(self, origins: tuple[str, ...]):
        self.any, self.origins = ANY in origins, frozenset(origins)

    def allowed(self, request: Request) -> str | None:
        """The request's Origin if it is allowed, else None."""
        origin = request.header("Origin")
        if origin is not None and (self.any or origin in self.origins):
            return origin
        return None

    def is_preflight(self, request: Request) -> bool:
        return (request.method == "OPTIONS" and request.header("Access-Control-Request-Method")
                is not None and self.allowed(request) is not None)

    def preflight(self, request: Request) -> Response:
        """The answer to a preflight (is_preflight) from an allowed origin."""
        asked = request.header("Access-Control-Request-Headers")
        return Response(b"", 204, headers={
            "Access-Control-Allow-Methods": "GET, POST",
            "Access-Control-Allow-Headers": asked or "Authorization, Content-Type, X-Request-Id",
            "Access-Control-Max-Age": MAX_AGE})

    def echo(self, request: Request) -> dict[str, str]:
        """The headers an answer to `request` carries for its Origin (none if not allowed)."""
        origin = self.allowed(request)
        if origin is None:
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Expose-Headers": "X-Request-Id"}

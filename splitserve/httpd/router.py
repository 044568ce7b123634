"""One routing table for an HTTP application (the worker front-end, the orchestrator, a
fleet's control port): path -> the method it takes, its handler, and the body it may send.

A request is routed as soon as its head is in, before a byte of its body is buffered: the
application's head check (HTTPServer's `check_head`) asks `find`, so an unknown path (404),
a wrong method (405) or a body longer than its route reads (413) is answered at once. HEAD
is GET without the body.
"""

from __future__ import annotations

from typing import Awaitable, Callable, NamedTuple

from splitserve.httpd.messages import ChunkedStream, Request, Response

Handler = Callable[[Request], Awaitable["Response | ChunkedStream"]]
ErrorBody = Callable[[str, int], bytes]   # (message, HTTP status) -> a JSON body

NO_BODY = 64 << 10   # a GET's body (HTTP gives it no meaning): read up to this, then 413
ANY = "*"


class Route(NamedTuple):
    method: str        # "GET" (HEAD too), "POST", or ANY: the handler checks it
    handler: Handler
    max_body: int      # bytes of request body this route reads


class Router:
    def __init__(self, routes: dict[str, Route], error_body: ErrorBody):
        self.routes, self.error_body = routes, error_body

    def find(self, request: Request) -> Route | Response:
        """The request's route, or the 404 / 405 / 413 to answer instead."""
        route = self.routes.get(request.path)
        if route is None:
            return self.error(404, f"no endpoint {request.path}")
        if request.method != route.method and route.method != ANY \
                and (request.method, route.method) != ("HEAD", "GET"):
            return self.error(405, f"{request.path} takes {route.method}, not {request.method}")
        length = request.content_length
        if length is not None and length > route.max_body:
            return self.error(413, too_large(route.max_body))
        return route

    async def dispatch(self, request: Request) -> Response | ChunkedStream:
        """Run the request's handler (its head passed find)."""
        route = self.routes[request.path]
        return await route.handler(request)

    def error(self, status: int, message: str) -> Response:
        return Response(self.error_body(message, status), status)


def too_large(limit: int) -> str:
    return f"request body too large (limit {limit} bytes)"

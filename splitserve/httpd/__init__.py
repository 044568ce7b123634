"""The HTTP/1.1 server of the worker front-end and the orchestrator (httptools on the running
event loop)."""

from splitserve.httpd.limits import HTTPLimits
from splitserve.httpd.messages import ChunkedStream, Request, Response, json_response
from splitserve.httpd.server import HTTPServer

__all__ = ["ChunkedStream", "HTTPLimits", "HTTPServer", "Request", "Response", "json_response"]

"""Internal requests from synchronous code (urllib): a worker's registration with an
orchestrator (server/registration.py), `bench frontend` reading its worker, the tests.

As the orchestrator does (trust.py): learn the target's instance id through the challenge
on its /health, send that instance's token, and on a 403 learn the id again once (the
target restarted) and try once more. No redirect is followed: a 3xx is raised as an
HTTPError, so no header or body reaches a server the caller did not name.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import urlsplit

from splitserve.trust import CHALLENGE_HEADER, IDENTITY_HEADER, INTERNAL_HEADER, Keys, new_challenge


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None     # urllib then raises the 3xx as an HTTPError


OPENER = urllib.request.build_opener(_NoRedirects)


class NotProven(OSError):
    """The server did not prove that it holds the cluster's internal secret."""


def base_url(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class InternalClient:
    """Calls servers of the cluster whose secret is `secret`; remembers each one's instance
    id (per base url) until it refuses a token."""

    def __init__(self, secret: str):
        self.keys = Keys(secret)
        self.instances: dict[str, str] = {}

    def learn(self, url: str, timeout: float = 10.0) -> str:
        """The instance id the server at url proves it is (NotProven if it does not)."""
        base, nonce = base_url(url), new_challenge()
        request = urllib.request.Request(base + "/health", headers={CHALLENGE_HEADER: nonce})
        try:
            with OPENER.open(request, timeout=timeout) as r:
                answer = r.headers.get(IDENTITY_HEADER)
        except urllib.error.HTTPError as exc:
            # an orchestrator with no healthy worker answers 503, and still proves who it is
            answer = exc.headers.get(IDENTITY_HEADER)
            exc.close()
        instance = self.keys.verify(nonce, answer)
        if instance is None:
            raise NotProven(f"{base} did not prove that it holds the cluster's internal secret")
        self.instances[base] = instance
        return instance

    def headers(self, url: str, timeout: float = 10.0) -> dict[str, str]:
        """The header an internal request to url carries (its server's token)."""
        instance = self.instances.get(base_url(url)) or self.learn(url, timeout)
        return {INTERNAL_HEADER: self.keys.token(instance)}

    def urlopen(self, request: urllib.request.Request, timeout: float = 10.0):
        """OPENER.open(request) with the target's token; on a 403, once more with the token
        of the instance it proves it is now."""
        for last in (False, True):
            for name, value in self.headers(request.full_url, timeout).items():
                request.add_header(name, value)
            try:
                return OPENER.open(request, timeout=timeout)
            except urllib.error.HTTPError as exc:
                if exc.code != 403 or last:
                    raise
                exc.close()
                self.instances.pop(base_url(request.full_url), None)

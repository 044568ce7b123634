"""The address a server listens on, as its operator should know it: whether clients beyond
this machine reach it (and are served with no key when no API key is set), and the URL by
which this machine reaches it."""

from __future__ import annotations

import ipaddress
import logging
import socket

logger = logging.getLogger(__name__)

WILDCARDS = ("", "0.0.0.0", "::")     # every interface
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def is_loopback(host: str) -> bool:
    """Only this machine can reach host: a loopback address, or a name whose every address
    is one (localhost). A name that does not resolve is not known to be."""
    if host in WILDCARDS:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                   for a in addresses)


def warn_if_open(log_prefix: str, host: str, api_key: str | None) -> None:
    """One line at WARNING when a server without an API key listens beyond loopback."""
    if api_key or is_loopback(host):
        return
    logger.warning("%s: listening on %s without an API key: any client that reaches it is "
                   "served, no key needed (set --api-key or SPLITSERVE_API_KEY)", log_prefix,
                   host or "every interface")


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def local_url(host: str, port: int) -> str:
    """The URL this machine reaches a server listening on host at (a wildcard: loopback)."""
    return http_url(_LOOPBACK.get(host, host), port)

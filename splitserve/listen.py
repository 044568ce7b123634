"""The address a server listens on, as its operator should know it: whether clients beyond
this machine reach it (and are served with no key when no API key is set), and the URL by
which this machine reaches it."""

from __future__ import annotations

import errno
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


def port_in_use(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now (another process holds it, an address
    this machine lacks), in one line; None: it can. Checked before a server loads anything,
    so a busy port costs no model load and no traceback. (Port 0 is always free.)"""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as the server binds it: a port left in TIME_WAIT by a server just stopped is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"port {port} on {host or 'every interface'} is already in use "
                        f"(another server is listening there); choose another with --port")
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None

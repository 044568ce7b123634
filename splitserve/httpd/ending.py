"""How an HTTP/1.1 connection ends (mixed into protocol.py's HTTPConnection): the sweep's
timeouts, a refused connection's linger, and a client that half-closes.

A client's FIN looks the same whether it shut down only its sending side (it still reads:
answer what it sent, as HTTP/1.1 allows) or closed its socket (gone: its handler should
stop, as when the connection drops). A `100 Continue`, which an HTTP/1.1 client skips as it
would any interim response, tells them apart: a closed socket's kernel answers it with a
reset, which SO_ERROR shows.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios

from splitserve.httpd.reader import HEAD

logger = logging.getLogger(__name__)

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER = 2.0           # s a refused connection reads and drops what its client still sends
MAX_LINGERING = 256    # refused connections lingering at once; past it one closes at once
PROBE_WAIT = 0.05      # s after a probe to look for the reset a closed socket answers


class Ending:
    """Mixed into HTTPConnection, which provides its transport, server, limits, loop,
    queue, task, stream, the reading and writing state, and refuse()."""

    def eof_received(self) -> bool:
        """The client sends nothing more. What it sent is still answered (HTTP/1.1 allows a
        half-closed connection): keep the transport open for writing until then."""
        self._eof = True
        if self._lingering or (self.task is None and not self.queue):
            return False                # nothing to answer: the transport closes
        self._stopped, self.reading, self._continue = True, 0, False
        self._probe()
        return True

    def input_waiting(self) -> bool:
        """Bytes have arrived that the loop has not read yet."""
        sock = self.transport.get_extra_info("socket")
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD,
                                                  b"\0\0\0\0"))[0] > 0
        except (OSError, AttributeError):
            return False

    def _probe(self) -> None:
        """Is a half-closed client still there (the module's docstring)? expire() looks
        again for the reset, every sweep."""
        if self._http11 and self.stream is None:
            self.transport.write(CONTINUE)
            self.loop.call_later(PROBE_WAIT, self._check_gone)

    def _check_gone(self) -> None:
        sock = self.transport.get_extra_info("socket")
        if not self.transport.is_closing() and sock is not None \
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()      # connection_lost: the handler is cancelled

    def _linger(self) -> None:
        """Close after a refusal without a reset: closing with unread input resets the
        connection, and a client still sending would lose our answer with it. So: no more
        writes (FIN after the answer), drop whatever arrives, abort after LINGER seconds.
        Past MAX_LINGERING such connections, close at once (each holds a descriptor)."""
        self._stopped = True
        if self.server.lingering >= MAX_LINGERING or self._eof:
            self.transport.close()
            return
        self._lingering = True
        self.server.lingering += 1
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self.loop.call_later(LINGER, self.transport.abort)

    def expire(self, now: float) -> None:
        """The server's sweep (a timestamp per request, not a timer): a keep-alive connection
        idle past keepalive_timeout closes; a request whose head or body stopped arriving is
        answered 408; one whose client has read nothing for send_timeout is dropped. A clock
        stands while the server is the one not reading. A connection that has sent nothing
        closes after first_byte_timeout."""
        limits = self.limits
        if not self.received and now - self.created > limits.first_byte_timeout:
            self.transport.close()
        elif self._eof and self.task is not None:
            self._check_gone()
        elif self.write_paused and now - self.write_paused_since > limits.send_timeout:
            logger.info("%s: a client read nothing for %g s: connection dropped",
                        self.server.log_prefix, limits.send_timeout)
            self.transport.abort()
        elif self.reading:
            if self._read_paused or self._continue:
                return
            limit = limits.head_timeout if self.reading == HEAD else limits.body_timeout
            if now - self.reading_since > limit:
                part = "line and headers" if self.reading == HEAD else "body"
                self.refuse(408, f"the request {part} did not arrive within {limit:g} s")
        elif self.idle_since is not None and now - self.idle_since > limits.keepalive_timeout:
            self.transport.close()

"""The log filter that keeps the cluster's internal secret (and anything registered with
it) out of every log line and traceback."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

from splitserve import redact


def test_the_log_filter_hides_the_secret_and_every_derived_value():
    secret, token, proof = "a secret only this test knows", "0123abcd" * 8, "4567cdef" * 8
    for value in (secret, token, proof):    # (trust.Keys registers what it derives)
        redact.sensitive(value)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(redact.RedactingFilter())
    log = logging.getLogger("test_redaction")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("secret %s, headers %r", secret, {"X": token})
        try:
            raise ValueError(f"an error that quotes {proof}")
        except ValueError:
            log.exception("failed with %s", proof)
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert secret not in text and token not in text
    assert proof not in text and text.count(redact.MARKER) == 4, text
    assert "ValueError: an error that quotes [redacted]" in text


def test_every_command_logs_through_the_filter():
    """cli.main installs the filter: a line naming the secret comes out redacted."""
    code = ("import logging, os, sys; from splitserve import cli; "
            "cli._up = lambda args: logging.getLogger('splitserve.x').warning("
            "'the secret: %s', os.environ['SPLITSERVE_INTERNAL_SECRET']) or 0; "
            "sys.exit(cli.main(['up']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, SPLITSERVE_INTERNAL_SECRET="a-secret-to-hide"),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "the secret: [redacted]" in proc.stderr and "a-secret-to-hide" not in proc.stderr

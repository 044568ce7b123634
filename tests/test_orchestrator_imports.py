"""The orchestrator is a proxy: it must start without loading torch (1+ s and hundreds of
MB for nothing it uses)."""

import subprocess
import sys


def test_orchestrator_imports_no_torch():
    code = "import splitserve.orchestrator.app, sys; assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

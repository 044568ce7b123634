"""`splitserve bench chaos`: a small fixed-seed campaign against a real cluster (two CTX,
two GEN with two front-ends each, two orchestrator processes), KV transfer faults among its
faults, holds every invariant."""

import json
import subprocess
import sys


def test_a_fixed_seed_campaign_holds_every_invariant(tmp_path):
    out, log = tmp_path / "chaos.json", tmp_path / "cluster.log"
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "bench", "chaos", "--seed", "1",
         "--schedules", "2", "--requests", "6", "--json", str(out), "--log", str(log)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + log.read_text()[-3000:]
    result = json.loads(out.read_text())
    assert result["schedules"] == 2 and result["violations"] == []
    assert result["requests"] == 12 and sum(result["outcomes"].values()) == 12
    # seed 1 draws 6 faults: SIGKILL of a GEN engine, of an orchestrator process and of a CTX
    # worker, SIGTERM of a GEN worker, two client disconnects (a fault whose target is
    # down at its moment, restarting after an earlier one, is not injected)
    assert sum(result["faults_injected"].values()) >= 4, result
    # ... and 4 KV faults: a reordered and a duplicated frame in schedule 0, a delayed answer
    # and a duplicated frame in schedule 1, each taken by the next pull a CTX answers after
    # its moment, or left for none (armed after the schedule's last pull)
    kv = {k: n for k, n in result["faults_injected"].items() if k.startswith("kv_")}
    assert set(kv) <= {"kv_reorder", "kv_duplicate", "kv_delay"}, result
    assert sum(kv.values()) + result["kv_faults_not_struck"] == 4, result
    assert sum(kv.values()) >= 1, result   # the delay at 0.134 s, before 5 requests start

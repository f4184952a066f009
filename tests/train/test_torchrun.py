"""``python -m dtdsl.train.torchrun``: torchrun as launch.sh runs it, which a SIGTERM (the
supervisor stopping the job) ends without a traceback, with the shell's status for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_sigterm_ends_torchrun_with_its_status_and_no_traceback(tmp_path):
    script = tmp_path / "work.py"
    started = tmp_path / "started"
    script.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\n"
                      "time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dtdsl.train.torchrun", "--standalone",
                             "--nproc-per-node", "1", "--monitor-interval", "0.1",
                             str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "SignalException" not in err, err

"""Log lines from several processes sharing one stdout stay whole lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOGGING_PROCESS = """
import sys
from worker.logs import configure
import structlog
configure("json", "info")
log = structlog.get_logger()
for i in range(int(sys.argv[1])):
    log.info("a line", process=sys.argv[2], i=i, padding="x" * 200)
"""


def test_json_lines_of_processes_sharing_an_unbuffered_stdout_never_interleave(tmp_path: Path) -> None:
    """Broker processes share the worker's stdout, which the deploy files leave unbuffered
    (PYTHONUNBUFFERED=1): each line must reach it in one write, or two processes' lines mix into one."""
    lines, processes = 3000, 3
    out = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    with open(out, "w") as f:
        procs = [subprocess.Popen([sys.executable, "-c", LOGGING_PROCESS, str(lines), str(p)],
                                  stdout=f, env=env) for p in range(processes)]
        assert [p.wait(120) for p in procs] == [0] * processes
    parsed = [json.loads(line) for line in out.read_text().splitlines()]
    for p in range(processes):
        assert [x["i"] for x in parsed if x["process"] == str(p)] == list(range(lines))

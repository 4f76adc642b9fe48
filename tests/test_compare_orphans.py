"""Issue 41 item 3: ``kill -9`` of ``compare --workers 2`` at any moment of the pool's start-up leaves no
process behind (workers, multiprocessing's resource tracker) beyond the promised
:data:`~difftx.compare.workers.ORPHAN_GRACE_S`. Before, a parent killed while its workers were still
starting (importing torch) left them running under PID 1 for ever: each recorded ``os.getppid()``
when its initializer ran, after the parent was gone, and so watched its new parent.

The parent is killed from a hook (``DIFFTX_TEST_KILL_PARENT_AT``), right after a named stage, never
after a sleep; the processes of one run are found by an environment variable only they carry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from difftx.compare.workers import KILL_PARENT_AT, NO_PDEATHSIG, ORPHAN_GRACE_S, ORPHAN_POLL_S
from test_compare import FAST, as_sets

MARK = "DIFFTX_TEST_ORPHAN_MARK"
# a job that would train for minutes if its worker outlived compare
SETTINGS = {**FAST, "steps": 3000, "log_every": 1, "probe_every": 0}


def _marked(mark: str) -> list[int]:
    """The live (not zombie) processes whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode() + b"\0"
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (proc / "environ").read_bytes():
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, IndexError):
            continue
        found.append(int(proc.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
@pytest.mark.parametrize("stage, watcher_only", [
    ("pool", False),         # compare dies before the pool starts: nothing may be left (no tracker either)
    ("spawned", False),      # the workers are started, none has imported difftx or run its initializer
    ("initializer", False),  # inside a worker's initializer, after its parent check: PR_SET_PDEATHSIG notices
    ("initializer", True),   # ... the same without PR_SET_PDEATHSIG: the watcher thread alone must notice
    ("job", False),          # as a worker starts its first job
    ("job", True),
])
def test_no_process_outlives_a_killed_compare(tmp_path, stage, watcher_only):
    root = Path(__file__).resolve().parents[1]
    mark = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: mark, KILL_PARENT_AT: stage,
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(NO_PDEATHSIG, None)
    if watcher_only:
        env[NO_PDEATHSIG] = "1"
    cmd = ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(tmp_path / "run"), "--workers", "2",
           "--no-progress", *as_sets(SETTINGS)]
    entry = "import sys; from difftx.cli import main; sys.exit(main(sys.argv[1:]))"
    log = tmp_path / "output.txt"  # a file, not a pipe: a surviving worker would hold a pipe open
    try:
        with open(log, "w") as output:
            proc = subprocess.Popen([sys.executable, "-c", entry, *cmd], env=env, cwd=str(root),
                                    stdout=output, stderr=output, start_new_session=True)
            assert proc.wait(timeout=180) == -signal.SIGKILL, log.read_text()[-3000:]
        dead = time.monotonic()
        assert f"SIGKILL compare after stage {stage!r}" in log.read_text(), log.read_text()[-3000:]
        # the promise: a worker exits within ORPHAN_GRACE_S of noticing (twice a second) that compare died
        deadline = dead + ORPHAN_GRACE_S + 2 * ORPHAN_POLL_S + 5
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _marked(mark)
        detail = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[-120:] for p in left}
        assert not left, f"left {time.monotonic() - dead:.0f} s after compare died: {detail}\n{log.read_text()[-2000:]}"
    finally:
        for pid in _marked(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

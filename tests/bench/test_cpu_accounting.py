"""benchmarks/cpu_accounting.py: the CPU a process tree spends during a block, by process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.cpu_accounting import cpu_use

# A child that, told to go, burns 0.5 s of CPU, says so and waits (its parent waits for it;
# both share stdin and stdout with the test).
_CHILD = ("import sys, time\n"
          "sys.stdin.readline()\n"
          "start = time.process_time()\n"
          "while time.process_time() - start < 0.5: pass\n"
          "print('burnt', flush=True)\n"
          "sys.stdin.readline()\n")
_PARENT = ("import subprocess, sys\n"
           "subprocess.run([sys.executable, 'burner.py'])\n")


def test_a_busy_child_is_counted_and_its_idle_parent_is_not(tmp_path: Path) -> None:
    (tmp_path / "burner.py").write_text(_CHILD)
    tree = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        with cpu_use(tree.pid) as use:
            tree.stdin.write("go\n")
            tree.stdin.flush()
            assert tree.stdout.readline().strip() == "burnt"
        burner = use.by_process.pop(Path(sys.executable).name)
        assert 0.4 < burner < 1.5
        assert use.by_process["launcher"] < 0.2
        assert use.by_process["bench client"] < 0.2     # no child of this process ran
        assert "launcher" in use.report()
    finally:
        tree.stdin.write("\n")
        tree.stdin.flush()
        tree.wait(timeout=10)

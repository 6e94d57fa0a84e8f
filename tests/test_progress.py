"""``--progress=SECONDS`` (``make test``): a line at most every SECONDS with the tests done and
failed, the files running and the slowest tests so far, printed while the run goes on."""
import subprocess
import sys

from conftest import ROOT, process_env


def test_progress_lines_name_the_running_file_and_the_slowest_tests(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(1.5)\n\n"
        "def test_fails():\n    assert False\n\ndef test_last():\n    time.sleep(1.2)\n")
    # the suite's conftest as a plugin (its --progress option), imported from its folder
    env = process_env(ROOT / "tests", ROOT, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conftest", "--progress=1", str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "tests done" in line]
    assert lines, proc.stdout[-2000:]
    last = lines[-1]
    assert "3 tests done, 1 failed" in last and "running test_a.py" in last, last
    assert "slowest so far: test_a.py::test_slow 2 s" in last, last

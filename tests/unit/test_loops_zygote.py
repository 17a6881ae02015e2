"""When ``heteroplane serve`` forks the loops zygote, and when it starts the loops process with
``python -m`` instead (controlplane/cli/loops_process.py; the zygote at work, its restarts and
its end with the serving process: tests/integration/test_serve_two_processes.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from controlplane.cli import loops_process
from controlplane.cli.loops_process import _forkable, _ForkedChild, _Zygote


def test_a_process_with_another_python_thread_forks_no_zygote() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, daemon=True)
    thread.start()
    try:
        assert not _forkable()
        assert _Zygote.fork() is None
    finally:
        release.set()
        thread.join()


def test_a_process_that_imported_torch_forks_no_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", sys)
    assert not _forkable()


def test_without_pidfd_open_no_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(loops_process.os, "pidfd_open", raising=False)
    assert _Zygote.fork() is None


def test_the_rule_in_a_fresh_interpreter() -> None:
    """A fresh interpreter that imported the service (NumPy's native BLAS threads included, no
    Python thread) may fork; the same with a Python thread running may not."""
    code = (
        "import threading, controlplane.service.build\n"
        "from controlplane.cli.loops_process import _forkable\n"
        "print(_forkable())\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "print(_forkable())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["True", "False"]


def test_a_forked_childs_handle_waits_for_the_status_the_zygote_reports() -> None:
    child = _ForkedChild(pid=2**22 + 7)  # no such process: signals to it are ignored
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.01)
    child.send_signal(15)
    child.exited(-9)
    assert child.poll() == -9 and child.wait() == -9
    child.kill()  # exited: nothing is sent

"""rlhf.serving.model_process with a real child process and a test handler: frames carry JSON headers and raw bytes
both ways, a library's stdout output does not corrupt them, errors come back as their error class with message and
field (unknown ones as Internal), a child that dies fails the call in flight and the next call starts a new one, and
a child that cannot load refuses to start."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlhf.serving import Internal, InvalidArgument
from rlhf.serving.model_process import ModelProcess, forward_threads

TARGET = "tests.unit.rlhf.serving._model_process_handlers:echo"


@pytest.fixture
def proc():
    p = ModelProcess(TARGET, {"size": "tiny"}, "test")
    yield p
    p.close()


def test_frames_round_trip_and_stdout_is_kept_out(proc):
    hello = proc.start()
    assert hello["size"] == "tiny" and hello["pid"] == proc.pid != os.getpid()
    payload = bytes(range(256)) * 1000
    head, out = proc.call({"op": "echo", "x": [1.5, "é"]}, payload)
    assert head == {"n": len(payload), "header": {"op": "echo", "x": [1.5, "é"]}} and out == payload[::-1]
    assert proc.call({"op": "print"}) == ({"printed": True}, b"")
    assert proc.call({"op": "echo"}, b"ab")[1] == b"ba"  # still in step after the print


def test_errors_keep_their_class_message_and_field(proc):
    proc.start()
    with pytest.raises(InvalidArgument) as err:
        proc.call({"op": "invalid"})
    assert (err.value.message, err.value.field) == ("items[3] is bad", "items[3]")

    class Overflow(Internal):
        pass

    proc.error_classes = {"_Overflow": Overflow}  # a service's own class, mapped by name
    with pytest.raises(Overflow) as err:
        proc.call({"op": "custom"})
    assert err.value.field == "items[0]"
    with pytest.raises(Internal, match="unknown op nope"):  # any other failure: Internal, with its message
        proc.call({"op": "nope"})
    assert proc.call({"op": "echo"}, b"xy")[1] == b"yx"


def test_a_dead_child_fails_its_call_and_the_next_call_starts_another(proc):
    first = proc.start()["pid"]
    with pytest.raises(Internal, match=r"exited \(code 7\)"):
        proc.call({"op": "crash"})
    head, out = proc.call({"op": "echo"}, b"12")
    assert out == b"21" and proc.pid != first


def test_a_child_that_cannot_load_refuses_to_start():
    p = ModelProcess(TARGET, {"fail_loading": "tiny:nothing"}, "test")
    with pytest.raises(RuntimeError, match="could not load the model: no such model: tiny:nothing"):
        p.start()
    assert p.pid is None


@pytest.mark.parametrize(
    ("requested", "omp", "want"),
    [(None, "4", 3), (None, "2", 1), (None, "1", 1), (3, "1", 3), (None, None, None)],
)
def test_forward_threads_leave_the_serving_loop_a_core(monkeypatch, requested, omp, want):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        want = max(1, len(os.sched_getaffinity(0)) - 1)  # the cores this process may use, less one
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert forward_threads(requested) == want


def test_the_child_outlives_a_signal_to_the_group_and_ends_with_its_input(proc):
    """SIGTERM / SIGINT to the process group (Ctrl-C, a supervisor) leave the child serving while the service drains;
    closing its input ends it."""
    proc.start()
    child = proc._proc
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(proc.pid, sig)
    time.sleep(0.2)
    assert proc.call({"op": "echo"}, b"ok")[1] == b"ko" and proc.pid == child.pid
    proc.close()
    assert child.poll() is not None

"""The supervisor's HTTP workers (real processes): a SIGTERM is not kept waiting by a restart pause."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from app.ipc.layout import RunLayout
from app.service.supervisor import FrontWorkers
from app.settings import Settings
from tests.net import free_port, taken_port


def test_stop_ends_a_restart_pause_at_once():
    layout = RunLayout.create(0)
    stop = threading.Event()
    workers = FrontWorkers(Settings(host="127.0.0.1", port=free_port()), layout, 1, stop)
    try:
        workers.start()
        (proc,) = workers._procs
        workers._pauses[0] = 10.0  # it keeps dying young: the next restart waits 10 s
        os.kill(proc.pid, signal.SIGKILL)
        replacing = threading.Thread(target=workers.replace_dead, args=(5.0,))
        replacing.start()
        proc.join(5.0)
        stop.set()
        replacing.join(3.0)  # well before the pause would end
        assert not replacing.is_alive()
        assert workers._procs[0] is proc  # and nothing was started while stopping
    finally:
        stop.set()
        workers.stop(0.0)
        layout.remove()


def test_the_metrics_folder_variable_is_put_back_after_serving(tmp_path, monkeypatch):
    from app.service.processes import metrics_folder

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with metrics_folder(tmp_path / "a"):
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "a")
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/elsewhere")
    with pytest.raises(RuntimeError), metrics_folder(tmp_path / "b"):
        raise RuntimeError("the service failed")
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == "/elsewhere"


def test_serve_whose_model_cannot_open_says_why_and_exits_while_its_http_workers_start(tmp_path):
    """The HTTP workers start beside the inference workers' warm-up (so /readyz can show it);
    a model that cannot open still ends ``serve`` with its own error, and nothing is left."""
    import subprocess
    import sys

    from app.cli.terminal import ExitCode

    missing = tmp_path / "missing.pt"
    proc = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--backend", "onnxruntime", "--weights",
                           str(missing), "--host", "127.0.0.1", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert f"error: weights file not found: {missing}" in proc.stderr
    folder = next(line for line in proc.stderr.splitlines() if "run folder" in line).rsplit(" ", 1)[1]
    assert not os.path.exists(folder)


def test_a_taken_grpc_port_is_one_line_naming_it_and_the_way_out(monkeypatch):
    from app.errors import InvalidParameter
    from app.service.supervisor import _check_grpc_port_free

    monkeypatch.delenv("YOLOPIPE_GRPC_PORT", raising=False)
    listener, port = taken_port()
    with listener:
        with pytest.raises(InvalidParameter) as defaulted:
            _check_grpc_port_free(Settings(host="127.0.0.1", port=port - 1))
        with pytest.raises(InvalidParameter) as given:
            _check_grpc_port_free(Settings(host="127.0.0.1", port=free_port(), grpc_port=port))
    assert defaulted.value.message == (f"cannot listen on 127.0.0.1:{port}: Address already in use (the gRPC port, "
                                       "--port + 1 by default); choose another with --grpc-port N, or --grpc-port 0 "
                                       "for no gRPC")
    assert given.value.message.startswith(f"cannot listen on 127.0.0.1:{port}: Address already in use (the gRPC "
                                          "port); choose another with --grpc-port N")
    assert defaulted.value.hint is None and "\n" not in defaulted.value.message

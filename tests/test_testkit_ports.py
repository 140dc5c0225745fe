"""The tests' free ports come from below the kernel's ephemeral range, each xdist worker from its own share:
a port from bind(0) goes back to the range outgoing connections take their source ports from."""

import socket
from pathlib import Path

import pytest

from stepscope_testkit import processes
from stepscope_testkit.processes import _port_share, free_port


def test_ports_are_below_the_ephemeral_range_in_the_workers_share(monkeypatch: pytest.MonkeyPatch) -> None:
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        share = _port_share()
        ports = {free_port() for _ in range(20)}
        assert all(port in share and port < ephemeral for port in ports), (share, ports)
        shares.append(set(share))
    assert not shares[0] & shares[1]


def test_a_port_held_by_a_listener_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    small = range(_port_share().start, _port_share().start + 60)
    monkeypatch.setattr(processes, "_port_share", lambda: small)
    listeners = []
    try:
        for port in small[:50]:  # 50 of the 60 held: a pick that skipped the check would mostly land on one
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            listeners.append(sock)
        held = {sock.getsockname()[1] for sock in listeners}
        picks = {free_port() for _ in range(100)}
        assert picks and not held & picks, (held & picks)
    finally:
        for sock in listeners:
            sock.close()


def test_a_port_is_not_handed_out_twice_before_its_process_could_bind_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two picks in a row (a test starting two servers) never get one port, though neither is bound yet."""
    small = range(_port_share().start, _port_share().start + 40)
    monkeypatch.setattr(processes, "_port_share", lambda: small)
    monkeypatch.setattr(processes, "_HANDED_OUT", {})
    picks = [free_port() for _ in range(20)]
    assert len(set(picks)) == len(picks), picks

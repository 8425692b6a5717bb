"""Ports for servers started on 127.0.0.1: below the kernel's ephemeral range, free, not chosen twice."""

from __future__ import annotations

import socket

import pytest

from service.cluster import ports


def test_a_port_is_above_rays_worker_ports_and_below_the_ephemeral_range() -> None:
    low = ports.ephemeral_low()
    chosen: list[int] = []
    for _ in range(30):
        chosen.append(ports.free_port(taken=chosen))
    assert all(ports.ABOVE_RAY_WORKER_PORTS <= p < low for p in chosen)
    assert len(set(chosen)) == len(chosen)


def test_a_port_in_use_or_already_taken_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        draws = iter([busy, 24001, 24002])
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 60000)  # `busy` is inside the range drawn from
        monkeypatch.setattr(ports._random, "randrange", lambda lo, hi: next(draws))
        assert ports.free_port(taken=[24001]) == 24002


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.ABOVE_RAY_WORKER_PORTS + 10)
    monkeypatch.setattr(ports._random, "randrange", lambda lo, hi: pytest.fail("drew from no room"))
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free


def test_an_unreadable_range_is_linuxs_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports.ephemeral_low() == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "range")
    assert ports.ephemeral_low() == 40000

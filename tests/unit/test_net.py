"""A free port for a server another process starts later: outside the kernel's ephemeral range,
so no outgoing connection (ssh, Open MPI's daemons) can take it first (EADDRINUSE)."""

from __future__ import annotations

import socket
from pathlib import Path

from cudampi import net


def test_port_range_and_reserved_ports_parse():
    assert net.parse_port_range("32768\t60999\n") == (32768, 60999)
    assert net.parse_reserved_ports("") == set()
    assert net.parse_reserved_ports("8080,12000-12002\n") == {8080, 12000, 12001, 12002}


def test_candidates_avoid_the_ephemeral_range_reserved_and_low_ports():
    got = net.listen_candidates((32768, 60999), {12000})
    assert got[0] == net.LOWEST_PORT and 12000 not in got
    assert not any(32768 <= p <= 60999 for p in got) and 61000 in got and 65535 in got
    assert net.listen_candidates((1024, 65535), set()) == []  # then the kernel's pick


def test_free_port_is_outside_this_hosts_ephemeral_range_and_a_server_binds_it():
    lo, hi = net.parse_port_range(Path(net.EPHEMERAL_RANGE).read_text())
    reserved = net.parse_reserved_ports(Path(net.RESERVED_PORTS).read_text())
    for _ in range(20):
        port = net.free_port()
        assert not lo <= port <= hi, (port, lo, hi)  # the kernel never hands it to a connect()
        assert port >= net.LOWEST_PORT and port not in reserved
        with socket.create_server(("", port)) as s:  # the server it is meant for can bind it
            assert s.getsockname()[1] == port


def test_a_jobs_port_is_the_same_for_every_rank_and_outside_the_ephemeral_range():
    lo, hi = net.parse_port_range(Path(net.EPHEMERAL_RANGE).read_text())
    ports = {net.port_for(d) for d in (0, 1, 12345, 2**32 - 1)}
    assert len(ports) == 4 and not any(lo <= p <= hi for p in ports)
    assert net.port_for(777) == net.port_for(777)

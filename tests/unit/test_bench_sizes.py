from __future__ import annotations

import pytest

from cudampi.bench.sizes import human_bytes, parse_bytes, size_sweep
from cudampi.errors import ConfigError


def test_sweep_doubles_from_b_to_e():
    assert size_sweep(8, 64) == [8, 16, 32, 64]
    assert size_sweep(8, 100, 4.0) == [8, 32]
    assert size_sweep(parse_bytes("1K", "-b"), parse_bytes("1M", "-e"), 32.0) == [
        1024,
        32768,
        1048576,
    ]


def test_step_bytes_add():
    assert size_sweep(10, 40, 1.0, 10) == [10, 20, 30, 40]


def test_one_size_needs_no_growth():
    assert size_sweep(1 << 30, 1 << 30, 1.0) == [1 << 30]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((64, 8), "below -b"),
        ((8, 64, 1.0, 0), "does not grow"),
        ((0, 64), "-b 0"),
        ((8, 64, 2.0, -1), "negative"),
    ],
)
def test_bad_sweeps_say_why(args, match):
    with pytest.raises(ConfigError, match=match):
        size_sweep(*args)


def test_parse_bytes_names_the_flag():
    assert parse_bytes("64K", "-b") == 65536
    assert parse_bytes("1G", "-e") == 1 << 30
    with pytest.raises(ConfigError, match=r"-e 'lots'"):
        parse_bytes("lots", "-e")


def test_human_bytes():
    assert [human_bytes(n) for n in (8, 1024, 3 << 20, 1 << 30, 1500)] == [
        "8",
        "1K",
        "3M",
        "1G",
        "1500",
    ]

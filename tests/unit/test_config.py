"""Every setting is checked against its bounds, from the environment and from keywords alike,
and refused in one form: the value seen, what is expected, the fix, what the setting does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cudampi.config import Config
from cudampi.errors import ConfigError

BAD = [
    ("CUDAMPI_CHUNK_BYTES", "inf", "expected a size from 1 B to 1 GiB"),
    ("CUDAMPI_CHUNK_BYTES", "nan", "expected a size from 1 B to 1 GiB"),
    ("CUDAMPI_CHUNK_BYTES", "1e400", "expected a size from 1 B to 1 GiB"),
    ("CUDAMPI_CHUNK_BYTES", "0", "expected a size from 1 B to 1 GiB"),
    ("CUDAMPI_CHUNK_BYTES", "4G", "expected a size from 1 B to 1 GiB"),
    ("CUDAMPI_SMALL_BYTES", "-1", "expected a size from 0 B to 1 TiB"),
    ("CUDAMPI_IPC_BYTES", "1K", "expected a size from 4 KiB to 16 GiB"),
    ("CUDAMPI_IPC_ONESHOT_BYTES", "-2", "expected a size from 0 B to 1 TiB (4096, 64K, 4M, 1G) or auto"),
    ("CUDAMPI_IPC_BLOCKS", "-1", "expected a whole number from 0 to 64"),
    ("CUDAMPI_IPC_BLOCKS", "65", "expected a whole number from 0 to 64"),
    ("CUDAMPI_IPC_BLOCKS", "2.5", "expected a whole number from 0 to 64"),
    ("CUDAMPI_NODE_RANKS", "-3", "expected a whole number from 0 to 65536"),
    ("CUDAMPI_TIMEOUT", "1e-9", "expected a positive, finite number of seconds from 0.01 to"),
    ("CUDAMPI_TIMEOUT", "1e12", "expected a positive, finite number of seconds from 0.01 to"),
    ("CUDAMPI_TIMEOUT", "inf", "expected a positive, finite number of seconds"),
    ("CUDAMPI_PROBE_TIMEOUT", "-3", "expected a positive, finite number of seconds"),
    ("CUDAMPI_CACHE_DIR", "", "expected a folder"),
    ("CUDAMPI_DEBUG", "maybe", "expected 0/1, true/false, yes/no or on/off"),
    ("CUDAMPI_PATH", "fast", "expected auto, ipc, nccl, gpu-ring, staged, native or host"),
    ("CUDAMPI_LOG", "verbose", "expected off, info or debug, in any case, or a level of NCCL_DEBUG"),
    ("CUDAMPI_LOG_RANKS", "some", "expected 0 or all"),
]  # fmt: skip


@pytest.mark.parametrize(("var", "value", "expected"), BAD)
def test_a_value_out_of_bounds_is_refused_in_one_form(var, value, expected):
    with pytest.raises(ConfigError) as err:
        Config.load(env={var: value})
    msg = str(err.value)
    assert msg.startswith(f"{var}={value!r}: {expected}"), msg
    assert f"Give such a value, or unset {var} for the default (" in msg, msg
    assert msg.endswith(")") and f"({var}: " in msg, msg  # and what the setting does
    assert "expected one of ," not in msg and ", got" not in msg


@pytest.mark.parametrize(("var", "value", "expected"), BAD)
def test_keywords_are_held_to_the_same_bounds(var, value, expected):
    name = var.removeprefix("CUDAMPI_").lower()
    with pytest.raises(ConfigError, match="leave " + name + " out for the default"):
        Config.load({name: value}, env={})


@pytest.mark.parametrize(
    ("name", "value"),
    [("chunk_bytes", -5), ("chunk_bytes", float("inf")), ("timeout", 1e-9), ("node_ranks", -1)],
)
def test_values_that_are_not_text_are_checked_too(name, value):
    with pytest.raises(ConfigError, match=f"^{name}="):
        Config.load({name: value}, env={})
    with pytest.raises(ConfigError):
        Config.load(env={}).replace(**{name: value})


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("INFO", "info"), ("info", "info"), ("Info", "info"), ("1", "info"), ("on", "info"),
        ("WARN", "off"), ("warning", "off"), ("VERSION", "off"), ("", "off"), ("0", "off"),
        ("TRACE", "debug"), ("DEBUG", "debug"), ("off", "off"), ("ERROR", "off"),
    ],
)  # fmt: skip
def test_the_log_level_takes_nccl_debugs_and_loggings_names_in_any_case(value, level):
    assert Config.load(env={"CUDAMPI_LOG": value}).log == level


def test_choices_take_any_case_and_sizes_their_units():
    cfg = Config.load(
        env={
            "CUDAMPI_PATH": "Host",
            "CUDAMPI_CUDA_AWARE": "NO",
            "CUDAMPI_LOG_RANKS": "ALL",
            "CUDAMPI_CHUNK_BYTES": "1.5M",
            "CUDAMPI_IPC_ONESHOT_BYTES": "Auto",
            "CUDAMPI_DEBUG": "Yes",
            "CUDAMPI_TIMEOUT": "0.5",
        }
    )
    assert (cfg.path, cfg.cuda_aware, cfg.log_ranks) == ("host", "no", "all")
    assert (cfg.chunk_bytes, cfg.ipc_oneshot_bytes, cfg.debug) == (3 << 19, -1, True)
    assert cfg.timeout == 0.5


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("CUDAMPI_TIMOUT", "CUDAMPI_TIMEOUT"),
        ("CUDAMPI_CHUNK_BYTE", "CUDAMPI_CHUNK_BYTES"),
        ("CUDAMPI_DEBUGG", "CUDAMPI_DEBUG"),
        ("CUDAMPI_NODERANKS", "CUDAMPI_NODE_RANKS"),
    ],
)
def test_a_misspelt_name_says_did_you_mean(typed, meant):
    with pytest.raises(ConfigError) as err:
        Config.load(env={typed: "1"})
    assert f"unknown environment variable {typed} (did you mean {meant}?)" in str(err.value)
    with pytest.raises(ConfigError, match=r"did you mean 'timeout'\?"):
        Config.load({"timout": 5}, env={})


def test_the_cli_refuses_a_bad_setting_without_a_traceback(tmp_path):
    """The doctor reads the settings first: a size of ``inf`` was an OverflowError traceback."""
    for var, value, expected in BAD[:1] + BAD[8:9] + BAD[12:13]:
        proc = subprocess.run(
            [sys.executable, "-m", "cudampi", "doctor", "--no-runtime"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "CUDAMPI_CACHE_DIR": str(tmp_path), var: value},
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"{var}={value!r}: {expected}" in proc.stderr and "Traceback" not in proc.stderr

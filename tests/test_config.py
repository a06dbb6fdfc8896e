import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from gpud.config import Config, ConfigError, load_config, parse_config

SHIPPED = REPO / "etc" / "gpud" / "gpud.yaml"


def _key_paths(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else getattr(cls, f.name)):
            yield from _key_paths(type(getattr(cls(), f.name)), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_shipped_file_loads_and_states_the_defaults():
    assert load_config(SHIPPED) == Config()


def test_shipped_file_documents_every_key():
    text = SHIPPED.read_text()
    for path in _key_paths(Config):
        leaf = path.rsplit(".", 1)[-1]
        assert f"{leaf}:" in text, f"etc/gpud/gpud.yaml does not document {path}"
        # every key is preceded by a comment explaining it
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.lstrip("# ").startswith(f"{leaf}:"))
        assert any(lines[j].lstrip().startswith("#") for j in range(max(0, at - 3), at)), path


def test_empty_file_means_defaults():
    assert parse_config("") == Config()
    assert parse_config("# nothing\n") == Config()


def test_values_are_typed_and_integers_become_numbers():
    config = parse_config("api:\n  idle_timeout_s: 5\n  socket: /tmp/x.sock\nlog:\n  level: debug\n")
    assert config.api.idle_timeout_s == 5.0 and isinstance(config.api.idle_timeout_s, float)
    assert config.api.socket == "/tmp/x.sock"
    assert config.log.level == "debug"


@pytest.mark.parametrize("text, key, line, words", [
    ("apii:\n  socket: /x\n", "apii", 1, "unknown key"),
    ("api:\n  socket: /x\n  sockett: /y\n", "api.sockett", 3, "unknown key"),
    ("api:\n  idle_timeout_s: fast\n", "api.idle_timeout_s", 2, "expected a number"),
    ("api:\n  idle_timeout_s: true\n", "api.idle_timeout_s", 2, "expected a number"),
    ("api:\n  idle_timeout_s: 0\n", "api.idle_timeout_s", 2, "between"),
    ("inventory:\n  refresh_interval_s: 99999\n", "inventory.refresh_interval_s", 2, "between"),
    ("log:\n  level: verbose\n", "log.level", 2, "one of"),
    ("api: [1, 2]\n", "api", 1, "expected a mapping"),
    ("simulate: 3\n", "simulate", 1, "expected a string"),
    ("simulate: ''\n", "simulate", 1, "must not be empty"),
    ("api:\n  socket:\n", None, None, None),  # null for an optional key is fine
])
def test_bad_values_name_the_key_and_line(text, key, line, words):
    if key is None:
        assert parse_config(text).api.socket is None
        return
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "my.yaml")
    error = caught.value
    assert (error.key, error.line) == (key, line)
    assert words in str(error) and "my.yaml" in str(error)


def test_yaml_syntax_error_names_the_line():
    with pytest.raises(ConfigError) as caught:
        parse_config("api:\n  socket: /x\n  bad: [unclosed\nlog: {}\n", "broken.yaml")
    assert caught.value.line is not None and caught.value.line >= 3
    assert "invalid YAML" in str(caught.value) and "broken.yaml" in str(caught.value)


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_config("- a\n- b\n")


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.yaml")


def test_overrides_replace_only_given_values():
    config = Config().with_overrides(**{"api.socket": "/tmp/a.sock", "simulate": "t4", "log.level": None})
    assert config.api.socket == "/tmp/a.sock" and config.simulate == "t4" and config.log.level == "info"


def test_sim_state_defaults_beside_the_socket():
    config = Config().with_overrides(**{"api.socket": "/tmp/q/gpud.sock", "simulate": "A100-SXM4-40GB:2,T4:1"})
    assert config.sim_state_path == Path("/tmp/q/sim-a100-sxm4-40gb_2_t4_1.json")


def _gpud(*args):
    return subprocess.run([sys.executable, "-m", "gpud", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def test_cli_config_validate(tmp_path):
    good = _gpud("config", "validate", str(SHIPPED))
    assert good.returncode == 0 and "valid" in good.stdout
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("log:\n  level: chatty\n")
    bad = _gpud("config", "validate", str(bad_file))
    assert bad.returncode == 2
    assert str(bad_file) in bad.stderr and "log.level" in bad.stderr and "line 2" in bad.stderr


def test_cli_config_validate_checks_the_simulate_preset(tmp_path):
    bad_file = tmp_path / "sim.yaml"
    bad_file.write_text("simulate: dgx-z900\n")
    result = _gpud("config", "validate", str(bad_file))
    assert result.returncode == 2 and "dgx-z900" in result.stderr


def test_serve_refuses_a_bad_config_with_exit_code_2(tmp_path):
    bad_file = tmp_path / "gpud.yaml"
    bad_file.write_text("api:\n  idle_timeout_s: [1]\n")
    result = _gpud("serve", "--config", str(bad_file), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == 2
    assert str(bad_file) in result.stderr and "api.idle_timeout_s" in result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_serve_refuses_an_unknown_preset():
    result = _gpud("serve", "--simulate", "nonsense:3", "--socket", "/tmp/never-used.sock")
    assert result.returncode == 2 and "nonsense" in result.stderr


def test_version():
    from gpud import __version__
    result = _gpud("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"gpud {__version__}"


@pytest.mark.parametrize("value", ["banana", "'535'", "v550.90.07"])
def test_sim_driver_must_be_a_driver_version(value):
    with pytest.raises(ConfigError) as caught:
        parse_config(f"simulate: hgx-h100\nsim_driver: {value}\n", "my.yaml")
    assert caught.value.key == "sim_driver" and "driver version" in str(caught.value)
    assert parse_config("simulate: hgx-h100\nsim_driver: 535.183.01\n").sim_driver == "535.183.01"


@pytest.mark.parametrize("driver, words", [("latest", "sim_driver"), ("535.1", "535.1")])
def test_serve_refuses_a_bad_sim_driver_flag(driver, words):
    # "535.1" has a driver's shape but is no version the simulator can behave as: exit 2, no traceback
    result = _gpud("serve", "--simulate", "hgx-h100", "--sim-driver", driver, "--socket", "/tmp/never-used.sock")
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr

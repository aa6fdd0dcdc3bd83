"""One settings object from LORAPLEX_* variables; the config reference; the CLI's help."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.config_cmd import field_docs
from loraplex.settings import Settings, SettingsError
from loraplex_cli.main import COMMANDS

BIN = Path(sys.executable).parent / "loraplex"


def test_every_type_parses_from_the_environment():
    s = Settings.from_env({
        "LORAPLEX_MAX_LORAS": "4", "LORAPLEX_JWT_LEEWAY_S": "1.5", "LORAPLEX_LORA_RANK_CLASSES": "8, 16",
        "LORAPLEX_JWT_ALGORITHMS": "RS256,ES256", "LORAPLEX_RATELIMIT_FAIL_MODE": "closed",
        "LORAPLEX_REDIS_URL": "redis://r:6379/1", "UNRELATED": "x",
    })
    assert (s.max_loras, s.jwt_leeway_s, s.lora_rank_classes) == (4, 1.5, (8, 16))
    assert s.jwt_algorithms == ("RS256", "ES256") and s.ratelimit_fail_mode == "closed"
    assert not s.embedded and Settings.from_env({}).embedded


@pytest.mark.parametrize("var,value", [("LORAPLEX_MAX_LORAS", "many"), ("LORAPLEX_JWT_LEEWAY_S", "soon"),
                                       ("LORAPLEX_RATELIMIT_FAIL_MODE", "maybe"),
                                       ("LORAPLEX_LORA_RANK_CLASSES", "8,x")])
def test_bad_values_name_the_variable(var, value):
    with pytest.raises(SettingsError, match=var):
        Settings.from_env({var: value})


def test_derived_defaults_follow_home():
    s = Settings(home="/srv/lp")
    assert s.resolved_database_url() == "sqlite+aiosqlite:////srv/lp/registry.db"
    assert s.resolved_adapter_root() == "/srv/lp/adapters"
    assert s.resolved_worker_url() == "http://127.0.0.1:8100"


def test_every_setting_is_documented():
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Settings) if not docs.get(f.name, ("", ""))[1]]
    assert not missing, f"settings without a docstring: {missing}"


def test_config_command_prints_effective_values_and_hides_secrets():
    out = subprocess.run([str(BIN), "config", "--json"], capture_output=True, text=True, check=True,
                         env={"LORAPLEX_MAX_LORAS": "3", "LORAPLEX_JWT_SECRET": "s" * 40, "PATH": ""})
    values = json.loads(out.stdout)
    assert values["LORAPLEX_MAX_LORAS"] == "3"
    assert values["LORAPLEX_JWT_SECRET"] == "(set)"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    out = subprocess.run([str(BIN), command, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: loraplex" in out.stdout


def test_admin_help_lists_every_operation():
    out = subprocess.run([str(BIN), "admin", "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("tenant", "base-model", "adapter", "bind", "rollback", "canary", "binding", "audit"):
        assert cmd in out


def test_the_configuration_reference_is_current_and_lists_every_setting():
    from loraplex.config_cmd import reference_markdown

    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert page == reference_markdown(), "docs/configuration.md is stale: loraplex config --markdown > docs/configuration.md"
    missing = [f"LORAPLEX_{f.name.upper()}" for f in dataclasses.fields(Settings)
               if f"`LORAPLEX_{f.name.upper()}`" not in page]
    assert not missing, missing
    out = subprocess.run([str(BIN), "config", "--markdown"], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} |
                         {"LORAPLEX_MAX_LORAS": "3"}).stdout
    assert out == page, "the command prints the page, whatever the environment sets"

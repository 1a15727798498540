"""Settings: one table, three spellings, precedence CLI > env > ini > default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.config.settings import OPTIONS, Settings, get_option, options_table, resolve
from trainguard.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "markers-and-options.md"

#: Per option: raw values for CLI, env and ini (all different) and what each parses to.
VALUES: dict[str, tuple[tuple[str, Any], tuple[str, Any], tuple[str, Any]]] = {
    "seed": (("5", 5), ("4", 4), ("3", 3)),
    "soak_seed": (("11", 11), ("12", 12), ("13", 13)),
    "deterministic": (("yes", True), ("off", False), ("1", True)),
    "collect_yaml": (("0", False), ("true", True), ("no", False)),
    "report_json": (
        ("cli.json", Path("cli.json")),
        ("env.json", Path("env.json")),
        ("ini.json", Path("ini.json")),
    ),
    "keep_runs": (("7", 7), ("6", 6), ("5", 5)),
    "rank_log_mb": (("8", 8.0), ("0", 0.0), ("2.5", 2.5)),
    "ddp_timeout": (("30", 30.0), ("45.5", 45.5), ("60", 60.0)),
    "timeout_scale": (("2.5", 2.5), ("3", 3.0), ("0.5", 0.5)),
    "tracking": (("on", "on"), ("OFF", "off"), ("auto", "auto")),
    "save_baseline": (("1", True), ("no", False), ("yes", True)),
    "read_max_mb": (("64", 64.0), ("0.5", 0.5), ("100", 100.0)),
    "read_max_files": (("10", 10), ("200", 200), ("3", 3)),
    "read_timeout": (("5", 5.0), ("0.5", 0.5), ("30", 30.0)),
}


def test_values_table_covers_every_option() -> None:
    assert set(VALUES) == {opt.name for opt in OPTIONS}


@pytest.mark.parametrize("name", [opt.name for opt in OPTIONS])
@pytest.mark.parametrize(
    ("given", "winner"),
    [
        (("cli", "env", "ini"), "cli"),
        (("cli", "env"), "cli"),
        (("cli", "ini"), "cli"),
        (("env", "ini"), "env"),
        (("env",), "env"),
        (("ini",), "ini"),
        ((), "default"),
    ],
)
def test_precedence_cli_env_ini_default(name: str, given: tuple[str, ...], winner: str) -> None:
    opt = get_option(name)
    (cli_raw, cli_val), (env_raw, env_val), (ini_raw, ini_val) = VALUES[name]
    settings = resolve(
        cli={name: cli_raw} if "cli" in given else {},
        environ={opt.env: env_raw} if "env" in given else {},
        ini={name: ini_raw} if "ini" in given else {},
    )
    expected = {"cli": cli_val, "env": env_val, "ini": ini_val, "default": opt.default}[winner]
    assert getattr(settings, name) == expected
    source = {"cli": "command line", "env": "environment", "ini": "ini file", "default": "default"}
    assert settings.sources[name] == source[winner]


def test_other_options_keep_their_defaults_and_sources() -> None:
    settings = resolve(cli={"seed": "9"}, environ={}, ini={})
    assert settings.seed == 9
    assert settings.sources == {
        "seed": "command line",
        **{opt.name: "default" for opt in OPTIONS if opt.name != "seed"},
    }


def test_defaults_match_the_settings_dataclass() -> None:
    resolved = resolve(environ={})
    assert resolved == Settings()
    for opt in OPTIONS:
        assert getattr(Settings(), opt.name) == opt.default


def test_none_and_empty_list_mean_not_given() -> None:
    # pytest's getoption returns None for an absent flag; getini may return [] for absent keys.
    settings = resolve(cli={"seed": None}, environ={"TRAINGUARD_SEED": "4"}, ini={"seed": []})
    assert settings.seed == 4
    settings = resolve(cli={"seed": None}, environ={}, ini={"seed": []})
    assert settings.seed == 0 and settings.sources["seed"] == "default"


def test_typed_cli_values_are_accepted() -> None:
    settings = resolve(cli={"seed": 12, "deterministic": True, "timeout_scale": 2}, environ={})
    assert (settings.seed, settings.deterministic, settings.timeout_scale) == (12, True, 2.0)


def test_environ_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_KEEP_RUNS", "3")
    assert resolve().keep_runs == 3
    monkeypatch.delenv("TRAINGUARD_KEEP_RUNS")
    assert resolve().keep_runs == 20


def test_values_are_stripped() -> None:
    settings = resolve(environ={"TRAINGUARD_SEED": " 8 ", "TRAINGUARD_TIMEOUT_SCALE": "\t1.5\n"})
    assert (settings.seed, settings.timeout_scale) == (8, 1.5)


@pytest.mark.parametrize("text", ["1", "true", "True", "TRUE", "yes", "Yes", "on", "ON", " 1 "])
def test_booleans_true(text: str) -> None:
    assert resolve(environ={"TRAINGUARD_DETERMINISTIC": text}).deterministic is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "NO", "off", "Off"])
def test_booleans_false(text: str) -> None:
    settings = resolve(environ={"TRAINGUARD_COLLECT_YAML": text})
    assert settings.collect_yaml is False
    assert settings.sources["collect_yaml"] == "environment"


def test_report_json_path_expands_home_and_empty_means_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert (
        resolve(environ={"TRAINGUARD_REPORT_JSON": "~/r.json"}).report_json == tmp_path / "r.json"
    )
    assert resolve(environ={"TRAINGUARD_REPORT_JSON": "  "}).report_json is None


BAD = [
    ("seed", "abc", "expected an integer between 0 and 2**32-1 (as job.seed)"),
    ("seed", "-1", "expected an integer between 0 and 2**32-1"),
    ("seed", str(2**32), "expected an integer between 0 and 2**32-1"),
    ("seed", str(2**70), "expected an integer between 0 and 2**32-1"),  # issue 13, item 14
    ("seed", "1.5", "expected an integer between 0 and 2**32-1"),
    ("deterministic", "maybe", "expected one of 1/0, true/false, yes/no, on/off"),
    ("collect_yaml", "2", "expected one of 1/0, true/false, yes/no, on/off"),
    ("keep_runs", "0", "expected an integer from 1 to 1000000"),
    ("keep_runs", "many", "expected an integer from 1 to 1000000"),
    ("keep_runs", "9" * 30, "expected an integer from 1 to 1000000"),
    ("timeout_scale", "0", "expected a number > 0 and at most 1000"),
    ("timeout_scale", "-2", "expected a number > 0"),
    ("timeout_scale", "nan", "expected a number > 0"),
    ("timeout_scale", "inf", "expected a number > 0 and at most 1000"),  # waits overflow
    ("timeout_scale", "1e300", "expected a number > 0 and at most 1000"),
    ("timeout_scale", "fast", "expected a number > 0"),
    ("ddp_timeout", "0", "expected a number > 0 and at most 604800"),
    ("ddp_timeout", "Infinity", "expected a number > 0 and at most 604800"),
    ("report_json", "~0", "cannot expand '~0': no such user's home directory"),  # found by the fuzz
    ("report_json", "~no-such-user-tg/r.json", "cannot expand '~no-such-user-tg'"),
]


@pytest.mark.parametrize(("name", "raw", "why"), BAD)
@pytest.mark.parametrize("source", ["command line", "environment", "ini file"])
def test_bad_value_names_source_and_spelling(name: str, raw: str, why: str, source: str) -> None:
    opt = get_option(name)
    kwargs: dict[str, Any] = {"cli": {}, "ini": {}, "environ": {}}
    spelled = {"command line": opt.flag, "environment": opt.env, "ini file": opt.ini}[source]
    if source == "command line":
        kwargs["cli"] = {name: raw}
    elif source == "environment":
        kwargs["environ"] = {opt.env: raw}
    else:
        kwargs["ini"] = {name: raw}
    with pytest.raises(ConfigError) as info:
        resolve(**kwargs)
    message = str(info.value)
    assert info.value.key == spelled
    assert f"invalid value {raw!r} for {spelled} (from the {source})" in message
    assert why in message
    assert f"Fix the {source} value; the default is {opt.default!r}" in message


def test_bad_env_seed_message_in_full() -> None:
    with pytest.raises(ConfigError) as info:
        resolve(environ={"TRAINGUARD_SEED": "abc"})
    assert str(info.value).startswith(
        "TRAINGUARD_SEED: invalid value 'abc' for TRAINGUARD_SEED (from the environment): "
    )


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.name)
def test_spellings_follow_one_scheme(opt: Any) -> None:
    assert opt.flag == "--trainguard-" + opt.name.replace("_", "-")
    assert opt.ini == "trainguard_" + opt.name
    assert opt.env == "TRAINGUARD_" + opt.name.upper()
    assert get_option(opt.name) is opt


def test_options_table_lists_every_flag_ini_and_env() -> None:
    table = options_table()
    lines = table.splitlines()
    assert lines[0] == "| flag | ini key | env var | default | what it does |"
    assert lines[1] == "|---|---|---|---|---|"
    assert len(lines) == 2 + len(OPTIONS)
    for opt, row in zip(OPTIONS, lines[2:], strict=True):
        assert row.startswith(f"| `{opt.flag}` | `{opt.ini}` | `{opt.env}` | `{opt.default!r}` | ")
        assert opt.help in row


def test_docs_contain_the_options_table_verbatim() -> None:
    """docs/markers-and-options.md is generated from OPTIONS: regenerate it when this fails."""
    assert DOC.is_file(), f"{DOC} is missing; it must contain settings.options_table()"
    assert options_table() in DOC.read_text(encoding="utf-8"), (
        f"{DOC.name} is out of date: paste trainguard.config.settings.options_table() into it"
    )


def test_empty_environment_value_reads_as_unset() -> None:
    settings = resolve(environ={"TRAINGUARD_SEED": "", "TRAINGUARD_COLLECT_YAML": " "}, ini={"seed": "4"})
    assert settings.seed == 4 and settings.sources["seed"] == "ini file"
    assert settings.collect_yaml is True and settings.sources["collect_yaml"] == "default"

"""Every ``kvstrata`` command and option explains itself in ``--help`` (issue 21: most options
had no help text: ``--session``, ``--gateway``, ``--max-tokens``, ``--temperature``,
``tenant list/show/rm``), in clean paragraphs (H11 trial: hard line breaks and RST double
backticks from docstrings, a cut-off ``--reports`` help, a range broken inside its number,
lower-case group help, argument names written two ways, and no exit codes)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from cli.main import app

ROOT = typer.main.get_command(app)
BUILTIN = {"help", "install_completion", "show_completion"}


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, command) for ``group`` and every command under it (typer's own click classes)."""
    out = [(path, group)]
    if hasattr(group, "commands"):
        for name, sub in sorted(group.commands.items()):
            out += _commands(sub, (*path, name))
    return out


COMMANDS = _commands(ROOT)


def _help_text(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def test_the_tree_has_every_command() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"up", "down", "status", "generate", "tenant add", "tenant list", "tenant show", "tenant rm",
            "tenant rotate-key", "admin rotate-key", "run deepresearch"} <= names


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "kvstrata" for p, _ in COMMANDS])
def test_help_explains_the_command_and_each_option(path: tuple[str, ...], command: Any) -> None:
    assert (command.help or "").strip(), f"`kvstrata {' '.join(path)}` has no help text"
    text = _help_text(path)
    assert " ".join(command.help.split()[:4]) in text
    for param in command.params:
        if param.name in BUILTIN:
            continue
        help_ = (getattr(param, "help", None) or "").strip()
        assert help_, f"`kvstrata {' '.join(path)}`: {param.name} has no help text"
        assert " ".join(help_.split()[:4]) in text, f"{param.name}'s help is not in --help"
        if param.param_type_name == "option":
            assert param.opts[0] in text


def _help_80(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "kvstrata" for p, _ in COMMANDS])
def test_help_reads_cleanly_at_80_columns(path: tuple[str, ...], command: Any) -> None:
    """At 80 columns: no ``double backticks``, no text cut with an ellipsis, no option range
    split inside its bounds, each docstring paragraph reflowed rather than broken where the
    source breaks it, group help capitalised, arguments in capitals as click writes them."""
    text = _help_80(path)
    assert "``" not in text and "…" not in text, text
    for bounds in re.finditer(r"\[(?:[-\d.]+<=)?x(?:<=|>=)[-\d.]*", text):  # not "[0<=x<=1844 ⏎ 51615]"
        assert text[bounds.end()] == "]", text
    assert (command.help or "")[:1].isupper() or not path, command.help  # the root names `kvstrata` first
    for param in command.params:
        if param.param_type_name == "argument":
            assert param.metavar and param.metavar.isupper(), param.name
    source = typer.main.get_command(app)
    for name in path:
        source = source.commands[name]  # type: ignore[attr-defined]
    for paragraph in (source.help or "").split("\n\n"):
        assert "\n" not in paragraph.strip(), paragraph


def test_top_level_help_lists_the_exit_codes() -> None:
    """The exit codes (0 done, 1 failed, 2 usage error, 130 Ctrl-C) are in `kvstrata --help`."""
    text = _help_text(())
    assert all(part in text for part in ("Exit codes: 0 done; 1 failed", "2 usage error", "130 cancelled"))


def test_tenant_help_names_only_commands_that_exist() -> None:
    """A fresh-user trial: `kvstrata --help` and `kvstrata tenant --help` offered to "register,
    ..., remove, rotate keys" but the commands are `add`, `rm` and `rotate-key` (`kvstrata tenant
    remove x`: "No such command 'remove'"). The group help lists the real names, and `remove`
    is a hidden alias of `rm`."""
    tenant = ROOT.commands["tenant"]  # type: ignore[attr-defined]
    listed = tenant.help.split(":", 1)[1].strip().rstrip(".").split(", ")
    assert set(listed) == {name for name, cmd in tenant.commands.items() if not cmd.hidden}
    assert " ".join(tenant.help.split()) in _help_text(()) and tenant.help in _help_text(("tenant",))
    remove, rm = tenant.commands["remove"], tenant.commands["rm"]
    assert remove.hidden and not rm.hidden and remove.help == rm.help \
        and [p.name for p in remove.params] == [p.name for p in rm.params]
    assert "remove" not in _help_text(("tenant",)).split()
    # the alias reaches the server as `rm` does (nothing listens there: exit 1, not a usage error 2)
    result = CliRunner().invoke(app, ["tenant", "remove", "ann", "--gateway", "127.0.0.1:1"],
                                env={"KVSTRATA_ADMIN_KEY": "kvs_0123456789ab_" + "A" * 43})
    assert result.exit_code == 1 and "UNAVAILABLE" in result.output, result.output

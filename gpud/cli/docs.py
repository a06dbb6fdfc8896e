"""The man page gpud.1 and the bash and zsh completions, generated from the `gpud` command's parser
(packaging/build.sh ships them): `python -m gpud.cli.docs man|bash|zsh OUT` (OUT '-' is stdout).
No module of the command imports it, so that the CLI does not load it to start."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpud import __version__
from gpud.cli.output import EXIT_CODES, SOCKET_ORDER
from gpud.cli.parser import build_parser

FILE_METAVARS = {"FILE", "PATH", "CONFIG"}


@dataclass
class Option:
    flags: list[str]
    takes_value: bool
    metavar: str
    help: str
    choices: list[str]
    is_file: bool


@dataclass
class Command:
    words: tuple[str, ...]  # ("gpud", "mig", "apply")
    help: str
    usage: str
    options: list[Option] = field(default_factory=list)
    positionals: list[Option] = field(default_factory=list)
    subcommands: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return " ".join(self.words)


def commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """Every command of the parser, depth first, the top-level `gpud` first."""
    found: list[Command] = []
    _walk(parser or build_parser(), ("gpud",), "", found)
    return found


def _walk(parser: argparse.ArgumentParser, words: tuple[str, ...], help_text: str, found: list[Command]) -> None:
    command = Command(words, help_text or parser.description or "", parser.format_usage().removeprefix("usage: "))
    found.append(command)
    children = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, child in action.choices.items():
                command.subcommands.append(name)
                children.append((child, words + (name,), helps.get(name, "")))
        elif action.help != argparse.SUPPRESS:
            (command.options if action.option_strings else command.positionals).append(_option(action, parser))
    for child, child_words, child_help in children:
        _walk(child, child_words, child_help, found)


def _option(action: argparse.Action, parser: argparse.ArgumentParser) -> Option:
    metavar = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices else None) or \
        (action.dest.upper() if action.option_strings else action.dest)
    is_file = action.type is Path or str(metavar).upper() in FILE_METAVARS
    help_text = parser._get_formatter()._expand_help(action) if action.help else ""  # as --help says it
    return Option(list(action.option_strings) or [action.dest], action.nargs != 0, str(metavar),
                  help_text, [str(c) for c in action.choices or ()], is_file)


# -- man page ------------------------------------------------------------------------------------


def man_page(found: list[Command]) -> str:
    top = found[0]
    lines = [f'.TH GPUD 1 "" "gpud {__version__}" "User Commands"', ".SH NAME",
             f"gpud \\- {_roff(top.help[:1].lower() + top.help[1:].rstrip('.'))}", ".SH SYNOPSIS", ".B gpud",
             "\\fICOMMAND\\fR [\\fIOPTIONS\\fR]", ".SH DESCRIPTION",
             _roff("gpud serve runs the daemon. The other commands are clients of its Unix socket, or check "
                   "files here. Every command takes --json: its output is then JSON (metrics and mig export: "
                   '{"format": ..., "text": ...}; watch: one event a line; serve and device-plugin refuse it), '
                   'and so are its errors, on stderr: {"error": {"code": ..., "message": ...}, "exit_code": N}.'),
             ".SH OPTIONS"]
    for option in top.options:
        lines += [".TP", _option_roff(option), _roff(option.help)]
    lines += [".SH COMMANDS"]
    for command in found[1:]:
        lines += [f'.SS "{_roff(command.name)}"', _roff(" ".join(command.usage.split())), ".PP"]
        if command.help:
            lines += [_roff(command.help)]
        for option in command.positionals + command.options:
            lines += [".TP", _option_roff(option), _roff(option.help or "")]
    lines += [".SH EXIT STATUS"]
    for code, meaning in EXIT_CODES:
        lines += [".TP", f".B {code}", _roff(meaning)]
    lines += [".SH ENVIRONMENT", ".TP", ".B GPUD_SOCKET",
              _roff("the daemon's socket, unless --socket names one. Without either, the first found of: "
                    + "; ".join(SOCKET_ORDER[2:]) + "."),
              ".SH FILES", ".TP", ".I /run/gpud/gpud.sock", "the system daemon's API socket", ".TP",
              ".I /etc/gpud/gpud.yaml", "the daemon's config file", ".TP", ".I /etc/gpud/mig-layouts.yaml",
              "the named MIG layouts (a mig-parted file)", ".SH SEE ALSO", ".BR nvidia-smi (1),",
              ".BR systemctl (1)"]
    return "\n".join(lines) + "\n"


def _option_roff(option: Option) -> str:
    if not option.flags[0].startswith("-"):
        return f".I {_roff(option.metavar)}"
    flags = ", ".join(f"\\fB{_roff(flag)}\\fR" for flag in option.flags)
    return flags + (f" \\fI{_roff(option.metavar)}\\fR" if option.takes_value else "")


def _roff(text: str) -> str:
    """Text as roff reads it literally: backslashes, minus signs, non-ASCII characters, and a line
    that would start a request."""
    out = []
    for char in text.replace("\\", "\\e").replace("-", "\\-"):
        out.append(char if ord(char) < 128 else f"\\[u{ord(char):04X}]")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in "".join(out).split("\n"))


# -- completions ---------------------------------------------------------------------------------


def _tables(found: list[Command]) -> dict[str, dict[str, str]]:
    """What the completion scripts look up, by command path ('gpud mig apply') or by path and option."""
    tables: dict[str, dict[str, str]] = {name: {} for name in ("commands", "options", "values", "files", "choices")}
    for command in found:
        key = command.name
        tables["commands"][key] = " ".join(command.subcommands)
        tables["options"][key] = " ".join(flag for option in command.options for flag in option.flags)
        tables["values"][key] = " ".join(flag for option in command.options if option.takes_value
                                         for flag in option.flags)
        files = [flag for option in command.options if option.is_file for flag in option.flags]
        files += [":positional"] if any(option.is_file for option in command.positionals) else []
        tables["files"][key] = " ".join(files)
        for option in command.options:
            for flag in option.flags if option.choices else ():
                tables["choices"][f"{key} {flag}"] = " ".join(option.choices)
    return tables


def bash_completion(found: list[Command]) -> str:
    lines = ["# bash completion for gpud: generated from its parser by `python -m gpud.cli.docs bash`",
             "# (shipped as /usr/share/bash-completion/completions/gpud); edit gpud/cli/, not this file."]
    for name, table in _tables(found).items():
        lines.append(f"_gpud_{name}() {{\n    case \"$1\" in")
        lines += [f"        '{key}') echo '{value}' ;;" for key, value in table.items() if value]
        lines.append("    esac\n}")
    lines.append(BASH_DRIVER)
    return "\n".join(lines) + "\n"


BASH_DRIVER = r"""_gpud_has() {  # _gpud_has WORD LIST...: WORD is one of the LIST
    local word=$1 item
    shift
    for item in $*; do [[ $item == "$word" ]] && return 0; done
    return 1
}
_gpud() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd=gpud i word
    COMPREPLY=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        if _gpud_has "$word" $(_gpud_values "$cmd"); then
            ((i++))  # the option's value
        elif _gpud_has "$word" $(_gpud_commands "$cmd"); then
            cmd="$cmd $word"
        fi
    done
    if ((COMP_CWORD > 1)) && _gpud_has "$prev" $(_gpud_values "$cmd"); then
        if _gpud_has "$prev" $(_gpud_files "$cmd"); then
            COMPREPLY=($(compgen -f -- "$cur"))
        else
            COMPREPLY=($(compgen -W "$(_gpud_choices "$cmd $prev")" -- "$cur"))
        fi
        return 0
    fi
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$(_gpud_options "$cmd")" -- "$cur"))
        return 0
    fi
    COMPREPLY=($(compgen -W "$(_gpud_commands "$cmd")" -- "$cur"))
    if _gpud_has :positional $(_gpud_files "$cmd"); then
        COMPREPLY+=($(compgen -f -- "$cur"))
    fi
    return 0
}
complete -F _gpud gpud"""


def zsh_completion(found: list[Command]) -> str:
    lines = ["#compdef gpud", "# zsh completion for gpud: generated from its parser by `python -m gpud.cli.docs zsh`",
             "# (shipped as /usr/share/zsh/vendor-completions/_gpud); edit gpud/cli/, not this file.",
             "local -A gpud_commands gpud_options gpud_values gpud_files gpud_choices"]
    for name, table in _tables(found).items():
        pairs = " ".join(f"'{key}' '{value}'" for key, value in table.items() if value)
        lines.append(f"gpud_{name}=({pairs})")
    lines.append(ZSH_DRIVER)
    return "\n".join(lines) + "\n"


# `cmd`, not `path`: zsh ties $path to $PATH.
ZSH_DRIVER = r"""local cmd=gpud cur=${words[CURRENT]} prev=${words[CURRENT-1]} word
local -i i
for (( i = 2; i < CURRENT; i++ )); do
    word=${words[i]}
    if (( ${${(s: :)gpud_values[$cmd]}[(Ie)$word]} )); then
        (( i++ ))  # the option's value
    elif (( ${${(s: :)gpud_commands[$cmd]}[(Ie)$word]} )); then
        cmd="$cmd $word"
    fi
done
if (( CURRENT > 2 )) && (( ${${(s: :)gpud_values[$cmd]}[(Ie)$prev]} )); then
    if (( ${${(s: :)gpud_files[$cmd]}[(Ie)$prev]} )); then
        _files
    else
        compadd -- ${(s: :)gpud_choices[$cmd $prev]}
    fi
    return
fi
if [[ $cur == -* ]]; then
    compadd -- ${(s: :)gpud_options[$cmd]}
    return
fi
compadd -- ${(s: :)gpud_commands[$cmd]}
if (( ${${(s: :)gpud_files[$cmd]}[(Ie):positional]} )); then
    _files
fi"""

def kubectl_gpud_man_page() -> str:
    """kubectl-gpud.1: the kubectl plugin's commands, from its own parser."""
    from gpud.kubectl_plugin.main import build_parser as plugin_parser

    found: list[Command] = []
    _walk(plugin_parser(), ("kubectl", "gpud"), "", found)
    lines = [f'.TH KUBECTL-GPUD 1 "" "gpud {__version__}" "User Commands"', ".SH NAME",
             f"kubectl-gpud \\- {_roff(found[0].help.rstrip('.'))}", ".SH SYNOPSIS", ".B kubectl gpud",
             "\\fICOMMAND\\fR [\\fIOPTIONS\\fR]", ".SH DESCRIPTION",
             _roff("A kubectl plugin: kubectl runs kubectl-gpud, found on the PATH, for `kubectl gpud`. It reads "
                   "the cluster through kubectl ($KUBECTL_PATH, else kubectl on the PATH), with its kubeconfig."),
             ".SH COMMANDS"]
    for command in found[1:]:
        lines += [f'.SS "{_roff(command.name)}"', _roff(" ".join(command.usage.split())), ".PP", _roff(command.help)]
        for option in command.options:
            lines += [".TP", _option_roff(option), _roff(option.help or "")]
    lines += [".SH SEE ALSO", ".BR gpud (1),", ".BR kubectl (1)"]
    return "\n".join(lines) + "\n"


GENERATORS = {"man": man_page, "bash": bash_completion, "zsh": zsh_completion,
              "kubectl-gpud-man": lambda _: kubectl_gpud_man_page()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpud.cli.docs", description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=sorted(GENERATORS))
    parser.add_argument("out", help="the file to write, or - for stdout")
    args = parser.parse_args(argv)
    text = GENERATORS[args.kind](commands())
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

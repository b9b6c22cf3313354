"""meshplan: one click group; every verb is a thin layer over a library call.

Verbs are registered by name and imported only when invoked, so `meshplan plan`
never pays for torch or for the other verbs' imports. A MeshplanError becomes
one line on stderr and its exit code (1 runtime, 2 usage, 3 no feasible
layout); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

__version__ = "0.1.0"

# verb -> "module:attribute" of its click command. Each module owns one area.
VERBS: dict[str, str] = {
    "models": "planner.cli.models:models",
    "topo": "topologies.cli.topo:topo",
    "plan": "planner.cli.plan:plan",
    "compare": "planner.cli.plan:compare",
    "simulate": "planner.cli.simulate:simulate",
    "export": "planner.cli.export:export",
    "execute": "executor.cli.execute:execute",
    "checkpoint": "executor.cli.checkpoint:checkpoint",
    "calibrate": "executor.cli.loop:calibrate",
    "report": "executor.cli.loop:report",
    "validate-memory": "executor.cli.loop:validate_memory",
}


class LazyGroup(click.Group):
    """A click group that imports a verb's module only when that verb runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = VERBS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="meshplan")
def meshplan() -> None:
    """Plan, simulate and run parallel layouts (DP/TP/PP/ZeRO/HSDP) for transformer training."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the group and turn typed errors into exit codes."""
    from topologies.errors import MeshplanError

    try:
        meshplan.main(args=argv, prog_name="meshplan", standalone_mode=False)
    except MeshplanError as exc:
        click.echo(f"{exc.label}{exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.UsageError as exc:
        # One line, like every other user error: what was wrong and where help is.
        verb = exc.ctx.command_path if exc.ctx else "meshplan"
        click.echo(f"error: {exc.format_message()} (see `{verb} --help`)", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except RecursionError:
        # json and tomllib recurse once per nesting level: a file nested thousands
        # deep is hostile or corrupt input, not a bug to show as a traceback.
        click.echo("error: an input file is nested too deeply to read (thousands of [ or {); check the file", err=True)
        sys.exit(2)
    sys.exit(0)


if __name__ == "__main__":
    main()

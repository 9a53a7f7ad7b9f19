"""The `refinery` command line: the parser and error handling (parser.py), the commands that start work through
Prefect (commands.py), those that only read the store (read_commands.py), the SQL output formats
(sql_output.py), the end-of-run summary (run_summary.py) and one-line errors (errors.py).

`refinery = "flows.cli:main"` (pyproject.toml) and `python -m flows.cli` both enter through `main`."""

from flows.cli.parser import CliError, build_parser, check_store, main, print_summary, try_command

__all__ = ["CliError", "build_parser", "check_store", "main", "print_summary", "try_command"]

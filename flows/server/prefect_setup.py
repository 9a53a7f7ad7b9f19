"""How a `refinery` command prepares Prefect before it runs a flow.

- `prepare_prefect`: Prefect's home and database in a folder the user can see (the store's `.prefect`, or
  $PREFECT_HOME), never scattered into ~; Prefect's console log and transformers' load bars off unless -v (the
  CLI prints one line per error, and `run`/`compare` a line per finished stage). It must run before anything
  imports Prefect, which reads its settings once, at import.
- `early_prefect`: the same, plus Prefect's temporary server started as a child process while the command
  imports its modules and checks its input (flows/server/early_server.py); a refused input kills it and undoes only
  what the command made (flows/server/prefect_home.py `remove_made`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from flows.server.early_server import start_early
from flows.server.prefect_home import (
    DATABASE,
    file_identity,
    missing_folders,
    prefect_home,
    remove_made,
    seed_database,
    seeding_is_cheap,
)


class PrefectSettingError(ValueError):
    """$PREFECT_HOME or $PREFECT_API_URL (or the store's Prefect home) that Prefect cannot use, named."""

    user_facing = True

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def check_api_url() -> None:
    """A $PREFECT_API_URL that is not an http(s) URL, or where no Prefect API answers, named in one line before
    a flow starts (Prefect itself fails later, with a RuntimeError that names no setting)."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if not url:
        return
    from urllib.parse import urlparse

    hint = "start one (`refinery serve`), or unset PREFECT_API_URL for a temporary server of this command's own"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise PrefectSettingError(f"PREFECT_API_URL={url!r} is not the http(s) URL of a Prefect API (e.g. "
                                  "http://127.0.0.1:4200/api)", hint)
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=10).raise_for_status()
    except httpx.HTTPError as e:
        raise PrefectSettingError(f"PREFECT_API_URL={url}: no Prefect API answers there ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else 'no answer'})", hint) from None


def _make_home(home: Path, store_uri: str) -> None:
    """Make Prefect's home, or say in one line which setting names a home that cannot be made."""
    saved = os.environ.pop("PREFECT_HOME", None)
    try:
        own = prefect_home(store_uri)  # the store's, where $PREFECT_HOME does not name another
    finally:
        if saved is not None:
            os.environ["PREFECT_HOME"] = saved
    user = home != own
    what = f"PREFECT_HOME={home}" if user else f"the store's Prefect home {home}"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as e:  # RuntimeError: pathlib's "Symlink loop"
        reason = "it exists and is not a folder" if isinstance(e, FileExistsError) else (e.strerror or str(e))
        raise PrefectSettingError(f"{what} cannot be made: {reason}",
                                  "point PREFECT_HOME at a folder you can write, or unset it" if user else None) from None


def prepare_prefect(store_uri: str, verbose: bool, console: bool = False, server: bool = True,
                    make_home: bool = True) -> None:
    """Keep Prefect's home and database in a folder the user can see, and its console logs quiet (unless
    `verbose`, or `console` for a command whose job is to show them). `server`: the command runs a flow or
    a server, so a fresh home gets the migrated empty database (flows/server/prefect_home.py seed_database).
    `make_home` false: only the settings, for a Prefect imported before the home is made (called again then)."""
    os.environ["PREFECT_HOME"] = str(prefect_home(store_uri))
    if make_home:
        _make_home(Path(os.environ["PREFECT_HOME"]), store_uri)
    else:
        # Prefect's import tries to make its home (one level, no parents) and warns on stderr when it cannot,
        # as for the home of a store that does not exist yet: made after the command's checks instead
        import warnings

        warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory", category=UserWarning)
    if server and make_home:
        seed_database(Path(os.environ["PREFECT_HOME"]))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    if not (verbose or console):
        # Prefect logs a failing task or flow at ERROR with its whole traceback (and again per state change);
        # the CLI prints the reason as one line instead. The API handler still sends every record to the UI.
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    # the ephemeral server's startup wait is set in flows/__init__.py: Prefect may be imported before this runs
    if not verbose:
        # transformers draws a "Loading weights" bar on stderr at every model load, a terminal or not; the
        # stage lines are the run's progress
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # The ephemeral Prefect server cancels its SQLite connections at interpreter exit, and SQLAlchemy logs
        # that as an ERROR with a traceback after a successful run; it is shutdown noise, not a failure.
        import logging

        logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def early_prefect(store: str, verbose: bool, early: bool = True):
    """Prefect prepared for a command that runs flows (`prepare_prefect`), its server up once the block ends.
    The block imports the command's modules and checks its input. With `early`, the server starts as a child
    process as the block begins (flows/server/early_server.py), on the other core while the block runs; an error in
    the block kills it and undoes the Prefect home made for it (only what this command wrote), so a refused
    input leaves nothing behind. Where seeding the home would first migrate Prefect's empty database for this
    machine (its first run, about 15 s), the block runs before anything is made, as without the early start."""
    check_api_url()
    home = prefect_home(store)
    if home.exists() and not home.is_dir():  # named now: an early start would fail later, less clearly
        _make_home(home, store)
    early = early and seeding_is_cheap(home)
    made = missing_folders(home) if early else []
    had_database = (home / DATABASE).exists()  # a home may exist without one (made by `report` or `import`)
    prepare_prefect(store, verbose, make_home=early)  # before Prefect's import: its settings
    seeded = file_identity(home / DATABASE) if early and not had_database else None
    server = start_early() if early else None
    try:
        yield
    except BaseException:
        if server is not None:
            server.cancel()
        remove_made(made, home / DATABASE, seeded)
        raise
    if server is not None:
        server.ready()
    else:
        prepare_prefect(store, verbose)

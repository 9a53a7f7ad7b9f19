"""A lease on an S3 store: the run lock across machines (storage/runs.py).

A file lock only excludes processes of one machine. On an `s3://` root the run lock is also a lease object,
`<root>/.leases/<name>.json` = {holder, host, pid, token, expires_at}, made with S3's conditional writes:
- take: PUT with `If-None-Match: *`, which S3 accepts only if no lease exists, so of two hosts racing for a
  run exactly one gets it;
- a lease that exists and has not expired names its holder, and the run is refused;
- an expired lease (its holder stopped renewing it: dead, or cut off), or one whose holder ran on this host
  and is gone (a SIGKILLed run restarted here need not wait out the TTL), is replaced with
  `If-Match: <its ETag>`, so of two hosts taking over the same lease one wins;
- while held, a daemon thread renews it every `ttl / 3` seconds, again with `If-Match`, so a lease taken over
  meanwhile is never overwritten; a transient error is retried at the next tick, and a lease found taken
  over fences the store for this process (storage/store.py `FENCES`): no commit of it lands after that;
- release deletes it if it is still ours.
Expiry compares `expires_at`, written by the holder's clock, with the reader's: hosts' clocks must agree to
well within the TTL (120 s by default, `REFINERY_LEASE_TTL_S`). Other object stores (gs://, az://) have no
conditional PUT through fsspec here; there the run lock stays per machine.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from storage.store import FENCES

log = logging.getLogger("refinery.lease")

DEFAULT_TTL_S = 120.0


class LeaseHeld(RuntimeError):
    """Another host (or process) holds an unexpired lease."""

    def __init__(self, holder: dict):
        self.holder = holder
        left = max(0.0, float(holder.get("expires_at", 0)) - time.time())
        super().__init__(f"pid {holder.get('pid')} on {holder.get('host')}, whose lease in the store runs {left:.0f} s "
                         "more unless renewed")


@dataclass
class _Lease:
    bucket: str
    key: str
    token: str
    etag: str


def supported(store) -> bool:
    protocols = store.fs.protocol if isinstance(store.fs.protocol, (tuple, list)) else (store.fs.protocol,)
    return any(p in ("s3", "s3a") for p in protocols)


def ttl_s() -> float:
    raw = os.environ.get("REFINERY_LEASE_TTL_S")
    try:
        value = float(raw) if raw else DEFAULT_TTL_S
    except ValueError:
        raise ValueError(f"REFINERY_LEASE_TTL_S={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"REFINERY_LEASE_TTL_S must be > 0, got {raw}")
    return value


def _body(token: str, ttl: float) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                       "expires_at": time.time() + ttl}).encode()


def _split(store, name: str) -> tuple[str, str]:
    path = store.path(".leases", f"{name}.json")
    bucket, _, key = path.partition("/")
    return bucket, key


def _read(fs, bucket: str, key: str) -> tuple[dict, str] | None:
    """(the lease's content, its ETag) from one GET, or None if there is none."""
    from fsspec.asyn import sync

    async def get() -> tuple[bytes, str]:
        out = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with out["Body"] as stream:
            return await stream.read(), out["ETag"]

    try:
        body, etag = sync(fs.loop, get)
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        holder = {}
    return (holder if isinstance(holder, dict) else {}), etag


def _dead_here(holder: dict) -> bool:
    """The holder ran on this host and its process is gone (killed: a restart here need not wait out the TTL)."""
    from storage.cleanup import pid_alive

    return holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid"))


def take(store, name: str, ttl: float | None = None) -> _Lease:
    """Take lease `name` or raise LeaseHeld naming its holder."""
    fs, ttl = store.fs, ttl or ttl_s()
    bucket, key = _split(store, name)
    token = uuid.uuid4().hex
    for _ in range(3):  # a lease can vanish (released) or be taken over between our reads: look again
        try:
            put = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=_body(token, ttl), IfNoneMatch="*")
            return _Lease(bucket, key, token, put["ETag"])
        except FileExistsError:  # s3fs maps 412 Precondition Failed here
            pass
        current = _read(fs, bucket, key)
        if current is None:
            continue
        holder, etag = current
        if float(holder.get("expires_at", 0)) > time.time() and not _dead_here(holder):
            raise LeaseHeld(holder)
        try:  # expired, or its holder died on this host: take it over unless another process just did
            put = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=_body(token, ttl), IfMatch=etag)
            log.warning("took over the lease %s of pid %s on %s (expired, or its process is gone)", key,
                        holder.get("pid"), holder.get("host"))
            return _Lease(bucket, key, token, put["ETag"])
        except FileNotFoundError:
            continue
        except OSError as e:
            if _precondition_failed(e):
                continue
            raise
    current = _read(fs, bucket, key)
    raise LeaseHeld(current[0] if current else {"host": "another host", "pid": "?"})


def _precondition_failed(e: BaseException) -> bool:
    """Did S3 refuse a conditional write (412, or 409 ConditionalRequestConflict)? s3fs maps a failed
    If-None-Match to FileExistsError but a failed If-Match to a plain OSError, so look at the cause too."""
    if isinstance(e, FileExistsError):
        return True
    text = f"{e} {e.__cause__ or ''}"
    return "PreconditionFailed" in text or "pre-conditions" in text or "412" in text


def renew(store, lease: _Lease, ttl: float) -> bool | None:
    """Extend our lease: True if extended, False if it is no longer ours (taken over, or deleted), None on
    a transient error (retried at the next tick)."""
    try:
        put = store.fs.call_s3("put_object", Bucket=lease.bucket, Key=lease.key, Body=_body(lease.token, ttl),
                               IfMatch=lease.etag)
    except FileNotFoundError:
        return False
    except OSError as e:
        if _precondition_failed(e):
            return False
        log.warning("renewing the lease %s failed (%s); retrying", lease.key, e)
        return None
    lease.etag = put["ETag"]
    return True


def release(store, lease: _Lease) -> None:
    current = _read(store.fs, lease.bucket, lease.key)
    if current is not None and current[0].get("token") == lease.token:
        store.fs.call_s3("delete_object", Bucket=lease.bucket, Key=lease.key)


@contextmanager
def held(store, name: str) -> Iterator[None]:
    """Hold lease `name` for the block, renewed in the background (LeaseHeld if another holder has it)."""
    ttl = ttl_s()
    lease = take(store, name, ttl)
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(ttl / 3):
            ok = renew(store, lease, ttl)
            if ok is False:
                why = (f"lost the run lease {lease.key} (another host took it over after it expired): this "
                       "process commits nothing more to the store")
                log.error(why)
                FENCES[store.uri.rstrip("/")] = why
                return

    renewer = threading.Thread(target=keep, name=f"lease-{name}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        lost = FENCES.pop(store.uri.rstrip("/"), None)
        if not lost:
            try:
                release(store, lease)
            except OSError as e:  # never hide the block's own error behind the release's
                log.warning("could not release the lease %s: %s (it expires by itself)", lease.key, e)

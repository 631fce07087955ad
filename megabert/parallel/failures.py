"""A lost peer in one line: a collective or transfer that failed because another rank
stopped, died or became unreachable, named by group, operation and peer.

Every group megabert makes carries the run's --distributed-timeout-minutes (ParallelState
passes it to each `new_group`), and gloo applies a group's timeout to every wait on it,
`Work.wait()` without an argument included: a peer that stops, or a link that drops
without a reset, fails the op after the timeout; a peer that exits or is killed fails it
at once (its sockets close). What the backend then raises is a RuntimeError whose text
names a source file of gloo and, for a closed connection, the peer's address, and advises
"GLHF". `translate` turns it into a CommunicationError the entry scripts print as one
line; an error that is not a lost peer (a programming error) is left as it is.

Groups are named by the `group_desc` they were created with (torch keeps it on the
ProcessGroup), so no table of groups is needed here.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megabert.errors import CommunicationError

# group_desc -> what a user reads; any other desc d reads "the d group" (an outside engine's
# door names its own groups so). "default_pg" is torch's name for the world group,
# "undefined" its desc for a group made without one.
GROUP_NAMES = {
    "default_pg": "the world group",
    "tp": "the tensor-parallel group",
    "dp": "the data-parallel group",
    "dp_ring": "the data-parallel ring's group",
    "pp": "the pipeline group",
    "pp_backward": "the pipeline's backward group",
    "mp": "the model-parallel group",
    "embedding": "the embedding group",
    "undefined": "an unnamed group",
}

# A backend's words for "the peer did not answer in time" and for "the peer's end closed".
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_CLOSED = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|remote process exited|"
                     r"no route to host|network is unreachable|communicator was aborted", re.IGNORECASE)
_SOURCE = re.compile(r"^\s*\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[.../pair.cc:553] " prefix
_MS = re.compile(r"(\d+)\s*ms\b")


def group_name(group) -> str:
    # dist.group.WORLD is None before init_process_group, and a ProcessGroup has group_desc
    # only in recent torch (2.11-2.13 have it): both name no group.
    desc = getattr(group if group is not None else dist.group.WORLD, "group_desc", None) or "undefined"
    return GROUP_NAMES.get(desc, f"the {desc} group")


def _ranks(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001  (a destroyed group: the message goes without its ranks)
        return []


def _timeout_s(group, reason: str) -> Optional[float]:
    """The group's timeout in seconds: its backend's option (private in torch 2.13: `_timeout`
    on the options of `_get_backend`), else what gloo's text says."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001  (a private attribute: other backends may lack it)
        ms = _MS.search(reason)
        return int(ms.group(1)) / 1000 if ms else None


def _reason(error: BaseException) -> str:
    """The backend's first line without its source path and its advice."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = _SOURCE.sub("", text)
    return text.split(". This is typically caused")[0].rstrip(". ")


def is_lost_peer(error: BaseException) -> bool:
    """An error of the process group's backend (not of the caller's arguments)."""
    if isinstance(error, CommunicationError):
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and bool(_TIMED_OUT.search(str(error)) or _CLOSED.search(str(error)))


def describe(error: BaseException, group, op: str, peer: Optional[int] = None) -> CommunicationError:
    """The one line for `op` on `group` that failed with `error`; `peer`: the global rank
    the op waited on where the caller knows it (a transfer's other end)."""
    ranks = _ranks(group)
    me = dist.get_rank() if dist.is_initialized() else None
    if peer is None and len(ranks) == 2 and me in ranks:
        peer = ranks[1 - ranks.index(me)]  # two ranks: the other one is the peer
    others = [r for r in ranks if r != me]
    who = f"rank {peer}" if peer is not None else ("one of ranks " + ", ".join(map(str, others)) if others
                                                   else "a peer")
    where = f"{op} on {group_name(group)}" + (f" (ranks {', '.join(map(str, ranks))})" if ranks else "")
    reason = _reason(error)
    if _TIMED_OUT.search(reason):
        seconds = _timeout_s(group, reason)
        waited = f" for {seconds:g} s (--distributed-timeout-minutes {seconds / 60:g})" if seconds else ""
        return CommunicationError(f"{where}: no word from {who}{waited}: it stopped or the link to it dropped; "
                                  f"see its log and its host [{reason}]")
    if _CLOSED.search(reason):
        return CommunicationError(f"{where}: {who} closed the connection: it exited or was killed; its own log says "
                                  f"why [{reason}]")
    return CommunicationError(f"{where} failed, waiting on {who} [{reason}]")


def rendezvous_failure(error: BaseException, where: str, timeout_s: float) -> CommunicationError:
    """The one line for ranks that did not meet at start-up (the store at `where`)."""
    return CommunicationError(f"rendezvous at {where} failed within --distributed-timeout-minutes "
                              f"{timeout_s / 60:g}: start every rank, with the same MASTER_ADDR/MASTER_PORT, "
                              f"reachable from every node [{_reason(error)}]")


def translate(error: BaseException, group, op: str, peer: Optional[int] = None) -> BaseException:
    """`error` as a CommunicationError if it is a lost peer; otherwise `error` itself."""
    if not is_lost_peer(error):
        return error
    out = describe(error, group, op, peer)
    out.__cause__ = error
    return out


@contextmanager
def guarded(group, op: str, peer: Optional[int] = None) -> Iterator[None]:
    """Runs a collective's call or wait; a lost peer leaves as a CommunicationError."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  (anything else is re-raised unchanged)
        out = translate(e, group, op, peer)
        if out is e:
            raise
        raise out from e


class GuardedWork:
    """An async op's handle whose wait() speaks as `guarded` does (everything else is the
    backend's Work)."""

    def __init__(self, work, group, op: str, peer: Optional[int] = None):
        self._work, self._group, self._op, self._peer = work, group, op, peer

    def wait(self, *args, **kwargs):
        with guarded(self._group, self._op, self._peer):
            return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self._work, name)

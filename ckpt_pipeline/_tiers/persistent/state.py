"""The state one rank's promoter shares between its parts (``promote`` composes them): what
this rank uploads, what every rank agreed, rank 0's hold on the URL, the rewinds, and the
limits on how long the store may hold a job up."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..._config_groups import PersistentConfig
from ..._format.timeline import Lineage, Rewind
from ...events import Event
from ...storage import Storage
from .connect import Connection
from .owner import Ownership
from .remote import Remote
from .reports import UploadReport
from .urls import display_url
from .workers import DaemonPool

__all__ = ("LIST_WAIT_S", "OPEN_WAIT_S", "Assigned", "PromoterState")

OPEN_WAIT_S = 10.0
"""How long ``open`` waits for the store before the pipeline opens from the local tier."""
LIST_WAIT_S = 60.0
"""How long a restore waits to reach the store and list its steps."""


@dataclass(slots=True)
class Assigned:
    """A step assigned for promotion (the same on every rank): its save, when it committed,
    its commit records' lineage, and how many ranks finished its upload so far; on rank 0
    (which writes its commit object), each of those ranks' checksums."""

    save_id: str
    committed_at: float
    reports: dict[int, UploadReport]
    lineage: Lineage | None = None
    finished: int = 0


class PromoterState:
    """The fields every part of the promoter reads (see the module docstring)."""

    _connection: Connection[Remote]

    def __init__(self, storage: Storage, config: PersistentConfig,
                 emit: Callable[[Event], None], *, rank: int, world_size: int,
                 io_threads: int) -> None:
        self.storage = storage
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.io_threads = io_threads
        self._emit = emit
        self._spec = config.url
        self.remote: Remote | None = None
        self.url = display_url(config.url)
        self._lock = threading.Lock()
        self._uploads = DaemonPool(1, f"ckpt-persist-r{self.rank}")
        self._meta = DaemonPool(1, f"ckpt-persist-meta-r{self.rank}")
        self._futures: list[tuple[bool, concurrent.futures.Future[None]]] = []  # (upload, f)
        self._stopped = False
        # This rank's uploads: unfinished, and finished or failed but not reported yet.
        self._unfinished: dict[int, str] = {}
        self._finished: dict[int, UploadReport] = {}
        self._failures: dict[int, str] = {}
        # Agreed state: the same on every rank.
        self._assigned: dict[int, Assigned] = {}
        self._last_assigned = -1
        self._commits = 0
        self._newest: tuple[int, str, Lineage | None] | None = None
        self._busy: tuple[int, int] = (0, 0)  # (most unfinished promotions on a rank, rank)
        self._unreachable = ""  # the ranks that cannot reach the tier ("": none)
        self._committing: dict[int, str] = {}  # rank 0: steps whose commit object is due
        # Saves first: while a save of this rank writes its shard, uploads wait between parts.
        self._writing = 0
        self._quiet = threading.Condition()
        # Rank 0's hold on the URL; ``_lost_url``: agreed, why promotion stopped.
        self._owner: Ownership | None = None
        self._refused: str | None = None  # rank 0: why acquire() was refused
        self._acquiring = threading.Lock()
        self._opened = False  # open() has returned: a later connection acquires in background
        self._lost_url: str | None = None
        # Rewinds this pipeline knows of, and those rank 0 has yet to record in the tier.
        self._rewinds: dict[int, Rewind] = {}
        self._pending: dict[int, Rewind] = {}
        self._recorded: set[int] = set()

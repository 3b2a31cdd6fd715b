"""Helpers for testing code that checkpoints: storages that misbehave, crash points, power loss.

``FaultyStorage`` wraps the real local storage and fails the Nth call of a kind (``pwrite``,
``fsync``, ``publish``, ``make_dir``, ...) with an errno of your choice, or makes a write short:
``arm(Fault(call, at, errno))``; ``Fault(..., name=".commit")`` counts only the calls about
files whose name ends with ``.commit`` (the commit records). ``GatedStorage`` is a
``FaultyStorage`` that holds the creation of every shard until its ``gate`` (a
``threading.Event``) is set, and sets ``entered`` when a creation is held: a save stays in
flight for as long as the test needs.

Crash points: the pipeline calls ``crash_point(label)`` at labelled moments of save, commit,
retention and scrub (``CRASH_POINTS``); when the environment variable ``CKPT_PIPELINE_CRASH_AT``
arms a label, the process kills itself with SIGKILL there (use it in a child process). The value
is ``<label>`` (the first time the label is reached) or ``<label>:<N>`` (the N-th time, N >= 1;
``seal.done:3`` dies during the third save after arming). Hits are counted per label, in the
process, from when the variable names that label; a malformed value or an unknown label makes
``crash_point`` raise ValueError instead of silently never crashing.

``PowerLossStorage`` simulates a power loss: the real local storage plus a model of what each
``fsync`` and ``fsync_dir`` made durable. ``arm(cut_at=k)`` (or ``cut_if=``, or ``cut()`` from
any thread) turns the power off at a storage call: from then on every call raises ``PowerCut``.
``materialize(dest, rng)`` then writes one possible post-crash disk image (a ``CrashImage``):
the durable state plus a random subset of the volatile directory changes (creates, links,
unlinks, renames) and of the writes since each file's last fsync (kept, dropped or torn).

``capture_logs()`` collects the library's log lines as dicts.

The modules: ``_faults.py`` (``FaultyStorage``, ``GatedStorage``), ``_powerloss.py`` (the
storage that records calls and cuts the power; its calls in ``_recording.py``, its switch in
``_switch.py``), ``_model.py`` (its durability model),
``_image.py`` (post-crash images), ``_logs.py`` (``capture_logs``).
"""

from __future__ import annotations

from .._crash import CRASH_ENV as CRASH_ENV
from .._crash import CRASH_POINTS as CRASH_POINTS
from .._crash import crash_point as crash_point
from ._faults import CALLS as CALLS
from ._faults import Fault as Fault
from ._faults import FaultyStorage as FaultyStorage
from ._faults import GatedStorage as GatedStorage
from ._image import CrashImage as CrashImage
from ._logs import capture_logs as capture_logs
from ._model import VolatileChange as VolatileChange
from ._powerloss import PowerCut as PowerCut
from ._powerloss import PowerLossStorage as PowerLossStorage
from ._powerloss import StorageCall as StorageCall

__all__ = ("CALLS", "CRASH_ENV", "CRASH_POINTS", "CrashImage", "Fault", "FaultyStorage",
           "GatedStorage", "PowerCut", "PowerLossStorage", "StorageCall", "VolatileChange",
           "capture_logs", "crash_point")

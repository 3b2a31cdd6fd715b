"""Coordination across ranks: the control plane (one all-gather primitive) and the agreements
built on it.

``Coordinator`` is the extension point; ``LocalCoordinator`` serves one process,
``DistributedCoordinator`` a torch.distributed job (a gloo group of its own) and
``HierarchicalCoordinator`` one whose ranks agree per node first, then across the nodes'
leaders (gloo groups per node and of the leaders). The agreements
(run id, commit votes, restore candidates) are in the private ``_agree`` module.
"""

from ._control_plane import Coordinator as Coordinator
from ._control_plane import DistributedCoordinator as DistributedCoordinator
from ._control_plane import LocalCoordinator as LocalCoordinator
from ._hierarchy import HierarchicalCoordinator as HierarchicalCoordinator

__all__ = ("Coordinator", "DistributedCoordinator", "HierarchicalCoordinator",
           "LocalCoordinator")

"""Resharding: which saved bytes each live tensor needs, across ranks and meshes.

``boxes``: where each saved DTensor shard lies in its full tensor (a box: an offset and a size
per dimension). ``plan``: the overlap of the saved boxes with the boxes a reader needs, each
element covered exactly once, replicated sources read once.
"""

__all__ = ()

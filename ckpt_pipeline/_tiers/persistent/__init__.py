"""The persistent tier: committed steps promoted to a shared file system or an object store,
and downloaded back at restore.

``remote`` (one persistent root: uploads, downloads, listings, with checksums and retries),
``layout`` (names and the step commit object), ``promote`` (which steps go up, and when a step
is complete there). See docs/distributed.md, "The persistent tier".
"""

__all__ = ()

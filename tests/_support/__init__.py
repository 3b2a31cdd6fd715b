"""The helpers the tests share, imported by name (``from tests._support.children import
spawn_child``); ``tests/conftest.py`` holds only fixtures and hooks.

- ``children``: run the scripts of ``tests/children/`` as other processes, or import one.
- ``cli``: run the ``ckpt-pipeline`` command in this process.
- ``states``: small training states, their exact comparison and tensor digests.
- ``roundtrip``: save, restore and compare exactly; a save that must be refused.
- ``replicas``: the multi-process launcher of the replication suites.
"""

__all__ = ()

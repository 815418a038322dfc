"""Old module path of ``LMCompactMemoryConnector`` (kept for one release).

``LMCompactMemoryConnector`` is now :class:`connectors.lmcompact_connector.LMCompactConnector`
with the ``"release"`` option group on by default; its ``"memory"`` options are read as the
``"release"`` group. Existing ``kv_connector_module_path: connectors.memory.connector``
configs keep loading through this module.
"""

from __future__ import annotations

from connectors.lmcompact_connector import LMCompactConnector, LMCompactMemoryConnector

__all__ = ["LMCompactConnector", "LMCompactMemoryConnector"]

"""Old name of :mod:`lmcompact.vllm` (the vLLM connector), kept for one release.

``import connectors.X`` gives the module ``lmcompact.vllm.X`` itself (one module object
under two names, so a patch through either name is seen by both), so configs with
``"kv_connector_module_path": "connectors.lmcompact_connector"`` (now
``lmcompact.vllm.connector``) or ``"connectors.memory.connector"`` keep loading, and so does
``python -m connectors.vllm_launcher``. New code imports :mod:`lmcompact.vllm`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

OLD = "connectors"
NEW = "lmcompact.vllm"
RENAMED = {
    "connectors.lmcompact_connector": "lmcompact.vllm.connector",
    "connectors.memory.connector": "lmcompact.vllm.connector",
    "connectors.memory.serve_run": "lmcompact.bench.serve_run",
    "connectors.memory.workload": "lmcompact.bench.workload",
}
"""Old module paths whose module moved under another name."""


def new_name(old: str) -> str:
    """The module that the old name ``connectors.X`` stands for."""
    return RENAMED.get(old, NEW + old[len(OLD) :])


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``connectors.X`` to the already importable ``lmcompact.vllm.X``."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(OLD + ".") or fullname == OLD + ".vllm_launcher":
            return None  # the launcher is a real file here (``python -m`` needs its code)
        try:
            found = importlib.util.find_spec(new_name(fullname))
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None  # a module that only exists under the old name
        return importlib.util.spec_from_loader(
            fullname, self, is_package=found.submodule_search_locations is not None
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(new_name(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        return None  # executed under its new name


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

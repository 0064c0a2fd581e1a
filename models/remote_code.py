"""The module file that lets a saved ttr folder load without ``import ttr``.

``save_pretrained`` (``SavesRemoteCode``, a base of ttr's model classes) writes ``MODULE_FILE``
into the folder and ``AUTO_MAP`` into its ``config.json``. transformers then resolves
``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` through that file, which only re-exports the classes of the installed
``ttr`` package: the folder carries no copy of the model code, so a checkpoint always runs the
kernels and fixes of the ttr that is installed.

The import sits in a ``try`` block: transformers skips imports there when it checks a remote
module's requirements, so a missing ttr reaches the user as this module's own message instead of
a generic "missing packages" list.
"""

from __future__ import annotations

from pathlib import Path

MODULE_NAME = "modeling_ttr"
MODULE_FILE = f"{MODULE_NAME}.py"
AUTO_MAP = {
    "AutoConfig": f"{MODULE_NAME}.TTRConfig",
    "AutoModel": f"{MODULE_NAME}.TTRModel",
    "AutoModelForCausalLM": f"{MODULE_NAME}.TTRForCausalLM",
}
MISSING_TTR = (
    "this model folder was saved by ttr; its model classes come from the ttr package, which is "
    "not installed: pip install ttr"
)

MODULE_SOURCE = f'''"""ttr model classes for transformers' Auto classes (trust_remote_code=True).

Written by ttr's save_pretrained. The classes come from the installed ttr package; this file
holds no model code of its own.
"""

try:
    from ttr.models import TTRConfig, TTRForCausalLM, TTRModel
except ModuleNotFoundError as err:
    if err.name not in ("ttr", "ttr.models"):
        raise
    raise ImportError(
        {MISSING_TTR!r}
    ) from err

__all__ = ["TTRConfig", "TTRForCausalLM", "TTRModel"]
'''


def write_remote_code(folder: str | Path) -> Path:
    """Write ``MODULE_FILE`` into ``folder`` and return its path."""
    path = Path(folder) / MODULE_FILE
    path.write_text(MODULE_SOURCE, encoding="utf-8")
    return path


class SavesRemoteCode:
    """Mixin for ``PreTrainedModel`` subclasses: ``save_pretrained`` also writes ``AUTO_MAP`` into
    ``config.json`` and the module file it names."""

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """``PreTrainedModel.save_pretrained``, plus ``auto_map`` in ``config.json`` and the module
        file it names, so the folder also loads with ``trust_remote_code=True`` in a process that
        never imported ttr. The in-memory config keeps its own ``auto_map``: a config saved on its
        own has no module file beside it."""
        previous = self.config.__dict__.get("auto_map")
        self.config.auto_map = dict(AUTO_MAP)
        try:
            super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        finally:
            if previous is None:
                del self.config.auto_map
            else:
                self.config.auto_map = previous
        if is_main_process:
            write_remote_code(save_directory)

"""Whether the installed Horovod is the build ``make setup`` makes: Horovod 0.28.1 patched by
``elastictrain/horovod/patch.py``.

A stock Horovod wheel of the same version imports and trains, but without the patch the driver's abort markers are
ignored, a Gloo error ends the process (``std::terminate``) and a reset's ``hvd.init`` is never tried again. The
patch writes ``horovod/elastictrain_patch.py`` naming its digest; :func:`check_patched_horovod` reads that file
without importing Horovod (a file read: ``elastictrain launch`` and every worker call it at start) and raises
:class:`UnpatchedHorovod`, one line naming ``make setup``, when it is missing or names another patch. Standard
library only.
"""

from __future__ import annotations

import importlib.util
import os

from elastictrain.errors import ElastictrainError

PATCH_DIGEST = "f0a6dad0268cc79a"
"""What ``python elastictrain/horovod/patch.py --digest`` prints for this checkout's patch (a unit test checks that they
agree: a change of the patch changes both)."""

MARKER_MODULE = "elastictrain_patch"
"""The module the patch adds to Horovod's package (``MARKER_FILE`` in ``elastictrain/horovod/patch.py``)."""

FIX = "run `make setup` (it builds and installs the patched Horovod)"


class UnpatchedHorovod(ElastictrainError, RuntimeError):
    """The installed Horovod is not the patched build this checkout needs; the message is one line."""


def installed_patch() -> tuple[str, str | None]:
    """``(where, digest)``: the folder of the Horovod that ``import horovod`` would load, and the digest its marker
    names (None without a marker). Raises :class:`UnpatchedHorovod` when no Horovod is installed."""
    spec = importlib.util.find_spec("horovod")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise UnpatchedHorovod(f"Horovod is not installed for this Python: {FIX}")
    for folder in folders:
        try:
            with open(os.path.join(folder, f"{MARKER_MODULE}.py"), encoding="utf-8") as f:
                text = f.read(4096)
        except (OSError, ValueError):
            continue
        for line in text.splitlines():
            name, sep, value = line.partition("=")
            if sep and name.strip() == "PATCH_DIGEST":
                return folder, value.strip().strip("\"'")
    return folders[0], None


def check_patched_horovod() -> None:
    """Raise :class:`UnpatchedHorovod` unless the installed Horovod carries this checkout's :data:`PATCH_DIGEST`.

    Call it at start, before ``hvd.init``; it imports nothing of Horovod.
    """
    where, found = installed_patch()
    if found is None:
        raise UnpatchedHorovod(
            f"the Horovod at {where} is not the patched build elastictrain needs (it has no {MARKER_MODULE}.py; "
            f"a stock wheel ignores abort markers and dies on Gloo errors): {FIX}"
        )
    if found != PATCH_DIGEST:
        raise UnpatchedHorovod(
            f"the Horovod at {where} carries elastictrain patch {found[:40]!a}, this checkout needs "
            f"{PATCH_DIGEST!r}: {FIX}"
        )

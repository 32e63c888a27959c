"""Patch Horovod 0.28.1's source before the build (``scripts/setup.sh`` runs it): ``python patch_horovod.py SRC``.

**A failed Gloo rendezvous fails ``hvd.init`` instead of killing the process.** In elastic mode every reset calls
``hvd.init``, whose background thread builds the new ring's Gloo contexts. When a peer of the new ring dies after
the driver assigned it and before the ring formed, the others wait for its address until the Gloo timeout, and the
``gloo::IoException`` escapes the background thread: ``std::terminate``, exit 134, for every survivor (then
horovodrun sees every worker failed and stops the job). Only Gloo's I/O errors (a timeout, a peer gone) take the
new path: a worker the driver removed from the job (``has been removed from elastic job``) still ends as before,
since Horovod starts a new worker when its host comes back. The chaos campaign (``python -m chaos campaign``) hits
this with a SIGKILL during a reset's rendezvous. Horovod already has the path for a failed initialisation
(``initialization_failed``: ``hvd.init`` raises ``ValueError``); the patch routes the Gloo set-up into it, leaves
the Gloo context ready for the next try (``Finalize``), and clears the flag when ``hvd.init`` starts again, so a
worker can try the next ring (``elastictrain.engine.collective.reset_horovod`` does).

Each edit is an exact text replacement; a source that does not match exits 1 with the file and the edit named
(another Horovod version needs the patch checked again). Applying it twice is a no-op.
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "elastictrain: a failed Gloo rendezvous"

GLOO_INIT = """#if HAVE_GLOO
#if HAVE_MPI
  if (global_mpi_context.IsEnabled()) {"""
GLOO_INIT_PATCHED = f"""#if HAVE_GLOO
  // {MARK} fails hvd.init (initialization_failed) instead of std::terminate.
  try {{
#if HAVE_MPI
  if (global_mpi_context.IsEnabled()) {{"""

GLOO_END = """    state.process_set_table.Initialize(global_gloo_context);
  }
#endif // HAVE_GLOO

  assert(state.global_controller->IsInitialized());"""
GLOO_END_PATCHED = """    state.process_set_table.Initialize(global_gloo_context);
  }
  } catch (const ::gloo::IoException& ex) {
    LOG(ERROR) << "Horovod could not be initialized: " << ex.what();
    global_gloo_context.Finalize();
    state.initialization_failed = true;
    return;
  }
#endif // HAVE_GLOO

  assert(state.global_controller->IsInitialized());"""

GLOO_INCLUDE = """#include "gloo/gloo_controller.h"
#include "ops/gloo_operations.h"
"""
GLOO_INCLUDE_PATCHED = """#include "gloo/gloo_controller.h"
#include "ops/gloo_operations.h"
#include "gloo/common/error.h"
"""

RESET_FLAG = """    // Reset initialization flag
    horovod_global.initialization_done = false;
"""
RESET_FLAG_PATCHED = """    // Reset initialization flag
    horovod_global.initialization_done = false;
    horovod_global.initialization_failed = false;
"""

EDITS = (
    ("horovod/common/operations.cc", GLOO_INCLUDE, GLOO_INCLUDE_PATCHED),
    ("horovod/common/operations.cc", GLOO_INIT, GLOO_INIT_PATCHED),
    ("horovod/common/operations.cc", GLOO_END, GLOO_END_PATCHED),
    ("horovod/common/operations.cc", RESET_FLAG, RESET_FLAG_PATCHED),
)


def patch(src: Path) -> list[str]:
    """Apply :data:`EDITS` under ``src``; returns what was done. Raises ``ValueError`` when a file does not match."""
    done = []
    texts: dict[str, str] = {}
    for rel, old, new in EDITS:
        text = texts.get(rel)
        if text is None:
            text = (src / rel).read_text()
        if new in text:
            done.append(f"{rel}: already patched")
        elif text.count(old) == 1:
            text = text.replace(old, new)
            done.append(f"{rel}: patched")
        else:
            raise ValueError(f"{rel}: the text to patch was found {text.count(old)} times, not once: {old[:60]!r}")
        texts[rel] = text
    for rel, text in texts.items():
        (src / rel).write_text(text)
    return done


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python patch_horovod.py HOROVOD_SOURCE_DIR\n")
        return 2
    try:
        for line in patch(Path(argv[0])):
            sys.stdout.write(f"patch_horovod: {line}\n")
    except (OSError, ValueError) as e:
        sys.stderr.write(f"patch_horovod: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

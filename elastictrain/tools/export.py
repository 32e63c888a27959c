"""``elastictrain export --run-dir D --out model.pt``: the trained model of a run, for use outside elastictrain.

Writes the model's ``state_dict`` from the latest verified checkpoint as a plain dict of CPU tensors (what
``torch.load(path, weights_only=True)`` reads), and the job's resolved config beside it (``model.pt`` ->
``model.yaml``), which names the task and its arguments, so ``build_task(load_config("model.yaml")).model``
rebuilds the architecture that the weights fit. Exit 2 with one line when the run has no usable checkpoint.
The checkpoints are read where the run kept them: ``--checkpoint-location``, else the ``checkpoint.location`` of
the run_dir's ``config.yaml`` (an object store such as ``s3://bucket/prefix``), else ``run_dir/checkpoints``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from elastictrain.cliutil import OneLineParser
from elastictrain.errors import one_line
from elastictrain.fileio import atomic_file, write_atomic
from elastictrain.rundir import layout

PROG = "elastictrain export"


def main(argv: list[str]) -> int:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--run-dir", required=True, help="the job's run_dir")
    p.add_argument("--out", required=True, help="the state_dict file to write (e.g. model.pt)")
    p.add_argument("--config-out", default=None, help="where the resolved config goes (default: --out with .yaml)")
    p.add_argument(
        "--checkpoint-location",
        default=None,
        help="where the run's checkpoints are (a path or s3://, gs://, az:// URL; default: the checkpoint.location "
        "in the run_dir's config.yaml, else run_dir/checkpoints)",
    )
    args = p.parse_args(argv)
    run_dir, out = Path(args.run_dir), Path(args.out)
    config_out = Path(args.config_out) if args.config_out else out.with_suffix(".yaml")
    from elastictrain.checkpoint.location import storage_for_run_dir
    from elastictrain.checkpoint.storage import LocalStorage

    try:
        storage = storage_for_run_dir(run_dir, args.checkpoint_location)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(storage, LocalStorage) and not storage.root.is_dir():
        print(
            f"{PROG}: error: --run-dir {run_dir}: no checkpoints/ folder at {storage.root} "
            "(not a run dir, or nothing saved)",
            file=sys.stderr,
        )
        return 2
    if not out.parent.is_dir():
        print(f"{PROG}: error: --out {out}: folder {out.parent} does not exist", file=sys.stderr)
        return 2
    import torch
    import yaml

    from elastictrain.checkpoint import load_latest

    try:
        loaded = load_latest(storage, map_location="cpu")
    except OSError as e:  # the store unreachable, or refusing us
        print(f"{PROG}: error: {storage.describe()}: cannot read ({one_line(e)})", file=sys.stderr)
        return 1
    if loaded is None:
        print(f"{PROG}: error: {storage.describe()}: no complete, verified checkpoint", file=sys.stderr)
        return 2
    model = loaded.state.get("model") if isinstance(loaded.state, dict) else None
    if not isinstance(model, dict) or not all(isinstance(t, torch.Tensor) for t in model.values()):
        print(f"{PROG}: error: {loaded.path}: holds no model state_dict", file=sys.stderr)
        return 2
    state = {str(k): t.detach().clone().contiguous() for k, t in model.items()}
    config = (loaded.manifest.get("meta") or {}).get("config")
    if config is None and (run_dir / layout.CONFIG).exists():
        config = yaml.safe_load((run_dir / layout.CONFIG).read_text())
    with atomic_file(out) as f:
        torch.save(state, f)
    wrote = [str(out)]
    if isinstance(config, dict):
        write_atomic(config_out, yaml.safe_dump(config, sort_keys=False))
        wrote.append(str(config_out))
    print(f"exported step {loaded.step} (epoch {loaded.epoch}) of {run_dir}: {', '.join(wrote)} ({len(state)} tensors)")
    return 0

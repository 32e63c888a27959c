"""The operator's tools over a run_dir: status, report, audit, export, the live view and the demo."""

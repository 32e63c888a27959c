"""The run_dir: its records (events, sample ledger, worker errors, the launcher's files)."""

"""The worker's health: the collective watchdog, hung peers, slow hosts and their eviction."""

"""``elastictrain launch`` and what it is made of, one concern per module.

- :mod:`~elastictrain.launcher.options`: :class:`LaunchOptions` and the flags (defaults from the dataclass)
- :mod:`~elastictrain.commands`: every command line (``elastictrain``, worker, agent, horovodrun) and
  horovodrun's environment
- :mod:`~elastictrain.launcher.hosts`: logical hosts of this machine
- :mod:`~elastictrain.launcher.decisions`: what follows a horovodrun (pure), exit codes
- :mod:`~elastictrain.launcher.processes`: starting, recognising, tracking and ending processes by pid
- :mod:`~elastictrain.rundir.launch`: ``launch.lock`` and ``launch.json``
- :mod:`~elastictrain.launcher.etcd`: the one real etcd (embedded, tests, chaos tier, benchmarks)
- :mod:`~elastictrain.launcher.supervisor`: :class:`Launcher`, the supervision loop
- :mod:`~elastictrain.launcher.main`: the command's entry point
- :mod:`~elastictrain.horovod.hvdrun`: ``python -m elastictrain.horovod.hvdrun``, horovodrun with two driver repairs

Importing the package imports nothing else, so ``discovery`` and ``chaos`` can use its light modules
(``commands``, ``hosts``, ``processes``) without torch.
"""

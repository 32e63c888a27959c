"""The worker as a library: each part receives its collaborators, so the loop runs in one process in tests.

============================  =========================================================================
:mod:`.collective`            the world: the ``Collective`` protocol, Horovod's and a one-process one
:mod:`.build`                 device, model, distributed optimizer, scheduler, scaler, the committed state
:mod:`.elastic_state`         Horovod's elastic ``State`` over it: commit, roll back, sync, host updates
:mod:`.sync`                  modules and optimizers from the most advanced rank (also the drop-in's)
:mod:`.reset`                 what a (re)start means: start, reset to report, LR ramp (a pure function)
:mod:`.services`              rank 0's event log, tracker, checkpointer, ledger and progress bar
:mod:`.trainer`               the loop, validation, commits, checkpoints, the end of a worker
:mod:`.watch`                 the collective watchdog armed on an elastic state (also the drop-in's)
:mod:`.horovod_private`       every access to a private attribute of Horovod
============================  =========================================================================

:mod:`elastictrain.engine.compose` composes them over Horovod for ``elastictrain train``.
"""

"""The worker, whole: each part receives its collaborators, so the loop runs in one process in tests.

============================  =========================================================================
:mod:`.worker`                ``elastictrain train``: the entry horovodrun starts on every slot
:mod:`.compose`               the parts composed over Horovod: trainer, services, the armed watchdog
:mod:`.collective`            the world: the ``Collective`` protocol, Horovod's and a one-process one
:mod:`.build`                 device, model, distributed optimizer, scheduler, scaler, the committed state
:mod:`.state`                 the complete training state, committed in memory and rolled back in place
:mod:`.elastic_state`         Horovod's elastic ``State`` over it: commit, roll back, sync, host updates
:mod:`.sampler`               the exactly-once sampler: each step's positions over the current workers
:mod:`.step`                  one optimizer step: micro-batches, AMP, gradient weighting
:mod:`.policy`                LR and batch policies across world sizes
:mod:`.sync`                  modules and optimizers from the most advanced rank (also the drop-in's)
:mod:`.reset`                 what a (re)start means: start, reset to report, LR ramp (a pure function)
:mod:`.services`              rank 0's event log, tracker, checkpointer, ledger and progress bar
:mod:`.tracking`              MLflow, off the training step
:mod:`.trainer`               the loop, validation, commits, checkpoints, the end of a worker
:mod:`.watch`                 the collective watchdog armed on an elastic state (also the drop-in's)
:mod:`.task_trial`            a task tried on real samples before a job starts
:mod:`.dropin`                ``ElasticState``, ``ElasticSampler``, ``elastic_run`` for Horovod scripts
:mod:`.data`, :mod:`.models`  the built-in image task's data and models
:mod:`.health`                watchdog, hung peers, slow hosts, eviction; the signals workers exchange
============================  =========================================================================

Every access to a private attribute of Horovod is in :mod:`elastictrain.horovod.private`.
"""

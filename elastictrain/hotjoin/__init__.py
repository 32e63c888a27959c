"""Hot join: a warm worker factory (zygote) per job and host, so that a worker joining a running job starts at once.

The node agent keeps a zygote (:mod:`~elastictrain.hotjoin.server`) that imports and indexes what a worker of its
job needs, once; horovodrun runs the thin client (:mod:`~elastictrain.hotjoin.client`) instead of the worker, which
has the zygote fork the worker with the client's arguments, environment, working directory and standard streams.
Both ends speak :mod:`~elastictrain.hotjoin.protocol`. Contract:

- One zygote per job, host and etcd (endpoints and key prefix); only its own user may connect (a 0700 folder, a 0600
  socket, SO_PEERCRED), and it forks only for the config and ``--set`` overrides it warmed.
- A forked worker is the cold worker: same arguments, environment, working directory, streams, ``sys.path`` and
  thread counts. The zygote forks only when the client's Python, ``sys.path`` and load-time variables are its own,
  only with one thread and no CUDA initialised; else it answers ``error``.
- With no zygote (no socket, no answer, an ``error``) the client execs the cold command; while a zygote warms (its
  marker beside the socket) the client waits for it, up to a bound, then starts cold.
- A forked worker dies with the zygote and is killed when its client's connection closes; the client relays signals
  and exits as the worker exits. The zygote answers every connection within a bound, waits on none, and on SIGTERM
  stops taking requests and exits when its workers have.
- It never serves code older than the files on disk: on a change of any file it imported from the project, the
  task's package or the user's code, or of its config, it refuses requests and re-executes itself once its workers
  have exited (restarts in a row back off up to 60 s).
- The zygotes of one machine warm at most one per usable core at a time.
"""

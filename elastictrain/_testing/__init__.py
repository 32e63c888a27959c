"""Private test infrastructure: the job harness, for the test suite, the chaos tier and the benchmarks.

Not a user API and not covered by compatibility: names here change with the tests that use them.
:mod:`elastictrain._testing.jobs` runs a real elastic ``horovodrun`` job on logical local hosts and acts on it
(:class:`~elastictrain._testing.jobs.ElasticJob`); :mod:`elastictrain._testing.procs` polls with a deadline and
kills process trees by pid. Both raise :class:`~elastictrain._testing.procs.HarnessError`. It lives in the
package (not in ``tests/``) because ``elastictrain bench``, a command, runs its jobs through it.
"""

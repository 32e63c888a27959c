"""Host membership for elastictrain: registry (etcd / in-memory), node agent, discover.sh.

Never imports torch or horovod: discover.sh runs every second and must start fast.
"""

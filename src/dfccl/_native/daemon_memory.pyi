# A daemon's memory layout is C only (daemon_memory.pxd): Daemon calls it.

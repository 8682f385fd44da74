"""radixmux.common: process plumbing every process imports (below the scheduler,
the runners and the runtime; above ``memory`` and ``protocol``).

* ``server_args``   the one flag set (``ServerArgs``) and the choices it offers
* ``process``       a runtime process's context, logging, start and inbox
* ``ipc``           ZeroMQ endpoints in a private runtime directory, sockets
* ``os_process``    a child tied to its parent from its first instruction; a fast exit
* ``owner``         who made a shared file (arena, runtime dir), and removing a dead one's
* ``cpu``           what this CPU can do; the cores this process may use
* ``file_lock``     one process at a time fills a shared on-disk cache entry (``flock``)
* ``heap``          freed C-heap pages back to the OS after a load (``malloc_trim``)
* ``allowed_names`` Host and Origin allow-lists (checked with the flags, applied by the front)
"""

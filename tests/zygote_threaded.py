"""Preloaded by a test's zygote: a module that starts a thread on import, which
makes forking that process unsafe (test_zygote.py)."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()

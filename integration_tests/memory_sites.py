"""Every storage a tracker registers, by allocation site, for test_memory_validation_sites.py. Written for the test.

    python memory_sites.py [--tracker] -m module args...   (or script.py args...)

It wraps `prism_plugin.device.memory.StorageTracker._register` (the virtual GPU's allocator tracker and the CPU
tracker alike) and, when the program returns, prints one ``MEMORY_SITES {json}`` line: per site (``file:line`` of
the innermost frame in ``prism_plugin/programs/``, else the innermost frame outside torch and prism_plugin; a thread
with neither, as autograd's device thread, is ``(none)``) the count and bytes of the storages registered there, and
their sizes in order. ``--tracker`` starts a CPU `StorageTracker` first (a fake-CPU run has none
of its own).
"""

import json
import sys
import traceback
from collections import defaultdict

from prism_plugin.device import memory
from prism_plugin.runtime.lifecycle import run_target

sites: dict = defaultdict(lambda: [0, 0, []])
_register = memory.StorageTracker._register


def _site() -> str:
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if "prism_plugin/programs/" in f.filename:
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
    for f in reversed(frames):
        if "/torch/" not in f.filename and "/prism_plugin/" not in f.filename:
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
    return "(none)"


def register(self, t):
    before = self.allocations
    _register(self, t)
    if self.allocations > before:
        entry = sites[_site()]
        entry[0] += 1
        nbytes = self._live[next(reversed(self._live))][1]  # the storage just registered
        entry[1] += nbytes
        entry[2].append(nbytes)


memory.StorageTracker._register = register
args = sys.argv[1:]
if args and args[0] == "--tracker":
    args = args[1:]
    memory.StorageTracker().start()
run_target(args)  # a virtual-GPU process ends with os._exit (no atexit): print when the program returns
print("MEMORY_SITES " + json.dumps(dict(sorted(sites.items()))), flush=True)

"""SGLang's HTTP server with the conformance suite's fault injectors
(:mod:`kvattn.conformance.sglang_faults`) in every process it runs::

    python -m kvattn.conformance.sglang_server SGLANG_SERVER_ARGS...

It takes ``python -m sglang.launch_server``'s arguments and runs that module. SGLang starts its
scheduler and detokenizer with multiprocessing's spawn method, which runs this module again in
each of them (as ``__mp_main__``, before the process's target is unpickled), so the injectors are
installed there too, before SGLang's modules load. The injectors touch only requests whose id
(or cache salt) names a fault (``"lost-write:..."``); every other request is served as by
SGLang's own server.
"""

from __future__ import annotations

import runpy

from kvattn.conformance import sglang_faults

sglang_faults.install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__")

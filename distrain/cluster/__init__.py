"""Ray only (no torch, no models): connect to a cluster, place workers, run a function on them.

An embedded cluster binds loopback only. Ray reads the switch for that once, when it is first
imported, so it is set here, before any module of this package imports Ray, and only when no
RAY_ADDRESS names a cluster to attach to (whose nodes must reach this driver on its real address).
"""

import os

if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1, not the external NIC
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a private cluster phones nobody

"""A follower process for fleet tests: `python -m tests.support.fleet_replica URL REPLICA_ID [--coordinated]`.

Follows the run with a heartbeat every 0.1 s (no engine: the mirror is the replica), prints
"following" once it serves a version, and runs until killed.
"""

from __future__ import annotations

import sys
import time

from sparsesync.protocol.follower.fleet_member import FleetOptions
from sparsesync.protocol.follower.follower import Follower


def main() -> None:
    url, replica_id = sys.argv[1], sys.argv[2]
    fleet = FleetOptions(replica_id=replica_id, interval_s=0.1, engine="mirror",
                         coordinated="--coordinated" in sys.argv, switch_deadline_s=5.0)
    follower = Follower(url, poll_interval=0.05, max_poll_interval=0.05, fleet=fleet)
    follower.start()
    while follower.current_version is None:
        time.sleep(0.02)
    print("following", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()

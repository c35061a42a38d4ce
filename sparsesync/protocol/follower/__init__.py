"""The follower wing: a replica keeping its engine at the newest committed version of a run.

- `follower`: `Follower`, the one entry point: poll, fetch, verify, apply, report.
- `mirror`: the verified host copy of the weights (one unnamed file map, paged out for vLLM).
- `hooks`: `ApplyHook`, what an engine plugs in, and `FollowerStatus`, what is reported.
- `backoff`: when a follower tries again after a failed sync.
- `fleet_member`: heartbeats and coordinated switches, as one member of a fleet.
- `refusals`: commits the follower refuses, logged once and reported.

Imports nothing from `sparsesync.protocol.writer` (contract "wings" in pyproject.toml).
"""

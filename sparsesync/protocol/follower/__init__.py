"""The follower wing: a replica keeping its engine at the newest committed version of a run.

- `follower`: `Follower`, the one entry point: plans each sync, keeps and reports the status.
  Its parts: `mirror_steps` (`HeldMirror`: what the mirror holds, and how an anchor or a delta
  gets into it), `engine_steps` (`EngineSteps`: how a verified version reaches the engine, and
  the reload when the hook fails), `polling` (how long the background loop waits before it looks again).
- `mirror`: where the mirror lives (one unnamed file map, paged out for vLLM).
- `hooks`: `ApplyHook`, what an engine plugs in (with its typed capability fields), and
  `FollowerStatus`, what is reported.
- `backoff`: when a follower tries again after a failed sync.
- `fleet_member`: heartbeats and coordinated switches, as one member of a fleet.
- `refusals`: commits the follower refuses, logged once and reported.

Imports nothing from `sparsesync.protocol.writer` (contract "wings" in pyproject.toml).
"""

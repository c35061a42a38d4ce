"""A run in a bucket: the protocol's map.

Two wings over a shared read model. Neither wing imports the other (import-linter contract
"wings" in pyproject.toml); both, and the tools (`push`/`pull`, `verify`, `status`, `log`),
read a run through the modules at this level.

- `writer/`: the trainer's side. `writer.publisher.Publisher` (the one entry point) and its
  parts: config, commits (the writer epoch, the commit record last), uploads, anchors, whole /
  sharded encoding, ranks, rewind, parts (a version cut into parts), anchor_shards.
- `follower/`: the replica's side. `follower.follower.Follower` (poll, fetch, verify, apply),
  its mirror (the verified host copy), hooks (what an engine plugs in), backoff, fleet_member
  (heartbeats and coordinated switches as a member), refusals (commits it refuses, reported).
- The shared read model: keys (every object key), records/ (every JSON record, typed; a
  commit's metrics too), run (`Run`, the one reader of a run's versions: the newest trusted
  commit, chains, anchors), parts_reader (fetching and applying a version's parts), extras
  (non-weight files), lineage (versions across rewinds), fleet (the fleet's records and its
  health report, `fleet_report`), history (`log`'s rows and rewind lines), adapter_runs (a
  commit's `adapter` field checked against the run's other commits), gc, verify. The CLI and
  `transfer` only render and carry out what these return.

Below the protocol, `sparsesync.lora` holds what an adapter is without a run (the PEFT bridge,
the config bounds, `AdapterMeta`, the adapter state a publisher publishes): the protocol calls
down into it, never the reverse.
"""
